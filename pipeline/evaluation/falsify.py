"""Search the config's envelope for a plant and an attack on which the shield lets a violation through.

The search space is every randomization set of the config: each randomized
scale (`body_mass.cart`, `actuator_gain.rotor0`, ...) and the latency, pinned
per candidate to one value inside the set's range (noise and pushes stay as the
set states them), times the adversary's knobs (`AdversaryParams`: which
constraint, when, how hard, how far past, and a back-and-forth timed against
the latency). The budget is `falsify.candidates`, a count: for a seed, the
same candidates and the same verdict on any machine however loaded (a clock's
budget searched a fraction as much on a busy machine, and certified there what
a quiet one refused). `falsify.budget_s` (or `budget_s`) adds a wall-clock cap
for whoever asks; the search stops at whichever comes first, or at the first
case, and the summary's `cut_short` says when the clock ended it. Phases, each
with its share of the budget:

1. corners (each range at one of its ends) with the default adversary, the
   random and the bang-bang policy (and the bundle's policy, given one): every
   corner, in a random order, while they number at most half the count (so the
   verdict does not hang on which corners a seed reached first); else
   `falsify.corner_share` of the budget, the corners in a random order while
   they fit that share, else drawn at random (2^d of them for d randomized
   parameters: enumerating 2^12 corners of one set would spend the budget
   before anything else ran);
2. random draws of domain and attack (a tenth of the budget);
3. the rest in a cross-entropy search: per set, a Gaussian over the
   normalized domain and attack parameters, refit each generation to the
   candidates with the lowest barrier value h (the first fit takes the best
   of phases 1-2), restarted wide once it has collapsed without progress.
   Cross-entropy rather than CMA-ES: each candidate's h is noisy (its own
   episode seeds, pushes, sensor noise) and two of its dimensions are
   discrete (latency, the attacked constraint); an elite refit with a floor
   on the spread is robust to both, needs nothing beyond numpy, and the
   refit costs nothing next to one candidate's episodes. It drives the
   adversary only: with odds over the policies refit the same way, the random
   and bang-bang policies' low but harmless h drew generations away from the
   attack, and planted faults the adversary alone finds went unfound.

Each candidate runs `falsify.episodes_per_candidate` shielded episodes of
`falsify.episode_steps` steps (default: the plant's own episode; `pipeline.evaluation.evaluate`); its score is
the lowest h the shield saw. A case is a candidate with a violating step
(info["cost"] on the true state): it is written as `case-N.yaml` (the pinned
domain, usable as `--domains`) and `case-N.json` (set, seed, policy, attack
and the command that replays it); `sim2real falsify` then exits 1.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from envs.randomization import SCALE_GROUPS
from pipeline.evaluation.adversary import REFERENCE_POLICIES, AdversaryParams, reference_policy
from pipeline.evaluation.episodes import combine_constraint_figures, cut_short_note
from pipeline.evaluation.evaluate import evaluate
from pipeline.progress import Progress
from pipeline.safety.sampling import range_parameters

_ELITE = 0.25  # share of a cross-entropy generation that refits the Gaussian
_RANDOM_SHARE = 0.1  # of the budget, for phase 2
# Every corner runs, whatever falsify.corner_share, while they number at most this share of the count: a search
# that stopped at the share ran 120 of a reaction-wheel pendulum's 288 and certified it with seed 0, where seed 11's
# order reached a violating corner. Above it, the optimizer keeps most of the budget.
_ALL_CORNERS_SHARE = 0.5
_SMOOTHING = 0.7  # weight of the new elite fit against the old Gaussian: a noisy elite moves it, not replaces it
_MIN_SD = 0.05  # floor on the spread (normalized units): a discrete dimension keeps being explored
_STALL_GENERATIONS = 4  # generations without a lower h, with the spread at its floor, before a wide restart
_ATTACK_DIMS = 5  # target, start_step, strength, overshoot, flip_every (all normalized to [0, 1])


@dataclass
class Candidate:
    """One point of the search: a set, a normalized domain x in [0, 1]^k, a policy and an attack."""

    set_name: str
    x: np.ndarray
    policy: str
    attack: np.ndarray  # normalized AdversaryParams
    seed: int


def parameters(rset) -> list[tuple[str, float, float]]:
    """(name, low, high) of every randomized quantity of a set: its physical scales (`range_parameters`), and its
    latency (an integer range)."""
    out = range_parameters(rset)
    if rset.latency_steps is not None:
        out.append(("latency_steps", rset.latency_steps.low, rset.latency_steps.high))
    return out


def pin(doc: dict, name: str, value: float) -> dict:
    """`doc` (a set as a plain mapping) with parameter `name` (a `parameters` name) held at `value`; in place."""
    if name == "latency_steps":
        v = int(round(value))
        doc["latency_steps"] = {"low": v, "high": v}
    elif name == "gravity_scale":
        doc["gravity_scale"] = {"dist": "uniform", "low": float(value), "high": float(value)}
    else:
        group, element = name.split(".", 1)
        doc[group][element] = {"dist": "uniform", "low": float(value), "high": float(value)}
    return doc


def pinned_domain(rset, x: np.ndarray) -> dict:
    """The set with every range pinned to one value (x in [0, 1] per parameter), as a plain mapping."""
    doc = rset.model_dump(mode="json", exclude_none=True)
    for (name, lo, hi), xi in zip(parameters(rset), np.clip(x, 0.0, 1.0)):
        pin(doc, name, lo + xi * (hi - lo))
    return doc


def envelope_set(cfg):
    """One set spanning every set of the config: each range the union of theirs, the largest noise and push.

    Its corners are the extreme plants the config admits (the hull may add milder
    combinations that no single set holds; never harsher ones in any one parameter).
    """
    from envs.randomization import parse_randomization

    sets = list(cfg.randomization.values())
    doc: dict = {}
    for group in SCALE_GROUPS:
        ranges: dict = {}
        for rset in sets:
            for el, r in getattr(rset, group).items():
                lo, hi = ranges.get(el, (r.low, r.high))
                ranges[el] = (min(lo, r.low), max(hi, r.high))
        if ranges:
            doc[group] = {el: {"low": lo, "high": hi} for el, (lo, hi) in ranges.items()}
    lat = [r.latency_steps for r in sets if r.latency_steps is not None]
    if lat:
        doc["latency_steps"] = {"low": min(x.low for x in lat), "high": max(x.high for x in lat)}
    grav = [r.gravity_scale for r in sets if r.gravity_scale is not None]
    if grav:
        doc["gravity_scale"] = {"low": min(g.low for g in grav), "high": max(g.high for g in grav)}
    for key in ("obs_noise_std", "action_noise_std"):
        widest = max((list(getattr(r, key)) for r in sets), key=lambda v: (max(v), len(v)))
        doc[key] = widest
    pushes = [r.push for r in sets if r.push is not None]
    if pushes:
        doc["push"] = max(pushes, key=lambda p: p.max_force * p.probability * p.duration_steps).model_dump(mode="json")
    return parse_randomization(doc, "envelope")


def corner_domains(rset) -> list[dict]:
    """Every corner of a set: each range at one of its ends, as pinned domain mappings."""
    k = len(parameters(rset))
    return [pinned_domain(rset, np.array(c)) for c in itertools.product((0.0, 1.0), repeat=k)]


def attack_params(a: np.ndarray, n_constraints: int) -> AdversaryParams:
    """Normalized attack vector -> AdversaryParams (target -1 means the nearest constraint)."""
    a = np.clip(a, 0.0, 1.0)
    return AdversaryParams(
        target=int(np.floor(a[0] * (n_constraints + 1) - 1e-9)) - 1,
        start_step=int(round(a[1] * 50)),
        strength=float(0.3 + 0.7 * a[2]),
        overshoot=float(1.5 * a[3]),
        flip_every=int(round(a[4] * 6)),
    )


_DEFAULT_ATTACK = np.array([0.0, 0.0, 1.0, 0.4, 0.0])  # nearest constraint, at once, full force, 0.6 past


def generation_size(dims: int) -> int:
    """Candidates per cross-entropy generation for a search over `dims` normalized parameters (CMA-ES's rule)."""
    return max(8, 4 + int(3 * np.log(dims)))


class Falsifier:
    """The search state: config, spec, policies, budget; `run()` returns the summary."""

    def __init__(
        self,
        cfg,
        spec,
        *,
        bundle_policy=None,
        budget_s: float | None = None,
        seed: int | None = None,
        out_dir: str | Path | None = None,
        progress: bool = False,
        candidates: int | None = None,
    ):
        self.cfg, self.spec = cfg, spec
        self.bundle_policy = bundle_policy
        clock = cfg.falsify.budget_s if budget_s is None else budget_s
        self.budget_s = math.inf if clock is None else float(clock)
        self.candidates = cfg.falsify.candidates if candidates is None else int(candidates)
        self.seed = cfg.falsify.seed if seed is None else int(seed)
        self.rng = np.random.default_rng(self.seed)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.progress = progress
        # A set identical to one before it (YAML anchors: train, validation and reality alike) is searched once, under
        # the first one's name: searched again it only repeated the same plants, and its corners took the share of
        # the count that a single set's would have run in full (a hoist's 64 corners x 3 policies, thrice).
        self.sets: dict[str, tuple] = {}
        self.same_as: dict[str, str] = {}
        for name, rset in cfg.randomization.items():
            first = next((n for n, (r, _) in self.sets.items() if r == rset), None)
            if first is None:
                self.sets[name] = (rset, parameters(rset))
            else:
                self.same_as[name] = first
        self.policies = (
            [p for p in REFERENCE_POLICIES if p != "legacy"]  # the attacks (the legacy one is trusted)
            + (["bundle"] if bundle_policy is not None else [])
        )
        self.n_constraints = len(spec.constraints)
        self.evaluated = 0
        self.constraints: dict = {}  # per constraint over every candidate (episodes.combine_constraint_figures)
        self.best: dict | None = None
        self.cases: list[dict] = []
        # Per set: (h, [x, attack]) of every adversarial candidate, the optimizer's starting population.
        self._history: dict[str, list[tuple[float, np.ndarray]]] = {name: [] for name in self.sets}
        self._t0 = 0.0
        self._bar: Progress | None = None  # over the candidates: a bar on a terminal, plain lines otherwise

    def _left(self) -> float:
        return self.budget_s - (time.monotonic() - self._t0)

    def _spent(self, share: float = 1.0, since: tuple[float, int] = (0.0, 0)) -> bool:
        """Has `share` of the budget (the candidates, and the clock where one is set) been spent since `since`?"""
        if self.cases or self._left() <= 0:
            return True
        t_since, n_since = since
        if time.monotonic() - self._t0 - t_since >= share * self.budget_s:
            return True
        return self.evaluated >= self.candidates or self.evaluated - n_since >= share * self.candidates

    def _mark(self) -> tuple[float, int]:
        return time.monotonic() - self._t0, self.evaluated

    def _policy(self, cand: Candidate):
        if cand.policy == "bundle":
            return self.bundle_policy
        params = attack_params(cand.attack, self.n_constraints) if cand.policy == "adversarial" else None
        return reference_policy(cand.policy, self.cfg, self.spec, seed=cand.seed, params=params)

    def evaluate(self, cand: Candidate) -> dict:
        """Run one candidate; record it as the best (lowest h) and as a case when it violated."""
        from envs.randomization import parse_randomization

        rset, _ = self.sets[cand.set_name]
        domain = pinned_domain(rset, cand.x)
        result = evaluate(
            self.cfg,
            self._policy(cand),
            domains=parse_randomization(domain),
            seed=cand.seed,
            episodes=self.cfg.falsify.episodes_per_candidate,
            shield=True,
            spec=self.spec,
            max_episode_steps=self.cfg.falsify.episode_steps,
        )
        self.evaluated += 1
        self.constraints = combine_constraint_figures([self.constraints, result.get("constraints", {})])
        h = result["min_h"] if result["min_h"] is not None else float("inf")
        record = {
            "set": cand.set_name,
            "domain": domain,
            "seed": cand.seed,
            "policy": cand.policy,
            "attack": attack_params(cand.attack, self.n_constraints).to_dict()
            if cand.policy == "adversarial"
            else None,
            "episodes": self.cfg.falsify.episodes_per_candidate,
            "episode_steps": self.cfg.falsify.episode_steps,
            "min_h": h,
            "violations": result["violations"],
        }
        if cand.policy == "adversarial":
            self._history[cand.set_name].append((h, np.concatenate([np.clip(cand.x, 0, 1), cand.attack])))
        if self.best is None or h < self.best["min_h"]:
            self.best = record
        if result["violations"] > 0:
            self.cases.append(self._write_case(record))
        if self._bar is not None:
            self._bar.update_to(
                min(self.evaluated, self._bar.total),
                {"evaluated": self.evaluated, "cases": len(self.cases), "worst h": f"{self.best['min_h']:.4f}"},
            )
        return record

    def _write_case(self, record: dict) -> dict:
        if self.out_dir is None:
            return record
        self.out_dir.mkdir(parents=True, exist_ok=True)
        n = len(self.cases)
        domain_path, case_path = self.out_dir / f"case-{n}.yaml", self.out_dir / f"case-{n}.json"
        domain_path.write_text(yaml.safe_dump(record["domain"], sort_keys=True))
        record = dict(record, domain_file=str(domain_path), case_file=str(case_path))
        case_path.write_text(json.dumps(record, indent=2) + "\n")
        return record

    def corner_count(self) -> int:
        """Corner candidates of the whole search: 2^d per set, times the policies tried at each."""
        return sum(2 ** len(params) for _, params in self.sets.values()) * len(self.policies)

    def _corners(self, limit: int):
        """Corner candidates: in a random order without repeats while there are at most a few thousand, or `limit`
        (the share of the budget cuts the order short), else drawn at random per set, round robin, without building
        the 2^d list."""
        names = list(self.sets)
        total = self.corner_count()
        if total <= max(limit, 4096):
            order = [
                (name, np.array(c), policy)
                for name, (_, params) in self.sets.items()
                for c in itertools.product((0.0, 1.0), repeat=len(params))
                for policy in self.policies
            ]
            for i in self.rng.permutation(len(order)):  # budget-limited: every corner equally likely to be reached
                name, x, policy = order[i]
                yield Candidate(name, x, policy, _DEFAULT_ATTACK.copy(), int(self.rng.integers(2**31)))
            return
        turn = 0
        while True:
            name = names[turn % len(names)]
            policy = self.policies[(turn // len(names)) % len(self.policies)]
            turn += 1
            x = self.rng.integers(0, 2, len(self.sets[name][1])).astype(np.float64)
            yield Candidate(name, x, policy, _DEFAULT_ATTACK.copy(), int(self.rng.integers(2**31)))

    def _random(self, name: str) -> Candidate:
        k = len(self.sets[name][1])
        return Candidate(
            name,
            self.rng.uniform(0, 1, k),
            "adversarial",
            self.rng.uniform(0, 1, _ATTACK_DIMS),
            int(self.rng.integers(2**31)),
        )

    def _fit(self, name: str, dims: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        """A Gaussian over the best candidates seen in set `name` (wide and centred when there are too few)."""
        seen = sorted(self._history[name], key=lambda t: t[0])[: max(2, int(_ELITE * size))]
        if len(seen) < 2:
            return np.full(dims, 0.5), np.full(dims, 0.35)
        elite = np.array([z for _, z in seen])
        return elite.mean(axis=0), np.maximum(elite.std(axis=0), 0.2)  # broad at first: the elite is a guess

    def _cross_entropy(self, phases: dict) -> None:
        names = list(self.sets)
        state = {}
        for n in names:
            dims = len(self.sets[n][1]) + _ATTACK_DIMS
            size = generation_size(dims)
            mu, sd = self._fit(n, dims, size)
            state[n] = {"mu": mu, "sd": sd, "size": size, "best": np.inf, "stall": 0}
        turn = 0
        while not self._spent():
            name = names[turn % len(names)]
            turn += 1
            st = state[name]
            k = len(self.sets[name][1])
            scored = []
            for _ in range(st["size"]):
                if self._spent():
                    break
                z = np.clip(self.rng.normal(st["mu"], st["sd"]), 0.0, 1.0)
                rec = self.evaluate(Candidate(name, z[:k], "adversarial", z[k:], int(self.rng.integers(2**31))))
                scored.append((rec["min_h"], z))
                phases["cross_entropy"] += 1
            if len(scored) < 2:
                continue
            scored.sort(key=lambda t: t[0])
            elite = np.array([z for _, z in scored[: max(2, int(_ELITE * len(scored)))]])
            st["mu"] = _SMOOTHING * elite.mean(axis=0) + (1 - _SMOOTHING) * st["mu"]
            st["sd"] = np.maximum(_SMOOTHING * elite.std(axis=0) + (1 - _SMOOTHING) * st["sd"], _MIN_SD)
            if scored[0][0] < st["best"]:
                st["best"], st["stall"] = scored[0][0], 0
            elif np.all(st["sd"] <= 1.5 * _MIN_SD):
                st["stall"] += 1
            if st["stall"] >= _STALL_GENERATIONS:  # collapsed on a local minimum: search the whole set again
                st["mu"], st["sd"], st["stall"] = np.full(len(st["mu"]), 0.5), np.full(len(st["mu"]), 0.35), 0
                phases["restarts"] += 1

    def run(self) -> dict:
        """Corners, then random draws, then cross-entropy, until a case is found or the budget is spent."""
        self._t0 = time.monotonic()
        if self.progress:
            self._bar = Progress(self.candidates, unit="candidate", desc="falsify")
        phases = {"corners": 0, "random": 0, "cross_entropy": 0, "restarts": 0}
        share = self.cfg.falsify.corner_share
        if self.corner_count() <= _ALL_CORNERS_SHARE * self.candidates:
            share = max(share, self.corner_count() / self.candidates)
        since = self._mark()
        for cand in self._corners(int(share * self.candidates)):
            if self._spent(share, since):
                break
            self.evaluate(cand)
            phases["corners"] += 1
        names = list(self.sets)
        since = self._mark()
        while not self._spent(_RANDOM_SHARE, since):
            self.evaluate(self._random(names[int(self.rng.integers(len(names)))]))
            phases["random"] += 1
        self._cross_entropy(phases)
        if self._bar is not None:
            self._bar.close()
        wall = time.monotonic() - self._t0
        return {
            "task": self.cfg.task.name,
            "cases_found": len(self.cases),
            "cases": self.cases,
            "min_h": None if self.best is None else self.best["min_h"],
            "worst": self.best,
            "evaluated": self.evaluated,
            "phases": phases,
            "evals_per_s": self.evaluated / max(wall, 1e-9),
            "dimensions": {n: len(p) + _ATTACK_DIMS for n, (_, p) in self.sets.items()},
            "corners_total": self.corner_count(),
            "same_sets": dict(self.same_as),  # a set searched as the identical one named
            "policies": list(self.policies),
            "constraints": self.constraints,
            "candidates": self.candidates,
            "budget_s": self.budget_s if math.isfinite(self.budget_s) else None,
            # The clock ended it before its count: the verdict then depends on how busy the machine was.
            "cut_short": not self.cases and self.evaluated < self.candidates,
            "seed": self.seed,
            "wall_s": wall,
        }


# What a caller keeps of a search's summary (a flow's persisted result, the CLI's JSON): its verdict, its extent
# and what reproduces it. `cases` (each case's record) only where the caller asks for it.
RECORD_KEYS = (
    "cases_found", "min_h", "worst", "evaluated", "phases", "corners_total", "policies", "candidates", "budget_s",
    "cut_short", "seed", "wall_s", "same_sets",
)  # fmt: skip


def record(summary: dict, cases: bool = False) -> dict:
    """The kept part of a falsify() summary (RECORD_KEYS, and its cases where `cases`)."""
    return {k: summary.get(k) for k in (*RECORD_KEYS, *(("cases",) if cases else ()))}


def extent(summary: dict, clock: str = "falsify.budget_s") -> str:
    """How far a search went: candidates (corners among them) and time, and whether the clock (`clock`: the key or
    flag that set it) cut it short of its count, when the verdict depends on how busy the machine was."""
    corners, total = (summary.get("phases") or {}).get("corners"), summary.get("corners_total")
    policies = summary.get("policies") or []
    said = f"{summary['evaluated']} candidates"
    if corners is not None and total:
        # A corner candidate is a plant corner under one policy: the bundle's policy, when attacked, adds its own.
        each = f": {total // len(policies)} plant corners x {len(policies)} policies" if policies else ""
        said += f" ({corners} of {total} corner candidates{each})"
    said += f" in {summary['wall_s']:.0f} s"
    same = summary.get("same_sets") or {}
    if same:
        said += " (" + ", ".join(f"{n} searched as {first}, the same set" for n, first in same.items()) + ")"
    if summary.get("cut_short"):
        said += (
            f", {cut_short_note(clock)} ({clock} {summary['budget_s']:g} s, falsify.candidates "
            f"{summary['candidates']}), so unset {clock} for a verdict that does not depend on it"
        )
    return said


def replay_case(cfg, case: dict | str | Path, spec, bundle_policy=None) -> dict:
    """Run a written case again (same pinned domain, seed, policy, attack); returns evaluate()'s result. A case found
    against a bundle's policy needs that policy (`bundle_policy`: an `EdgeRuntime` loaded without its shield)."""
    from envs.randomization import parse_randomization

    if not isinstance(case, dict):
        case = json.loads(Path(case).read_text())
    if case["policy"] == "bundle":
        if bundle_policy is None:
            raise ValueError("this case attacked a bundle's policy: replay it with that bundle")
        policy = bundle_policy
    else:
        params = AdversaryParams(**case["attack"]) if case.get("attack") else None
        policy = reference_policy(case["policy"], cfg, spec, seed=case["seed"], params=params)
    return evaluate(
        cfg,
        policy,
        domains=parse_randomization(case["domain"]),
        seed=case["seed"],
        episodes=case["episodes"],
        shield=True,
        spec=spec,
        max_episode_steps=case["episode_steps"],
    )


def attacked(cfg, bundle: str | None = None, spec=None):
    """(shield spec, bundle policy or None) that a search or a replay attacks: `spec` where given, else the bundle's
    shield.json, else the one a bundle of the config carries (`monitor_bounds.bundle_spec`: its monitor's bounds
    measured; the config's bare build has them derived, and a filter whose conservative mode engages elsewhere is
    not the one shipped); the bundle's policy (an `EdgeRuntime` loaded without its shield: `evaluate` applies the
    shield) where there is a bundle."""
    from shield.spec import ShieldSpec

    bundle_policy = None
    if bundle is not None:
        from shield.runtime import EdgeRuntime

        bundle_policy = EdgeRuntime.load(bundle, shield=False)
        spec = spec if spec is not None else bundle_policy.bundle.shield_spec
    elif spec is None:
        from pipeline.evaluation.monitor_bounds import bundle_spec

        spec = bundle_spec(cfg)
    return (spec if isinstance(spec, ShieldSpec) else ShieldSpec.from_dict(spec)), bundle_policy


def falsify(
    cfg,
    *,
    bundle: str | None = None,
    budget_s: float | None = None,
    seed: int | None = None,
    out_dir: str | Path | None = None,
    spec=None,
    progress: bool = False,
    candidates: int | None = None,
) -> dict:
    """Search `cfg`'s envelope (the bundle's policy and shield.json, or the config's spec); see the module docstring."""
    spec, bundle_policy = attacked(cfg, bundle, spec)
    return Falsifier(
        cfg,
        spec,
        bundle_policy=bundle_policy,
        budget_s=budget_s,
        seed=seed,
        out_dir=out_dir,
        progress=progress,
        candidates=candidates,
    ).run()
