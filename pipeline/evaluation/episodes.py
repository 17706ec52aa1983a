"""The one episode runner (eval, both shadow passes, benches and tests), its domain resolver and its totals.

`run_episodes(env, driver, seeds)` resets on each seed, asks the driver for an
action (a batch policy with or without a `CbfShield`, or an `EdgeRuntime`),
times that call (policy + shield, µs), steps the env and hands every step to
the observers (the shadow log and the counterfactual trace are observers).
Safety is counted one way everywhere: a violation is a step whose
`info["cost"]` > 0. Every shield flag (`intervened`, `fallback`, `bad_input`,
`envelope`) is counted from the per-step shield info; `summary()` is a typed
`RunSummary`, so a new flag is a new key there too.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypedDict

import numpy as np

# What the lowest barrier value a run or a search saw means, in words (falsify, synthesize, the gate, the report).
MIN_H_MEANING = (
    "below 0 the plant was inside the shield's margin (a barrier's braking distance, the predictive filter's tube), "
    "where the shield acts; a case is a constraint itself crossed"
)
SHIELD_FLAGS = ("intervened", "fallback", "backup", "bad_input", "envelope")


def cut_short_note(clock: str = "falsify.budget_s") -> str:
    """Why a falsification search the clock ended matters: the one wording for every place that reports it."""
    return f"cut short by {clock} before falsify.candidates: a busier machine searches less"


class DomainsError(ValueError):
    """A `--domains` value that is not a set of the config, `nominal`, or a readable YAML file; names it."""


def outside_sets(cfg, rset) -> list[str]:
    """Each randomized quantity of `rset` (a set from outside the config, e.g. `--domains FILE`) that reaches past
    what every set of the config spans (a quantity no set randomizes spans its nominal only: scale 1, latency
    0), and a push beyond the strongest any set declares: the shield was certified on the config's sets alone."""
    from pipeline.evaluation.falsify import parameters

    spans: dict[str, tuple[float, float]] = {}
    pushes = [own.push for own in cfg.randomization.values() if own.push is not None]
    for own in cfg.randomization.values():
        for name, lo, hi in parameters(own):
            a, b = spans.get(name, (lo, hi))
            spans[name] = (min(a, lo), max(b, hi))
    out = []
    for name, lo, hi in parameters(rset):
        a, b = spans.get(name, (0.0, 0.0) if name == "latency_steps" else (1.0, 1.0))
        if lo < a - 1e-9 * max(1.0, abs(a)) or hi > b + 1e-9 * max(1.0, abs(b)):
            out.append(f"{name} {lo:g}..{hi:g} (the config's sets: {a:g}..{b:g})")
    if rset.push is not None:
        # A push of the declared size held for longer, or more often, is a steadier force than any set's.
        for key in ("max_force", "probability", "duration_steps"):
            value, top = getattr(rset.push, key), max((getattr(p, key) for p in pushes), default=0)
            if value > top * (1.0 + 1e-9):
                out.append(f"push.{key} {value:g} (the config's sets: up to {top:g})")
        bodies = sorted({p.body for p in pushes})
        if bodies and rset.push.body not in bodies:
            out.append(f"push.body {rset.push.body} (the config's sets push {', '.join(bodies)})")
    return out


