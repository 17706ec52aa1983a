"""An adaptive policy's plant estimate on the same field logs the fit used, set beside the fit
(`sim2real calibrate --from-log LOGS --bundle B`).

The bundle's policy is replayed over each contiguous run of the log exactly as `sim2real serve --mode shadow`
runs it beside the plant: one policy state per run, started from its initial value, each step's observation
and the action the plant really applied (the legacy one) written into it. Its `plant_estimate` (the contract's
parameters, physical units) is taken at every step whose history was full; per parameter the median and the
10-90 % spread over those steps are reported beside the fit's value and calibrated range for the same name, so
an operator sees whether the policy believes in the plant the logs show. The fit is the reference: it uses a
model and every window of the log, the policy sees only its last H steps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.calibration.logs import CalibrationError, FieldLog
from shield.bundle import Bundle
from shield.contract import estimate_names, observation_wraps
from shield.policy import OnnxPolicy

SPREAD = (10.0, 90.0)  # percentiles of the per-step estimates reported as their spread


def replay_estimates(policy: OnnxPolicy, log: FieldLog) -> np.ndarray:
    """float64[n, P]: the policy's plant estimate at each logged step whose history was full (every run replayed
    from the initial state, the applied action recorded as sent)."""
    rows = []
    for start, stop in log.runs:
        memory = policy.new_memory()
        for t in range(start, stop):
            policy.act(log.obs[t], memory)
            if t - start >= policy.history_length:  # the history holds logged steps only, no initial zeros
                rows.append(np.asarray(memory.estimate, np.float64))
            policy.remember(memory, log.obs[t], log.action[t])
    return np.asarray(rows, np.float64).reshape(len(rows), policy.estimate_dim)


def compare_with_fit(bundle_dir: str | Path, log: FieldLog, fit: dict) -> dict:
    """The policy's estimate on `log` beside `fit` (`calibrate`'s result): JSON-ready, per parameter."""
    bundle = Bundle.load(bundle_dir)
    names = estimate_names(bundle.manifest.get("contract"))
    if not names:
        raise CalibrationError(
            f"--bundle {bundle_dir}: its policy states no plant estimate "
            "(only an adaptive policy, train.adaptive, has one)"
        )
    policy = OnnxPolicy(bundle.policy_onnx, wraps=observation_wraps(bundle.manifest.get("contract")))
    if (policy.obs_dim, policy.act_dim) != (log.obs.shape[1], log.action.shape[1]):
        raise CalibrationError(
            f"--bundle {bundle_dir}: its policy is obs {policy.obs_dim}/act {policy.act_dim}, the log "
            f"{log.obs.shape[1]}/{log.action.shape[1]}"
        )
    estimates = replay_estimates(policy, log)
    if not len(estimates):
        raise CalibrationError(
            f"--bundle {bundle_dir}: no run of the log is longer than the policy's history "
            f"({policy.history_length} steps)"
        )
    stated = {p["name"]: p for p in bundle.manifest["contract"]["plant_estimate"]["parameters"]}
    low, median, high = np.percentile(estimates, [SPREAD[0], 50.0, SPREAD[1]], axis=0)
    rows = []
    for k, name in enumerate(names):
        row = {
            "name": name,
            "policy_median": float(median[k]),
            "policy_spread": [float(low[k]), float(high[k])],
            "held_out_r2": stated[name].get("held_out_r2"),
            "train_range": [stated[name]["low"], stated[name]["high"]],
        }
        if name == "latency_steps":
            row["fit"] = fit["latency_steps"]["identified"]
            row["fit_range"] = [row["fit"], row["fit"]]
        elif name in fit.get("parameters", {}):
            p = fit["parameters"][name]
            row["fit"] = p.get("identified")
            row["fit_range"] = list(p["interval"]) if p.get("identified_ok") else list(p["range"])
            row["fit_pinned"] = bool(p.get("identified_ok"))
        else:  # randomized for training, not fitted (calibration.known, or no twin parameter of that name)
            row["fit"], row["fit_range"] = None, None
        if row["fit_range"] is not None:
            a, b = row["fit_range"]
            slack = 0.5 if name == "latency_steps" else 0.0  # a whole number of steps: the median rounds to it
            row["policy_inside_fit_range"] = bool(a - slack <= median[k] <= b + slack)
        rows.append(row)
    return {
        "bundle": str(bundle_dir),
        "version": bundle.manifest.get("version"),
        "steps": int(len(estimates)),
        "history_length": policy.history_length,
        "parameters": rows,
    }


def comparison_lines(comparison: dict) -> list[str]:
    """Human lines: one per parameter, the policy's median and spread beside the fit."""
    lines = [
        f"the policy's plant estimate ({comparison['bundle']}, over {comparison['steps']} logged steps with a full "
        f"history of {comparison['history_length']}; median, {SPREAD[0]:g}-{SPREAD[1]:g} % spread) beside the fit:"
    ]
    for row in comparison["parameters"]:
        a, b = row["policy_spread"]
        text = f"  {row['name']}: policy {row['policy_median']:.3g} ({a:.3g}..{b:.3g})"
        if row["held_out_r2"] is not None:
            text += f", held-out R^2 {row['held_out_r2']:.2f}"
        if row["fit_range"] is None:
            text += "; not fitted"
        else:
            lo, hi = row["fit_range"]
            fitted = f"{row['fit']:.3g}" if isinstance(row["fit"], (int, float)) else "-"
            kind = "interval" if row.get("fit_pinned", True) else "calibrated range"
            text += f"; fit {fitted} ({kind} {lo:.3g}..{hi:.3g})"
            text += "" if row["policy_inside_fit_range"] else "  <- the policy believes another plant"
        lines.append(text)
    return lines
