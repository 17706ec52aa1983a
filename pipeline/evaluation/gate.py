"""The promotion gate: shadow metrics + `cfg.gate` -> a decision with every reason.

Checks (each names its config key, its value and its threshold):

- ``gate.min_return_ratio`` (r): against legacy, on the same seeds and
  domains. The one-sided bounds on the mean paired difference
  d = R_candidate - R_legacy (paired bootstrap-t, `gate_statistics`) are compared with
  ``(r - 1) |R_l|`` (R_l legacy's mean return): pass when the lower bound is
  above it, fail when the upper bound is below it, else undecided. r = 1
  (the default) asks for "no worse than legacy" at `gate.confidence`: a
  candidate merely equal to legacy is not promoted. r < 1 allows a margin
  of (1 - r) |R_l| (sign-safe for negative returns) and the check says it was
  loosened, by this key.
  No pass on fewer than ``gate.min_episodes`` paired episodes.
- ``gate.min_return_ratio_production``: the same rule against the production
  version, when the metrics hold its returns on the same seeds.
- ``gate.max_lost_rate_increase`` (x): lost episodes (the task ended them
  early: a dropped pole, a crash; or they left the safe set), the
  candidate's rate minus legacy's on the same episodes: pass when the exact
  upper bound on that difference is at most x, fail when its lower bound is
  above it. The return bounds cannot see a rare loss no episode of the
  sample showed; this bound does, and it is what makes a pass wait for the
  few hundred episodes a rare loss needs to be ruled out.
- ``gate.max_violations``: constraint-violating steps (info["cost"]) of the
  candidate driving, summed over every counterfactual episode: an absolute
  count (the bound on the rate is reported beside it).
- ``gate.max_intervention_rate``: share of steps the shield changed the
  candidate's action, judged on its exact upper bound (lower bound above the
  limit: fail); measured with the candidate driving when that pass ran, else
  on the legacy-driven (shadow / field) states.
- ``gate.max_latency_p99_us``: p99 of the candidate's per-action cost
  (policy + shield): the worse of the shadow and counterfactual passes; by
  default a tenth of the control period (metrics["control_period_s"]). Where
  the pass ran here, the cost is the acting thread's CPU time: the wall clock
  of an evaluation host whose cores other work shares measures its scheduler
  (a loaded 2-core CI runner put 3.8 ms on the arm's p99, about 13 times the
  0.3 ms its policy and shield cost); a field log has only its wall clock, which is then judged.
  The wall-clock p99 is reported beside it either way.
- ``gate.max_falsification_cases`` (only when a `falsify` result is part of the
  metrics, as in the retrain flow): shielded violations the search found.

Bounds at a look spend (1 - gate.confidence) / K each, K the looks the
budget plans (`metrics["planned_looks"]`), so the sequential evaluation
(pipeline.evaluation.shadow) may stop at any look.

A check whose inputs are missing (field logs have no counterfactual pass and
may lack rewards) is *skipped*; one whose bound has not decided yet is
*undecided*. Decisions, first match wins:

- ``fail``: a check other than the production comparison failed;
- ``kept``: production exists and the candidate is shown not to clear
  ``gate.min_return_ratio_production`` (registered, production kept);
- ``inconclusive``: a check other than the production comparison that is not
  waived (``gate.waive``) was skipped or is undecided (never promoted): where
  the candidate is not yet shown no worse than legacy, "kept" would say more
  than the episodes did;
- ``kept``: every other check passed and the production comparison did not
  decide that the candidate is better;
- ``pass``: every check ran and passed (or was waived).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from pipeline.config import LOST_RATE_TOLERANCE
from pipeline.evaluation.episodes import MIN_H_MEANING, cut_short_note
from pipeline.evaluation.gate_statistics import (
    BOUND_METHOD,
    EPISODE_RATE_METHOD,
    RATE_METHOD,
    PairedBound,
    clopper_pearson_lower,
    clopper_pearson_upper,
    episode_rate_bounds,
    look_alpha,
    lossless_episodes,
    lost_rate_bounds,
    paired_bound,
)

PRODUCTION_KEY = "gate.min_return_ratio_production"
LOST_KEY = "gate.max_lost_rate_increase"


@dataclass(frozen=True)
class GateCheck:
    """One threshold test: `passed` is None when the check was skipped (inputs missing) or is still undecided."""

    key: str  # config key of the threshold, e.g. "gate.max_violations"
    value: float | None
    threshold: float | None  # None: no limit could be set (a latency limit without a control period)
    passed: bool | None
    detail: str
    undecided: bool = False  # ran, but its bound has not decided yet: more episodes may decide it
    interval: tuple[float, float] | None = None  # the bounds the check decided on, in the value's units
    advice: str | None = None  # which of NEXT_STEPS[key]'s lines fits better than "fail" or "undecided" here

    @property
    def status(self) -> str:
        """pass, fail, undecided or skipped."""
        if self.passed is None:
            return "undecided" if self.undecided else "skipped"
        return "pass" if self.passed else "fail"

    @property
    def reason(self) -> str:
        """One human line: PASS/FAIL/UNDECIDED/SKIPPED, the key, value vs threshold."""
        return f"{self.status.upper()} {self.key}: {self.detail}"


@dataclass(frozen=True)
class GateDecision:
    """The gate's verdict on one candidate with every check that led to it."""

    checks: list[GateCheck] = field(default_factory=list)
    waived: tuple[str, ...] = ()  # keys of checks that may be skipped without making the decision inconclusive
    loosened: tuple[str, ...] = ()  # lines naming each config key that allows a margin below "no worse than"

    @property
    def passed(self) -> bool:
        return self.decision == "pass"

    @property
    def decision(self) -> str:
        """fail, kept (not better than production), inconclusive, else pass (module docstring)."""
        if any(c.passed is False and c.key != PRODUCTION_KEY for c in self.checks):
            return "fail"
        if any(c.key == PRODUCTION_KEY and c.passed is False for c in self.checks):
            return "kept"
        if any(c.passed is None and c.key not in self.waived for c in self.checks if c.key != PRODUCTION_KEY):
            return "inconclusive"
        if any(c.key == PRODUCTION_KEY and c.passed is not True for c in self.checks):
            return "kept"
        return "pass"

    @property
    def settled(self) -> bool:
        """No more episodes can change the decision: a check other than the production comparison failed, or
        none is undecided. A candidate already not better than production is still looked at while a check
        against legacy or a safety bound is undecided: that one may yet fail, and a night whose candidate is
        worse than legacy must end as a failure, not as a quiet "kept"."""
        if any(c.passed is False and c.key != PRODUCTION_KEY for c in self.checks):
            return True
        return not any(c.undecided for c in self.checks)

    @property
    def skipped(self) -> list[str]:
        """Config keys of the checks that could not run or did not decide (waived or not)."""
        return [c.key for c in self.checks if c.passed is None]

    @property
    def reasons(self) -> list[str]:
        return [c.reason for c in self.checks]

    @property
    def failing(self) -> list[str]:
        """Config keys of the thresholds the candidate failed."""
        return [c.key for c in self.checks if c.passed is False]

    @property
    def next_steps(self) -> list[str]:
        """What a user can do about each check that failed or did not decide, one line each (none on a pass)."""
        out = []
        failed = any(c.passed is False for c in self.checks)
        for c in self.checks:
            if c.passed is True or c.key not in NEXT_STEPS:
                continue
            if failed and c.passed is None:
                # The gate stopped at the look where a check failed: more episodes were not what it lacked.
                continue
            # Undecided, but losing more than it may on the sample so far: more episodes would refuse it, not pass it.
            losing = c.key == LOST_KEY and _known(c.value) and _known(c.threshold) and c.value > c.threshold
            out.append(NEXT_STEPS[c.key][c.advice or ("fail" if c.passed is False or losing else "undecided")])
        return out


