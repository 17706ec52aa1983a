"""The promotion gate: shadow metrics + `cfg.gate` thresholds -> a decision with every reason.

Checks (each names its config key, its value and its threshold):

- ``gate.min_return_ratio`` (r): the candidate's mean return R_c (counterfactual
  pass) against the legacy mean return R_l on the same seeds and domains:
  ``R_c >= R_l + (r - 1) * |R_l|``. For R_l > 0 this is the familiar
  ``R_c >= r * R_l``; for R_l < 0 the naive product would demand the candidate
  be *better* than legacy whenever r < 1 (0.8 * -100 = -80 > -100), so the
  rule instead allows the candidate to be worse by (1 - r) of legacy's
  magnitude (-100 -> threshold -120). r > 1 asks for an improvement of
  (r - 1) |R_l| either way.
- ``gate.max_violations``: constraint-violating steps (info["cost"]) of the
  candidate driving, summed over every counterfactual episode.
- ``gate.max_intervention_rate``: share of steps the shield changed the
  candidate's action; measured with the candidate driving when that pass ran,
  else on the legacy-driven (shadow / field) states.
- ``gate.max_latency_p99_us``: p99 of the candidate's per-action latency
  (policy + shield): the worse of the shadow and counterfactual passes' p99.

- ``gate.max_falsification_cases`` (only when a `falsify` result is part of the
  metrics, as in the retrain flow): shielded violations the search found.

A check whose inputs are missing (field logs have no counterfactual pass and
may lack rewards) is *skipped* and reported as such. A gate never passes on a
check it could not run: any skipped check makes the decision ``inconclusive``
(non-zero exit, never promoted) unless the config waives that check by key
(``gate.waive``). The decision is "pass" only if every check ran and passed
(or was waived), "fail" if any check failed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GateCheck:
    """One threshold test: `passed` is None when the check was skipped (inputs missing)."""

    key: str  # config key of the threshold, e.g. "gate.max_violations"
    value: float | None
    threshold: float
    passed: bool | None
    detail: str

    @property
    def reason(self) -> str:
        """One human line: PASS/FAIL/SKIPPED, the key, value vs threshold."""
        status = {True: "PASS", False: "FAIL", None: "SKIPPED"}[self.passed]
        return f"{status} {self.key}: {self.detail}"


@dataclass(frozen=True)
class GateDecision:
    """The gate's verdict on one candidate with every check that led to it."""

    checks: list[GateCheck] = field(default_factory=list)
    waived: tuple[str, ...] = ()  # keys of checks that may be skipped without making the decision inconclusive

    @property
    def passed(self) -> bool:
        return self.decision == "pass"

    @property
    def decision(self) -> str:
        """fail (a check failed), inconclusive (a check that is not waived could not run), else pass."""
        if any(c.passed is False for c in self.checks):
            return "fail"
        if any(c.passed is None and c.key not in self.waived for c in self.checks):
            return "inconclusive"
        return "pass"

    @property
    def skipped(self) -> list[str]:
        """Config keys of the checks that could not run (waived or not)."""
        return [c.key for c in self.checks if c.passed is None]

    @property
    def reasons(self) -> list[str]:
        return [c.reason for c in self.checks]

    @property
    def failing(self) -> list[str]:
        """Config keys of the thresholds the candidate failed."""
        return [c.key for c in self.checks if c.passed is False]


def _known(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def return_threshold(legacy_return: float, ratio: float) -> float:
    """Smallest acceptable candidate mean return given legacy's (sign-safe; see module docstring)."""
    return legacy_return + (ratio - 1.0) * abs(legacy_return)


def _at_most(key: str, value, limit, describe, missing: str) -> GateCheck:
    """The check `value <= limit`, described by `describe(value, "<=" or ">")`; skipped with `missing` if unknown."""
    if not _known(value):
        return GateCheck(key, None, limit, None, missing)
    ok = value <= limit
    return GateCheck(key, value, limit, ok, describe(value, "<=" if ok else ">"))


def decide(metrics: dict, gate) -> GateDecision:
    """Apply `gate` (a GateConfig) to shadow `metrics` (pipeline.evaluation.shadow_metrics keys); every check reported."""
    checks = []
    r_c, r_l = metrics.get("candidate_return_mean"), metrics.get("legacy_return_mean")
    key = "gate.min_return_ratio"
    if _known(r_c) and _known(r_l):
        thr = return_threshold(r_l, gate.min_return_ratio)
        ok = r_c >= thr
        checks.append(GateCheck(key, r_c, thr, ok,
                                f"candidate mean return {r_c:.3f} {'>=' if ok else '<'} {thr:.3f} "
                                f"(legacy {r_l:.3f}, ratio {gate.min_return_ratio:g})"))
    else:
        missing = "candidate return (needs the counterfactual pass)" if not _known(r_c) else "legacy return (the log has no rewards)"
        checks.append(GateCheck(key, None, gate.min_return_ratio, None, f"no {missing}"))

    v = metrics.get("candidate_violations")
    checks.append(_at_most("gate.max_violations", v, gate.max_violations,
                           lambda x, op: f"candidate violating steps {int(x)} {op} {gate.max_violations}",
                           "candidate violations: they need the counterfactual pass"))

    rate, source = metrics.get("candidate_intervention_rate"), "candidate driving"
    if not _known(rate):
        rate, source = metrics.get("would_be_intervention_rate"), "would-be, legacy driving"
    checks.append(_at_most("gate.max_intervention_rate", rate, gate.max_intervention_rate,
                           lambda x, op: f"shield intervention rate {x:.4f} {op} {gate.max_intervention_rate:g} ({source})",
                           "no steps logged"))

    known_p99 = [x for x in (metrics.get("latency_p99_us"), metrics.get("counterfactual_latency_p99_us")) if _known(x)]
    p99 = max(known_p99) if known_p99 else None  # the worse pass decides
    checks.append(_at_most("gate.max_latency_p99_us", p99, gate.max_latency_p99_us,
                           lambda x, op: f"candidate latency p99 {x:.1f} us {op} {gate.max_latency_p99_us:g} us",
                           "no latency logged"))

    if "falsification_cases" in metrics:  # the retrain flow ran `falsify` before the gate
        worst = metrics.get("falsification_min_h")
        checks.append(_at_most("gate.max_falsification_cases", metrics.get("falsification_cases"),
                               gate.max_falsification_cases,
                               lambda x, op: f"falsify found {int(x)} shielded violation case(s) "
                                             f"{op} {gate.max_falsification_cases}"
                                             + (f" (lowest barrier value the shield saw {worst:.4f}; below 0 is "
                                                f"inside its margin or braking distance)" if _known(worst) else ""),
                               "falsify did not run"))
    return GateDecision(checks, tuple(gate.waive))