def resolve_domains(cfg, domains: Any):
    """None (`nominal` or None: no randomization), a RandomizationSet, a set name of the config, or a YAML file
    holding one set (or a task config: its `reality` set, or its only set)."""
    import yaml

    from envs.randomization import RandomizationError, RandomizationSet, load_randomization_sets, parse_randomization

    if domains is None or domains == "nominal":
        return None
    if isinstance(domains, RandomizationSet):
        return domains
    if isinstance(domains, dict):
        try:
            return parse_randomization(domains, "domains")
        except RandomizationError as err:
            raise DomainsError(str(err)) from None
    if domains in cfg.randomization:
        return cfg.randomization[domains]
    path = Path(str(domains))
    if path.suffix not in (".yaml", ".yml") and not path.is_file():
        raise DomainsError(
            f"--domains {domains!r}: not a randomization set of this config "
            f"({sorted(cfg.randomization)}), nor 'nominal', nor a YAML file"
        )
    try:
        doc = yaml.safe_load(path.read_text())
        if isinstance(doc, dict) and "randomization" in doc:
            sets = load_randomization_sets(path)
            name = "reality" if "reality" in sets else (next(iter(sets)) if len(sets) == 1 else None)
            if name is None:
                raise DomainsError(f"--domains {domains}: has sets {sorted(sets)}; name one 'reality' or keep one")
            return sets[name]
        return parse_randomization(doc or {}, str(path))
    except OSError as err:
        raise DomainsError(f"--domains {domains}: cannot read ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise DomainsError(f"--domains {domains}: not valid YAML ({err})") from None
    except RandomizationError as err:
        raise DomainsError(f"--domains {domains}: {err}") from None


def domains_label(domains: Any) -> str:
    """How a domains argument is named in results: the set name or file, else `custom`."""
    return domains if isinstance(domains, str) else ("nominal" if domains is None else "custom")


def make_env(cfg, rset, max_episode_steps: int | None = None):
    """The task env on the given domains (a RandomizationSet or None), with the config's episode length."""
    import gymnasium as gym

    import envs

    envs.task(cfg.task.env_id)  # an undeclared id fails here, naming the known tasks
    steps = max_episode_steps or cfg.task.max_episode_steps
    return gym.make(cfg.task.env_id, randomization=rset, max_episode_steps=steps or None)


def check_bundle_task(cfg, manifest: dict, bundle: Any, behind: str = "with the bundle's own shield") -> str | None:
    """A bundle is run against the config of the task it was exported for: another task's plant would only say
    that the observation has the wrong size, or (the same size) run without a word. The same task with its
    observations or actions renamed or reordered, or another control period, than the bundle's contract states is
    refused too: the policy would read one signal as another. Returns a note where the config is not the one the
    bundle was trained under (same I/O: a new gate or domains is a fair thing to judge it by, but say so), ending
    with `behind` (what shield it runs behind)."""
    exported = (manifest.get("task"), manifest.get("env_id"))
    if exported != (cfg.task.name, cfg.task.env_id):
        raise ValueError(
            f"{bundle}: exported for task {exported[0]} ({exported[1]}), but the config is for "
            f"{cfg.task.name} ({cfg.task.env_id}): give the config of the bundle's task"
        )
    contract = manifest.get("contract")
    if isinstance(contract, dict):
        from pipeline.deployment.contract import task_io

        theirs = contract["observations"], contract["actions"], contract["control_period_s"]
        io, period = task_io(cfg.task.env_id, len(theirs[0]), len(theirs[1]))
        for what, had, has in (
            ("observations", [o["name"] for o in theirs[0]], [o["name"] for o in io["observations"]]),
            ("actions", [a["name"] for a in theirs[1]], [a["name"] for a in io["actions"]]),
            ("control period (s)", theirs[2], period),
        ):
            if had != has:
                raise ValueError(
                    f"{bundle}: its contract's {what} are {had}, the config's plant has {has}: the policy would "
                    "read one signal as another. Give the config the bundle was trained under, or retrain"
                )
    trained = manifest.get("config_hash")
    if trained and trained != cfg.config_hash():
        return (
            f"the config hashes to {cfg.config_hash()[:12]}, {bundle} was trained under {str(trained)[:12]} (same "
            "plant I/O; the training setup differs: an edited config, or a run given --steps, --actors or "
            f"--envs-per-actor): judged by this config's gate, domains and limits, {behind}"
        )
    return None


def control_period_s(cfg) -> float:
    """The task's control period (s), from the task registry."""
    import envs

    return float(envs.task(cfg.task.env_id).control_period)


# ----------------------------------------------------------------------------- drivers


class Driver(Protocol):
    """What drives the plant: `reset()` per episode, `act(obs) -> (applied, raw, shield info or None)`."""

    def reset(self) -> None: ...

    def act(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict | None]: ...


class PolicyDriver:
    """A batch policy (obs float32[n, obs_dim] -> float32[n, act_dim], optional `reset`), optionally shielded."""

    def __init__(self, policy, shield=None):
        self.policy, self.shield = policy, shield

    def seed_episode(self, seed: int) -> None:
        """A policy with randomness of its own draws each episode from that episode's seed: any episode of a run
        replays alone."""
        if hasattr(self.policy, "seed_episode"):
            self.policy.seed_episode(seed)

    def reset(self) -> None:
        if hasattr(self.policy, "reset"):
            self.policy.reset()
        if self.shield is not None:
            self.shield.reset()

    def act(self, obs: np.ndarray):
        raw = np.asarray(self.policy(np.asarray(obs, np.float32)[None]), np.float32).reshape(-1)
        if self.shield is None:
            return raw, raw, None
        safe, info = self.shield.filter(np.asarray(obs, np.float32), raw)
        return np.asarray(safe, np.float32), raw, info


class RuntimeDriver:
    """An `EdgeRuntime` (bundle policy + the shield from its shield.json, or bare): exactly what `serve` runs."""

    def __init__(self, runtime):
        self.runtime = runtime

    def reset(self) -> None:
        self.runtime.reset()

    def act(self, obs: np.ndarray):
        safe, raw, info = self.runtime.act(np.asarray(obs, np.float32))
        return np.asarray(safe, np.float32), np.asarray(raw, np.float32), (info if self.runtime.shielded else None)


def timed(act, obs: np.ndarray) -> tuple[Any, float, float]:
    """(act(obs), wall-clock µs, CPU µs of this thread) for one call.

    The wall clock is what a plant waits; the thread's CPU time is what the call costs. On a machine whose cores
    other work shares (an evaluation host, a CI runner) the wall clock's p99 is the scheduler's preemptions, not
    the policy: the edge runtime runs the policy and shield on the calling thread (one onnxruntime thread), so the
    thread's CPU time is the policy and shield alone."""
    c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
    out = act(obs)
    t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
    return out, (t1 - t0) / 1e3, (c1 - c0) / 1e3


# ----------------------------------------------------------------------------- the runner


@dataclass
class Step:
    """One step, as the observers see it: `obs` is what the driver saw, `action` what the plant got."""

    env: Any
    episode: int
    step: int
    t: float  # s since the episode's start
    obs: np.ndarray
    action: np.ndarray
    raw: np.ndarray
    shield: dict | None
    latency_us: float  # the driver's act call: policy + shield
    reward: float
    cost: float
    done: bool


class Observer(Protocol):
    """Sees every reset and step of a run (the shadow log, the counterfactual trace)."""

    def on_reset(self, env, episode: int, seed: int) -> None: ...

    def on_step(self, step: Step) -> None: ...


class ConstraintFigures(TypedDict):
    """One constraint over a run (ConstraintTotals.summary)."""

    violating_steps: int
    worst_excursion: float | None  # past the limit, in the constrained quantity's units; 0 if never crossed
    min_value: float | None  # the lowest signed distance to the limit (< 0 outside)
    min_h: float | None  # the shield's lowest barrier value for it (None: no shield ran)
    interventions: int  # steps the shield intervened with this constraint's barrier the tightest


class RunSummary(TypedDict):
    """A run's figures, under the names eval, shadow, benches and the gate share (RunTotals.summary)."""

    episodes: int
    steps: int
    seeds: list[int]
    returns: list[float]
    return_mean: float
    return_std: float
    episode_length_mean: float
    terminated_episodes: int  # episodes the task ended before their length (a dropped pole, a crash)
    held_episodes: int  # of those, the ones it ended while the shield held the plant at a limit (`held_at_end`)
    violations: int  # steps with info["cost"] > 0, all episodes
    violation_episodes: int
    intervention_rate: float
    fallback_rate: float
    fallbacks: int
    fallback_starts: int  # episodes whose first step answered FALLBACK: a start outside what the shield admits
    backup_rate: float  # steps the predictive filter's backup continued its accepted plan (not fallbacks)
    bad_inputs: int
    latency_p50_us: float  # policy + shield, per step
    latency_p99_us: float
    shield_us_p50: float
    shield_us_p99: float
    min_h: float | None
    constraints: dict[str, ConstraintFigures]
    envelope_rate: float  # steps the assumption monitor flagged


class EvalResult(RunSummary):
    """`evaluate()`'s result: the run's figures and what was run."""

    task: str
    domains: str
    shield: bool
    seed: int
    notes: list[str]  # what the user should know about the inputs (a config other than the bundle's own)


@dataclass
class ConstraintTotals:
    """One constraint over a run: steps that violated it (true state), its lowest signed distance, the shield's
    lowest barrier value for it, and the interventions charged to it."""

    violating_steps: int = 0
    min_value: float = math.inf  # m, rad, ... (the constrained quantity); < 0 outside
    min_h: float = math.inf
    interventions: int = 0

    def count(self, value: float, h: float | None, intervened: bool) -> None:
        if not value >= 0.0:
            self.violating_steps += 1
        if value < self.min_value or value != value:
            self.min_value = value
        if h is not None and h < self.min_h:
            self.min_h = h
        self.interventions += intervened

    def absorb(self, other: ConstraintTotals) -> None:
        """Add another run's figures of the same constraint."""
        self.violating_steps += other.violating_steps
        self.interventions += other.interventions
        if other.min_value < self.min_value or other.min_value != other.min_value:
            self.min_value = other.min_value
        self.min_h = min(self.min_h, other.min_h)

    def summary(self) -> ConstraintFigures:
        low = self.min_value if math.isfinite(self.min_value) or math.isnan(self.min_value) else None
        return {
            "violating_steps": self.violating_steps,
            "worst_excursion": None if low is None else (math.inf if math.isnan(low) else max(0.0, -low)),
            "min_value": low,
            "min_h": self.min_h if math.isfinite(self.min_h) else None,
            "interventions": self.interventions,
        }


def combine_constraint_figures(runs: list[dict[str, ConstraintFigures]]) -> dict[str, ConstraintFigures]:
    """Per-constraint figures (`ConstraintTotals.summary()` by name) of several runs as one: steps and interventions
    add up, the worst excursion and the lowest values are the worst seen."""
    out: dict[str, ConstraintFigures] = {}
    for run in runs:
        for name, c in (run or {}).items():
            acc = out.setdefault(
                name,
                {"violating_steps": 0, "worst_excursion": None, "min_value": None, "min_h": None, "interventions": 0},
            )
            acc["violating_steps"] += c["violating_steps"]
            acc["interventions"] += c["interventions"]
            acc["worst_excursion"] = _worst(max, acc["worst_excursion"], c["worst_excursion"])
            acc["min_value"] = _worst(min, acc["min_value"], c["min_value"])
            acc["min_h"] = _worst(min, acc["min_h"], c["min_h"])
    return out


def _worst(pick, a: float | None, b: float | None) -> float | None:
    """`pick` of the two, where a None is a figure never measured."""
    return b if a is None else a if b is None else pick(a, b)


def constraint_lines(constraints: dict) -> list[str]:
    """Which limit, as text: per constraint, violating steps, the worst excursion past it, the shield's lowest h and
    the interventions charged to it (the tightest barrier at the step)."""
    if not constraints:
        return []

    def num(x, fmt=".4f"):
        return "-" if x is None else format(x, fmt)

    width = max(len(n) for n in [*constraints, "constraint"])
    lines = [f"{'constraint':<{width}}  violating steps  worst excursion  lowest h  interventions"]
    for name, c in constraints.items():
        lines.append(
            f"{name:<{width}}  {c['violating_steps']:>15}  {num(c['worst_excursion']):>15}  "
            f"{num(c['min_h']):>8}  {c['interventions']:>13}"
        )
    return lines


@dataclass
class RunTotals:
    """Per-episode totals and per-step counts of one run; `summary()` turns them into the shared metric names."""

    seeds: list[int] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)
    violations: list[int] = field(default_factory=list)  # steps with info["cost"] > 0, per episode
    lengths: list[int] = field(default_factory=list)
    # whether the task ended the episode before its length (a dropped pole, a crash), per episode; with
    # past_termination the episode runs on, and this still says the task would have ended it
    terminated: list[bool] = field(default_factory=list)
    interventions: list[int] = field(default_factory=list)  # steps the shield changed, per episode
    # per episode: the task ended it early while the shield was holding the plant at a limit (`held_at_end`)
    ended_held: list[bool] = field(default_factory=list)
    flags: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SHIELD_FLAGS, 0))
    latency_us: list[float] = field(default_factory=list)  # per step: policy + shield, wall clock
    compute_us: list[float] = field(default_factory=list)  # per step: the same call's CPU time (`timed`)
    shield_us: list[float] = field(default_factory=list)  # per shielded step: the shield's own solve time
    shielded: bool = False
    min_h: float = math.inf  # the shield's lowest barrier value seen (falsify's objective)
    fallback_starts: int = 0  # episodes whose first step answered FALLBACK (a start the filter does not admit)
    constraints: dict[str, ConstraintTotals] = field(default_factory=dict)  # by name, in the task's order

    def count_constraints(self, values: dict[str, float] | None, sinfo: dict | None, read_h: bool = True) -> None:
        """One step's per-constraint figures: the env's signed distances (true state) and the shield's h (its lowest
        not where `read_h` is False: see `run_episodes`)."""
        if not values:
            return
        h = sinfo.get("h") if sinfo is not None else None
        h = h.tolist() if h is not None and len(h) == len(values) else None  # the shield's order is the task's
        blamed = None
        if h is not None and (sinfo or {}).get("intervened"):
            blamed = min(range(len(h)), key=h.__getitem__)  # an intervention is charged to the tightest barrier
        for i, (name, value) in enumerate(values.items()):
            c = self.constraints.get(name)
            if c is None:
                c = self.constraints[name] = ConstraintTotals()
            c.count(value, None if h is None or not read_h else h[i], i == blamed)

    @property
    def steps(self) -> int:
        return int(sum(self.lengths))

    @property
    def lost(self) -> list[bool]:
        """Per episode: the task ended it early or it left the safe set. Either is a lost episode: legacy runs
        unshielded on the plant today, and where it keeps the pole up by crossing its limit it has not kept it."""
        return [bool(t or v > 0) for t, v in zip(self.terminated, self.violations, strict=True)]

    def extend(self, more: RunTotals) -> RunTotals:
        """This run extended by a later batch's totals (episodes appended in seed order); returns self."""
        self.seeds += more.seeds
        self.returns += more.returns
        self.violations += more.violations
        self.lengths += more.lengths
        self.terminated += more.terminated
        self.interventions += more.interventions
        self.ended_held += more.ended_held
        self.latency_us += more.latency_us
        self.compute_us += more.compute_us
        self.shield_us += more.shield_us
        for flag, count in more.flags.items():
            self.flags[flag] = self.flags.get(flag, 0) + count
        self.shielded = self.shielded or more.shielded
        self.min_h = min(self.min_h, more.min_h)
        self.fallback_starts += more.fallback_starts
        for name, c in more.constraints.items():
            self.constraints.setdefault(name, ConstraintTotals()).absorb(c)
        return self

    def summary(self) -> RunSummary:
        """Returns, violations, shield rates and latencies under the names eval, shadow and the gate share."""
        n = max(self.steps, 1)
        lat = np.asarray(self.latency_us) if self.latency_us else np.zeros(1)
        solve = np.asarray(self.shield_us) if self.shield_us else np.zeros(1)
        return {
            "episodes": len(self.returns),
            "steps": self.steps,
            "seeds": list(self.seeds),
            "returns": [float(r) for r in self.returns],
            "return_mean": float(np.mean(self.returns)),
            "return_std": float(np.std(self.returns)),
            "episode_length_mean": float(np.mean(self.lengths)),
            "terminated_episodes": int(sum(self.terminated)),
            "held_episodes": int(sum(self.ended_held)),
            "violations": int(sum(self.violations)),
            "violation_episodes": int(sum(v > 0 for v in self.violations)),
            "intervention_rate": self.flags["intervened"] / n,
            "fallback_rate": self.flags["fallback"] / n,
            "fallbacks": int(self.flags["fallback"]),
            "fallback_starts": self.fallback_starts,
            "backup_rate": self.flags["backup"] / n,
            "bad_inputs": int(self.flags["bad_input"]),
            "latency_p50_us": float(np.percentile(lat, 50)),
            "latency_p99_us": float(np.percentile(lat, 99)),
            "shield_us_p50": float(np.percentile(solve, 50)) if self.shielded else 0.0,
            "shield_us_p99": float(np.percentile(solve, 99)) if self.shielded else 0.0,
            "min_h": self.min_h if math.isfinite(self.min_h) else None,
            "constraints": {name: c.summary() for name, c in self.constraints.items()},
            "envelope_rate": self.flags["envelope"] / n,
        }