def with_paths(lines: list[str], *, config=None, bundle=None, case=None) -> list[str]:
    """NEXT_STEPS' lines with their placeholders (CONFIG, BUNDLE, CASE) filled where the caller knows the paths: an
    outside user copied `--replay CASE --bundle BUNDLE` from a failed night and had to find both."""
    subs = {k: str(v) for k, v in (("CONFIG", config), ("BUNDLE", bundle), ("CASE", case)) if v}
    if not subs:
        return list(lines)
    pattern = re.compile(r"\b(" + "|".join(subs) + r")\b")
    return [pattern.sub(lambda m: subs[m.group(1)], line) for line in lines]


LATENCY_SHARE = 0.1  # the default latency limit's share of the control period

NEXT_STEPS = {
    LOST_KEY: {
        "fail": "the candidate loses episodes legacy keeps (a dropped pole, a crash, or it left the safe set): train "
        "it where it loses them (train.adaptive, a policy that infers the plant it is on; more "
        "train.total_env_steps; a training set that reaches the hard corner) and gate again; `sim2real eval BUNDLE "
        "--domains reality` counts its lost episodes",
        "undecided": "too few episodes to bound the candidate's lost episodes under gate.max_lost_rate_increase: "
        "raise gate.max_episodes (its line says how many decide it) or gate.max_seconds",
        "held": "most episodes the candidate lost and legacy kept ended with the shield holding it at a limit (the "
        "shield changed most of its actions in their last second): the policy drives into a limit where the "
        "shield's braking cannot also keep the task (a pole dropped behind the rail's barrier). More episodes do "
        "not remove those losses: they need a policy that keeps room before its limits (trained against the shield: "
        "shield.train_in_loop, shield.intervention_penalty, shield.train_margin) or set-points with that room "
        "inside the limits (docs/how-to/nightly.md has what each did on the cart-pole); `sim2real eval BUNDLE "
        "--domains reality` counts them",
    },
    "gate.max_intervention_rate": {
        "fail": "the shield changes more of the candidate's actions than gate.max_intervention_rate allows: train "
        "with the shield in the loop (shield.train_in_loop, with shield.intervention_penalty; raise the penalty "
        "where it is on already) so the policy learns where the shield lets it go; where the shield also changes "
        "much of legacy's (`sim2real shield synthesize` prints that rate, CONSERVATIVE, and what the model error "
        "takes off each limit), the shield is conservative for this plant: training in the loop still teaches the "
        "policy to stay where it is let go, but the return may then stay below legacy's (see gate.min_return_ratio)",
        "undecided": "the intervention-rate bound straddles gate.max_intervention_rate: more episodes "
        "(gate.max_episodes) narrow it",
    },
    "gate.max_violations": {
        "fail": "the shielded candidate crossed a limit: the shield does not keep this plant as declared. `sim2real "
        "shield synthesize --config CONFIG` runs the legacy controller behind it and falsifies it, and refuses it "
        "naming why; `sim2real eval BUNDLE --domains reality` shows the episodes",
        "undecided": "too few episodes to bound the violation rate: more episodes (gate.max_episodes)",
    },
    "gate.max_falsification_cases": {
        "fail": "falsify broke the shield: each case is a JSON file in the run's falsify/ folder; `sim2real falsify "
        "--config CONFIG --replay CASE --bundle BUNDLE` replays it (a case that attacked the bundle's own policy "
        "needs the bundle, not only its shield.json), and `sim2real shield synthesize` names the range or the start "
        "to change",
        "undecided": "falsify did not run: see its line",
    },
    PRODUCTION_KEY: {
        "fail": "the candidate is not better than production on the same episodes: production stays, as it should "
        "on most nights once a good policy runs; a candidate that falls well short of it (its bounds) trained worse "
        "than last night's: compare the two runs' training curves (TensorBoard) before changing anything",
        "undecided": "the candidate and production are too close to tell apart at the stated confidence within "
        "gate.max_episodes: production stays",
    },
    "gate.min_return_ratio": {
        "fail": "the candidate's return falls short of gate.min_return_ratio against legacy on the same episodes: "
        "train longer or on the plants where it falls short (the report's per-episode returns show which); where "
        "`sim2real shield synthesize` printed CONSERVATIVE, `sim2real eval --policy legacy --domains reality` with "
        "and without `--no-shield` shows what the shield's room costs any controller, a gap training cannot close",
        "undecided": "the return bound straddles legacy's, or lies above it on fewer paired episodes than "
        "gate.min_episodes: more episodes (gate.max_episodes, at least gate.min_episodes) narrow it; a candidate "
        "merely equal to legacy never passes",
    },
}


