"""What calibrating bought a run: the twin's prediction error before and after, and the candidate against the
previous production policy on the calibrated twin (the same seeds, paired).

`sim2real run --from-log` evaluates the candidate and the production version in the same episodes of the
calibrated set; when production was trained without calibration, the paired difference of their returns
there is the payoff of retraining on the calibrated set.
"""

from __future__ import annotations

import numpy as np

from pipeline.evaluation.shadow_metrics import mean_ci95


def payoff(result: dict, on_calibrated: dict | None, production_calibrated: bool | None) -> dict:
    """Before/after prediction error of `result` (a calibration), and candidate vs production on the calibrated set.

    on_calibrated: the shadow metrics on the calibrated set (candidate_returns, production_returns paired by seed);
    production_calibrated: whether production was itself trained after a calibration (None: no production).
    """
    err = result["prediction_error"]
    out: dict = {
        "prediction_error_before": err["before"]["rms_normalized"],
        "prediction_error_after": err["after"]["rms_normalized"],
        "against_production": None,
    }
    cand = (on_calibrated or {}).get("candidate_returns") or []
    prod = (on_calibrated or {}).get("production_returns") or []
    if production_calibrated is None or not prod or len(prod) != len(cand):
        return out
    diff = np.asarray(cand, np.float64) - np.asarray(prod, np.float64)
    mean, ci = mean_ci95(diff)
    out["against_production"] = {
        "production_version": on_calibrated.get("production_version"),
        "production_calibrated": bool(production_calibrated),
        "episodes": len(diff),
        "candidate_return_mean": float(np.mean(cand)),
        "production_return_mean": float(np.mean(prod)),
        "paired_difference_mean": mean,
        "paired_difference_ci95": ci,
    }
    return out


def payoff_lines(p: dict) -> list[str]:
    """The payoff in words (the flow's summary artifact and the report use the same sentences)."""
    lines = [
        f"twin prediction error on the log (RMS, noise-std units): nominal {p['prediction_error_before']:.2f} -> "
        f"calibrated {p['prediction_error_after']:.2f}"
    ]
    a = p.get("against_production")
    if a is None:
        lines.append("no previous production version: nothing to compare the candidate with on the calibrated twin")
        return lines
    who = "calibrated earlier" if a["production_calibrated"] else "trained without calibration"
    lo, hi = a["paired_difference_ci95"]
    lines.append(
        f"on the calibrated twin, {a['episodes']} paired episodes (same seeds): candidate return "
        f"{a['candidate_return_mean']:.2f} vs production v{a['production_version']} ({who}) "
        f"{a['production_return_mean']:.2f}; difference {a['paired_difference_mean']:+.2f} "
        f"(95 % CI {lo:+.2f}..{hi:+.2f})"
    )
    return lines