# The last second before the task ends an episode: when the shield changed at least half of its steps' actions, the
# episode was lost where the shield held the plant at a limit (a pole dropped behind the barrier at the rail's end),
# not where the policy lost it alone. A shield holding a plant at a limit changes nearly every step there, and few
# steps anywhere else, so half a second of the last one tells the two apart without a tuned threshold.
HELD_WINDOW_S = 1.0


def held_at_end(intervened: Sequence[bool]) -> bool:
    """True when the shield changed at least half of the actions of the last steps before an episode ended."""
    return bool(intervened) and 2 * sum(intervened) >= len(intervened)


def run_episodes(
    env,
    driver: Driver,
    seeds: list[int],
    *,
    dt: float,
    observers=(),
    progress: str | None = None,
    past_termination: bool = False,
) -> RunTotals:
    """Run one episode per seed with `driver` acting; observers see every step. Returns the run's totals.
    `past_termination`: an episode ends only when truncated (its length), not when the task terminates."""
    totals = RunTotals(seeds=list(seeds))
    bar = _progress(len(seeds), progress)
    try:
        for ep, seed in enumerate(seeds):
            obs, _ = env.reset(seed=seed)
            if hasattr(driver, "seed_episode"):
                driver.seed_episode(seed)
            driver.reset()
            for o in observers:
                o.on_reset(env, ep, seed)
            total, violations, step, done, ended = 0.0, 0, 0, False, False
            intervened = 0
            recent: deque[bool] = deque(maxlen=max(1, round(HELD_WINDOW_S / dt)))
            held = False
            # An episode that starts outside the states the shield admits is answered FALLBACK until the shield has
            # brought the plant in: the barrier values of that stretch measure the start, the same for every policy
            # on the seed, not how close an attack came. They are left out of the lowest h (falsify's objective).
            starting = True
            while not done:
                (action, raw, sinfo), latency, compute = timed(driver.act, obs)
                next_obs, reward, terminated, truncated, info = env.step(action)
                cost = float(info.get("cost", 0.0))
                done = bool(truncated or (terminated and not past_termination))
                first_end = bool(terminated) and not ended
                ended = ended or bool(terminated)
                total += float(reward)
                violations += cost > 0.0
                totals.latency_us.append(latency)
                totals.compute_us.append(compute)
                if sinfo is not None:
                    totals.shielded = True
                    for flag in SHIELD_FLAGS:
                        totals.flags[flag] += bool(sinfo.get(flag, False))
                    changed = bool(sinfo.get("intervened", False))
                    intervened += changed
                    recent.append(changed)
                    if first_end:
                        held = held_at_end(recent)
                    starting = starting and bool(sinfo.get("fallback", False))
                    totals.fallback_starts += step == 0 and starting
                    if "solve_us" in sinfo:
                        totals.shield_us.append(float(sinfo["solve_us"]))
                    h = sinfo.get("h")
                    if h is not None and len(h) and not starting:
                        totals.min_h = min(totals.min_h, float(np.min(h)))
                totals.count_constraints(
                    info.get("constraint_values"), sinfo, read_h=not (starting and sinfo is not None)
                )
                if observers:
                    record = Step(env, ep, step, step * dt, obs, action, raw, sinfo, latency, float(reward), cost, done)
                    for o in observers:
                        o.on_step(record)
                obs, step = next_obs, step + 1
            totals.returns.append(total)
            totals.violations.append(int(violations))
            totals.lengths.append(step)
            totals.terminated.append(ended)
            totals.interventions.append(intervened)
            totals.ended_held.append(held)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return totals


def _progress(total: int, desc: str | None):
    if not desc:
        return None
    from pipeline.progress import Progress

    return Progress(total, "ep", desc=desc)