def latency_limit_us(gate, control_period_s: float | None) -> float | None:
    """gate.max_latency_p99_us, or by default LATENCY_SHARE of the control period (None if neither is known)."""
    if gate.max_latency_p99_us is not None:
        return float(gate.max_latency_p99_us)
    return LATENCY_SHARE * control_period_s * 1e6 if control_period_s else None


def _known(x: Any) -> TypeGuard[float]:
    """A number that was measured (not None, not NaN)."""
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def return_threshold(reference_return: float, ratio: float) -> float:
    """Smallest acceptable candidate mean return given the reference's (sign-safe; see module docstring)."""
    return reference_return + (ratio - 1.0) * abs(reference_return)


def _at_most(key: str, value, limit, describe, missing: str) -> GateCheck:
    """The check `value <= limit`, described by `describe(value, "<=" or ">")`; skipped with `missing` if unknown."""
    if not _known(value):
        return GateCheck(key, None, limit, None, missing)
    ok = value <= limit
    return GateCheck(key, value, limit, ok, describe(value, "<=" if ok else ">"))


def latency_check(metrics: dict, gate) -> GateCheck:
    """gate.max_latency_p99_us on the worse pass: each pass's CPU-time p99 where it ran here, else (a field log)
    its wall-clock p99; the wall clock's worst is reported beside it."""
    measured, walls = [], []
    for wall_key, cpu_key in (
        ("latency_p99_us", "compute_p99_us"),
        ("counterfactual_latency_p99_us", "counterfactual_compute_p99_us"),
    ):
        cpu, wall = metrics.get(cpu_key), metrics.get(wall_key)
        if _known(wall):
            walls.append(wall)
        if _known(cpu):
            measured.append((cpu, "CPU time"))
        elif _known(wall):
            measured.append((wall, "wall clock, as logged"))
    p99, clock = max(measured) if measured else (None, "")
    limit = latency_limit_us(gate, metrics.get("control_period_s"))
    where = "" if gate.max_latency_p99_us is not None else f" ({LATENCY_SHARE:.0%} of the control period)"
    beside = f"; wall-clock p99 {max(walls):.1f} us on this machine" if walls and clock == "CPU time" else ""
    return _at_most(
        "gate.max_latency_p99_us",
        p99 if limit is not None else None,
        limit,
        lambda x, op: f"candidate latency p99 {x:.1f} us ({clock}) {op} {limit:g} us{where}{beside}",
        "no latency logged"
        if limit is not None
        else "no control period to take the latency limit from: set gate.max_latency_p99_us",
    )


def _look(metrics: dict, gate) -> tuple[float, str]:
    """Alpha each bound spends at this look, and how the look is described."""
    looks = int(metrics.get("planned_looks") or 1)
    alpha = look_alpha(gate.confidence, looks)
    where = f"look {metrics.get('looks', 1)} of {looks} planned" if looks > 1 else "one look"
    return alpha, f"{where}, each bound at {1 - alpha:.4g}"


def paired_return_bound(metrics: dict, gate, reference: str) -> PairedBound | None:
    """The bounds on the paired return difference, candidate - `reference` ("legacy" or "production"), that the
    gate decides on at the metrics' last look; None where the two did not run the same episodes."""
    cand, ref = metrics.get("candidate_returns"), metrics.get(f"{reference}_returns")
    if not cand or not ref or len(cand) != len(ref):
        return None
    return paired_bound(cand, ref, _look(metrics, gate)[0])


def format_bound(bound: dict | None) -> str:
    """A recorded bound (`PairedBound.as_dict()`) as text: "mean [lower, upper] (n=...)", or "n/a"."""
    if not bound:
        return "n/a"
    return f"{bound['mean']:+.2f} [{bound['lower']:+.2f}, {bound['upper']:+.2f}]" + (
        f" (n={bound['n']})" if "n" in bound else ""
    )


def return_check(metrics: dict, gate, reference: str) -> GateCheck | None:
    """The paired return rule against `reference` ("legacy" or "production"); None if there is no production."""
    production = reference == "production"
    key = PRODUCTION_KEY if production else "gate.min_return_ratio"
    ratio = gate.min_return_ratio_production if production else gate.min_return_ratio
    ref_returns = metrics.get(f"{reference}_returns")
    if production and not ref_returns:
        return None
    version = metrics.get("production_version")
    label = ("production" + (f" v{version}" if version else "")) if production else "legacy"
    cand = metrics.get("candidate_returns")
    if not cand or not ref_returns:
        missing = (
            "candidate returns (needs the counterfactual pass)"
            if not cand
            else f"{reference} returns (the log has no rewards)"
        )
        return GateCheck(key, None, ratio, None, f"no {missing}")
    if len(cand) != len(ref_returns):
        return GateCheck(key, None, ratio, None, f"candidate and {label} ran different episodes: cannot pair")
    alpha, where = _look(metrics, gate)
    bound = paired_bound(cand, ref_returns, alpha)
    ref_mean = sum(ref_returns) / len(ref_returns)
    thr = return_threshold(ref_mean, ratio) - ref_mean  # on the difference candidate - reference
    verdict = bound.versus(thr)
    if verdict == "above" and bound.n < gate.min_episodes:
        verdict = "early"
    passed = {"above": True, "below": False, "undecided": None, "early": None}[verdict]
    margin = (
        f"no worse than {label}"
        if ratio == 1.0
        else f"margin LOOSENED by {key}={ratio:g}: may be {1 - ratio:.0%} of |{label} mean| worse"
        if ratio < 1.0
        else f"must beat {label} by {ratio - 1:.0%} of its |mean| ({key}={ratio:g})"
    )
    said = {
        "above": f"better than the threshold at {gate.confidence:.0%}",
        "below": f"worse than the threshold at {gate.confidence:.0%}",
        "undecided": "the interval straddles the threshold: undecided",
        "early": f"above the threshold, but a pass needs gate.min_episodes={gate.min_episodes} paired episodes: "
        f"undecided",
    }[verdict]
    detail = (
        f"candidate - {label}: mean {bound.mean:+.3f} per episode, bounds [{bound.lower:+.3f}, "
        f"{bound.upper:+.3f}] vs threshold {thr:+.3f} ({margin}); {said} "
        f"(n={bound.n} paired episodes, {BOUND_METHOD}, {where})"
    )
    return GateCheck(
        key, bound.mean, thr, passed, detail, undecided=passed is None, interval=(bound.lower, bound.upper)
    )


def lost_check(metrics: dict, gate) -> GateCheck:
    """`gate.max_lost_rate_increase` on exact paired bounds of the episodes each policy lost and the other did not
    (against legacy; production passed the same check against legacy on its own night)."""
    limit = gate.max_lost_rate_increase
    pairs = metrics.get("failures_vs_legacy")
    if not pairs or not pairs.get("episodes"):
        return GateCheck(LOST_KEY, None, limit, None, "no lost-episode counts (they need the counterfactual pass)")
    b, c, n = int(pairs["candidate_only"]), int(pairs["legacy_only"]), int(pairs["episodes"])
    counted = f"the candidate lost {b} of {n} episodes that legacy kept, legacy lost {c} that the candidate kept"
    held = pairs.get("candidate_only_held")
    if held and b:
        counted += (
            f" ({'all' if held == b else f'{held} of the'} {b} ended with the shield holding the candidate at a "
            f"limit: it changed most of its actions in the last second)"
        )
    advice = "held" if held and 2 * held >= b else None
    if metrics.get("episodes_can_end_early") is False and b == 0 and gate.max_violations == 0:
        # Nothing ends an episode early here, so a lost episode is a violating one, which gate.max_violations
        # already allows none of.
        return GateCheck(
            LOST_KEY,
            -c / n,
            limit,
            True,
            f"{counted}; the task ends no episode early (no termination declared), so only a violation loses one",
            interval=(-c / n, 0.0),
        )
    alpha, where = _look(metrics, gate)
    lower, upper = lost_rate_bounds(b, c, n, alpha)
    passed = True if upper <= limit else False if lower > limit else None
    said = {
        True: f"upper bound {upper:+.4f} <= {limit:g}",
        False: f"lower bound {lower:+.4f} > {limit:g}: it loses episodes legacy keeps",
        None: f"bounds straddle {limit:g}: undecided"
        + (
            f" (with none lost by either, {lossless_episodes(limit, alpha)} episodes decide it)"
            if 0 < limit < 1 and b == 0
            else ""
        ),
    }[passed]
    detail = (
        f"{counted}: lost rate, candidate - legacy, bounds [{lower:+.4f}, {upper:+.4f}]: {said} "
        f"({RATE_METHOD}, each rate at alpha / 2, {where})"
    )
    return GateCheck(
        LOST_KEY,
        (b - c) / n,
        limit,
        passed,
        detail,
        undecided=passed is None,
        interval=(lower, upper),
        advice=None if passed else advice,
    )


def intervention_check(metrics: dict, gate) -> GateCheck:
    """`gate.max_intervention_rate` on the exact bounds of the shield's intervention count."""
    key, limit = "gate.max_intervention_rate", gate.max_intervention_rate
    # Which pass's counts: `prefix` names its per-episode counts too.
    prefix, source = "candidate", "candidate driving"
    k, n = metrics.get("candidate_interventions"), metrics.get("candidate_steps")
    if not _known(k) or not n:
        prefix, source = "would_be", "would-be, legacy driving"
        k, n = metrics.get("would_be_interventions"), metrics.get("steps")
    if not _known(k) or not n:  # metrics from before the counts were kept: the rate alone, as a point value
        rate = metrics.get("candidate_intervention_rate")
        source = "candidate driving"
        if not _known(rate):
            rate, source = metrics.get("would_be_intervention_rate"), "would-be, legacy driving"
        return _at_most(
            key,
            rate,
            limit,
            lambda x, op: f"shield intervention rate {x:.4f} {op} {limit:g} ({source}; no counts: no bound)",
            "no steps logged",
        )
    alpha, where = _look(metrics, gate)
    k, n = int(k), int(n or 0)
    upper, lower = clopper_pearson_upper(k, n, alpha), clopper_pearson_lower(k, n, alpha)
    method = f"{RATE_METHOD} over steps"
    per_episode = episode_rate_bounds(
        metrics.get(f"{prefix}_episode_interventions") or [], metrics.get(f"{prefix}_episode_steps") or [], alpha
    )
    if per_episode is not None:  # bursts: the episode is the independent unit, so the wider bound stands
        lower, upper = min(lower, per_episode[0]), max(upper, per_episode[1])
        method = f"the wider of {RATE_METHOD} over steps and {EPISODE_RATE_METHOD}"
    passed = True if upper <= limit else False if lower > limit else None
    said = {
        True: f"upper bound {upper:.4f} <= {limit:g}",
        False: f"lower bound {lower:.4f} > {limit:g}",
        None: f"bounds straddle {limit:g}: undecided",
    }[passed]
    detail = (
        f"shield intervened on {k} of {n} steps ({k / n:.4f}, {source}), bounds [{lower:.4f}, {upper:.4f}]: "
        f"{said} ({method}, {where})"
    )
    return GateCheck(key, upper, limit, passed, detail, undecided=passed is None, interval=(lower, upper))


def _violations_detail(metrics: dict, gate, op: str) -> str:
    x = int(metrics["candidate_violations"])
    line = f"candidate violating steps {x} {op} {gate.max_violations} (absolute)"
    episodes = metrics.get("candidate_returns")
    bad = metrics.get("candidate_violation_episodes")
    if episodes and _known(bad):
        n = len(episodes)
        upper = clopper_pearson_upper(int(bad), n, 1.0 - gate.confidence)
        line += (
            f"; {int(bad)} of {n} episodes violated: episode violation rate <= {upper:.3f} at "
            f"{gate.confidence:.0%} ({RATE_METHOD})"
        )
    return line


def decide(metrics: dict, gate) -> GateDecision:
    """Apply `gate` (a GateConfig) to shadow `metrics` (shadow_metrics keys); every check reported."""
    legacy = return_check(metrics, gate, "legacy")
    assert legacy is not None  # only the production comparison can be absent
    checks = [legacy]
    production = return_check(metrics, gate, "production")
    if production is not None:
        checks.append(production)

    checks.append(lost_check(metrics, gate))
    checks.append(
        _at_most(
            "gate.max_violations",
            metrics.get("candidate_violations"),
            gate.max_violations,
            lambda x, op: _violations_detail(metrics, gate, op),
            "candidate violations: they need the counterfactual pass",
        )
    )
    checks.append(intervention_check(metrics, gate))

    checks.append(latency_check(metrics, gate))

    if "falsification_cases" in metrics:  # the retrain flow ran `falsify` before the gate
        worst = metrics.get("falsification_min_h")
        searched = metrics.get("falsification_evaluated")
        checks.append(
            _at_most(
                "gate.max_falsification_cases",
                metrics.get("falsification_cases"),
                gate.max_falsification_cases,
                lambda x, op: (
                    f"falsify found {int(x)} shielded violation case(s) "
                    f"{op} {gate.max_falsification_cases}"
                    + (f" in {int(searched)} candidates" if _known(searched) else "")
                    + (f" ({cut_short_note()})" if metrics.get("falsification_cut_short") else "")
                    + (f" (lowest barrier value the shield saw {worst:.4f}; {MIN_H_MEANING})" if _known(worst) else "")
                ),
                "falsify did not run",
            )
        )
    return GateDecision(checks, tuple(gate.waive), loosened_keys(gate, production is not None))


def loosened_keys(gate, with_production: bool = True) -> tuple[str, ...]:
    """One line per config key that lets a candidate be worse than its reference (a margin below 1.0)."""
    out = []
    if gate.min_return_ratio < 1.0:
        out.append(
            f"gate.min_return_ratio={gate.min_return_ratio:g}: the candidate may be "
            f"{1 - gate.min_return_ratio:.0%} of legacy's |mean return| worse than legacy"
        )
    if gate.max_lost_rate_increase > LOST_RATE_TOLERANCE:
        out.append(
            f"{LOST_KEY}={gate.max_lost_rate_increase:g}: the candidate may lose "
            f"{gate.max_lost_rate_increase:.0%} more episodes than legacy (shipped: {LOST_RATE_TOLERANCE:g})"
        )
    if with_production and gate.min_return_ratio_production < 1.0:
        out.append(
            f"{PRODUCTION_KEY}={gate.min_return_ratio_production:g}: the candidate may be "
            f"{1 - gate.min_return_ratio_production:.0%} of production's |mean return| worse than production"
        )
    # Below the shipped values these two keep every margin and still let a regression through more often: each
    # bound then holds at a lower confidence, or a return comparison passes on a sample too small to show its skew.
    shipped = type(gate).model_fields
    confidence, fewest = shipped["confidence"].default, shipped["min_episodes"].default
    if gate.confidence < confidence:
        out.append(
            f"gate.confidence={gate.confidence:g}: a candidate no better than its reference may pass up to "
            f"{1 - gate.confidence:.0%} of nights (shipped: {confidence:g}, {1 - confidence:.0%})"
        )
    if gate.min_episodes < fewest:
        out.append(
            f"gate.min_episodes={gate.min_episodes}: a return comparison may pass on {gate.min_episodes} paired "
            f"episodes (shipped: {fewest})"
        )
    return tuple(out)


def promotion_verdict(
    decision: str, version: int, production: int | None, reasons: list[str], loosened: list[str] | tuple = ()
) -> str:
    """One line saying why `version` was or was not promoted (kept in its manifest, shown by `registry list`).
    A pass under a loosened gate says so, naming the keys: "every check passed" alone read as "no worse"."""

    def named(*keys):
        return "; ".join(r for r in reasons if any(f" {k}:" in r for k in keys)) or "; ".join(reasons)

    if decision == "pass":
        over = f" over v{production}" if production is not None else " (no production before)"
        said = f"promoted v{version}{over}: every check passed, against legacy" + (
            " and production" if production is not None else ""
        )
        return said + "".join(f"; LOOSENED: {line}" for line in loosened)
    if decision == "kept":
        return f"kept v{production}: v{version} not better ({named('gate.min_return_ratio_production')})"
    failing = [r for r in reasons if r.startswith(("FAIL ", "UNDECIDED ", "SKIPPED "))]
    what = "failed the gate" if decision == "fail" else "gate inconclusive (budget spent undecided)"
    return f"not promoted, v{version} {what}: " + "; ".join(failing)
