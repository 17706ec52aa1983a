"""Calibrate a task config's randomized physical parameters to field logs: the `calibrated` set.

`calibrate(cfg, logs)` returns a JSON-ready dict: per parameter the nominal,
configured and identified scale and the calibrated range; the latency found;
observation noise; which parameters the logs cannot pin down (they keep their
configured `reality` range, else `train`'s); the prediction error before (the
nominal twin, no latency) and after; and `calibrated`, a RandomizationSet dict.
`summary_lines(result)` is its human summary (the CLI and the flow's artifact);
`write_calibrated_yaml` writes the calibrated set as a `--domains` file.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import yaml

from pipeline.calibration.fit import (
    BOUND_WIDEN,
    POSTERIOR_SHRINK,
    Problem,
    cut_windows,
    identifiability,
    one_step_noise,
    solve,
)
from pipeline.calibration.logs import CalibrationError, load_field_log
from pipeline.calibration.sets import calibrated_set, configured_ranges, kept_range, obs_noise_vector
from pipeline.calibration.twin import Twin

CHUNKS = 5  # the log is split in this many time slices, fitted apart, for the calibrated ranges
MIN_RELATIVE_HALF_WIDTH = 0.05  # a calibrated range is at least +-5 % around the identified scale (the fit's own bias on 60 s of log reaches ~3 %)
PRIOR_WEIGHT = 1e-2  # the prior's pull, relative to one normalized residual


def _latency_candidates(cfg) -> list[int]:
    highs = [r.latency_steps.high for r in cfg.randomization.values() if r.latency_steps is not None]
    return list(range(0, max(highs, default=0) + 2))  # one step past the configured worst case


def _prediction_error(problem: Problem, theta: np.ndarray) -> dict:
    """Open-loop error from the logged initial states (steps 1..H), physical units and normalized."""
    r = problem.data_residuals(problem.start(theta)).reshape(problem.measured.shape)[:, 1:]
    physical = r * problem.scale
    return {
        "rms_normalized": float(np.sqrt(np.mean(r**2))),
        "rms_per_state_obs": [float(v) for v in np.sqrt(np.mean(physical**2, axis=(0, 1)))],
        "final_step_rms_per_state_obs": [float(v) for v in np.sqrt(np.mean(physical[:, -1] ** 2, axis=0))],
    }


def calibrate(cfg, logs) -> dict:
    """Fit the twin to shadow logs at `logs` (file or directory) per `cfg.calibration`; see the module docstring."""
    import envs

    known, horizon, min_seconds = cfg.calibration.known, cfg.calibration.horizon_steps, cfg.calibration.min_log_seconds
    t0 = time.perf_counter()
    task = envs.TASKS.get(cfg.task.env_id)
    if task is None:
        raise CalibrationError(f"task.env_id {cfg.task.env_id!r}: not a known task")
    twin = Twin(cfg.task.env_id)
    hull = configured_ranges(cfg)
    known = dict(known or {})
    unknown_known = sorted(set(known) - set(hull))
    if unknown_known:
        raise CalibrationError(
            f"calibration.known: {unknown_known} not randomized by the config; randomized parameters: {sorted(hull)}"
        )
    log = load_field_log(
        logs,
        task=cfg.task.name,
        obs_dim=task["obs_dim"],
        act_dim=task["act_dim"],
        dt=task["control_period_s"],
        min_seconds=min_seconds,
    )
    names = [n for n in sorted(hull) if n not in known]
    lo = np.log([hull[n][0] for n in names]) if names else np.zeros(0)
    hi = np.log([hull[n][1] for n in names]) if names else np.zeros(0)
    centre = 0.5 * (lo + hi)
    prior_std = np.maximum((hi - lo) / math.sqrt(12.0), 1e-3)  # a uniform prior's std, log scale
    bounds = (lo - math.log(BOUND_WIDEN), hi + math.log(BOUND_WIDEN))
    latencies = _latency_candidates(cfg)
    windows = cut_windows(twin, log, horizon, horizon + 1, max(latencies))
    # Channel scale: each state observation's noise (lag-1 estimate on the nominal twin), floored at
    # 1 % of its typical change over a window so a noise-free channel cannot dominate.
    change = np.std(windows.target[:, -1] - windows.first, axis=0)
    scale = np.maximum(one_step_noise(twin, log, known, 0), 0.01 * change + 1e-9)
    weight = PRIOR_WEIGHT * math.sqrt(windows.target.size)

    def problem(lat: int, win=windows) -> Problem:
        return Problem(twin, win, lat, names, known, centre, prior_std, scale, weight)

    before = problem(0)
    f_scale = 3.0 * 1.4826 * float(np.median(np.abs(before.data_residuals(before.start(np.zeros(len(names)))))))
    theta0 = np.clip(centre, *bounds)
    # Latency: a short fit per candidate on every third window (the error minimum is sharp in whole steps).
    search = windows.subset(np.arange(len(windows.starts)) % 3 == 0)
    fits = {
        lat: solve(problem(lat, search), problem(lat, search).start(theta0), f_scale, 6, bounds) for lat in latencies
    }
    costs = {lat: f.cost for lat, f in fits.items()}
    latency = min(costs, key=costs.get)
    # Refine on every window, the loss scaled to the fit's residuals (outliers judged against the fit, not the guess).
    after = problem(latency)
    f_scale = 3.0 * 1.4826 * float(np.median(np.abs(fits[latency].residuals)))
    best = solve(after, after.start(fits[latency].theta), f_scale, 20, bounds)
    post_std, shrink, flat = identifiability(best, prior_std, inflation=float(horizon) / 4.0)

    # Per-chunk fits (time slices of the log) give the spread behind each calibrated range.
    chunk_of = np.minimum((np.arange(len(windows.starts)) * CHUNKS) // len(windows.starts), CHUNKS - 1)
    chunk_theta = []
    for c in range(CHUNKS if names else 0):
        part = problem(latency, windows.subset(chunk_of == c))
        chunk_theta.append(solve(part, part.start(best.theta), f_scale, 6, bounds).theta)
    chunk_theta = np.array(chunk_theta).reshape(len(chunk_theta), len(names))

    scales = {**known, **{n: float(math.exp(t)) for n, t in zip(names, best.theta)}}
    parameters, unidentified = {}, []
    for i, name in enumerate(names):
        identified = bool(shrink[i] < POSTERIOR_SHRINK)
        centre_s = scales[name]
        if identified:
            spread = np.exp(chunk_theta[:, i])
            half = max(2.0 * post_std[i] * centre_s, MIN_RELATIVE_HALF_WIDTH * centre_s)
            rng = (max(min(spread.min(), centre_s - half), 1e-3), max(spread.max(), centre_s + half))
        else:
            unidentified.append(name)
            rng = kept_range(cfg, name)
        parameters[name] = {
            "nominal": 1.0,
            "configured": list(hull[name]),
            "identified": centre_s,
            "identified_ok": identified,
            "posterior_to_prior_std": float(shrink[i]),
            "chunk_fits": [float(math.exp(t)) for t in chunk_theta[:, i]],
            "range": [float(rng[0]), float(rng[1])],
        }
    for name, value in known.items():
        parameters[name] = {
            "nominal": 1.0,
            "configured": list(hull[name]),
            "identified": float(value),
            "identified_ok": True,
            "known": True,
            "range": [float(value), float(value)],
        }

    noise = one_step_noise(twin, log, scales, latency)
    reality = cfg.randomization.get("reality") or cfg.randomization["train"]
    obs_noise = obs_noise_vector(reality.obs_noise_std, task["obs_dim"])
    for o, std in zip(twin.state_obs, noise):
        obs_noise[o] = float(std)
    result = {
        "task": cfg.task.name,
        "env_id": cfg.task.env_id,
        "log": {
            "source": log.source,
            "steps": len(log.obs),
            "seconds": log.seconds,
            "runs": len(log.runs),
            "windows": len(windows.starts),
            "horizon_steps": horizon,
        },
        "latency_steps": {"identified": latency, "candidates": {str(k): v for k, v in costs.items()}},
        "parameters": parameters,
        "unidentified": unidentified,
        "flat_directions": [
            {"information_vs_prior": v, "weights": {n: round(float(w), 3) for n, w in zip(names, vec) if abs(w) > 0.2}}
            for v, vec in flat
        ],
        "obs_noise_std": obs_noise,
        "state_obs": twin.state_obs,
        "prediction_error": {
            "before": _prediction_error(before, np.zeros(len(names))),
            "after": _prediction_error(after, best.theta),
        },
        "not_identified_from_logs": ["action_noise_std", "push"],
    }
    result["calibrated"] = calibrated_set(result, reality)
    result["wall_s"] = time.perf_counter() - t0
    return result


def summary_lines(result: dict) -> list[str]:
    """Identified vs nominal, per parameter, latency, noise and prediction error: the human summary.

    The flow's markdown artifact uses the same lines (as a Markdown list).
    """
    err = result["prediction_error"]
    log = result["log"]
    lines = [
        f"calibration of {result['task']} from {log['seconds']:.0f} s of log "
        f"({log['windows']} windows of {log['horizon_steps']} steps, {result['wall_s']:.1f} s)",
        f"prediction error (RMS over the window, in noise std units): "
        f"nominal twin {err['before']['rms_normalized']:.2f} -> calibrated {err['after']['rms_normalized']:.2f}",
        f"latency: {result['latency_steps']['identified']} control steps",
    ]
    for name, p in sorted(result["parameters"].items()):
        lo, hi = p["range"]
        if p.get("known"):
            status = "known (calibration.known)"
        elif p["identified_ok"]:
            status = f"identified, calibrated range {lo:.3f}..{hi:.3f}"
        else:
            status = f"NOT identified by the logs (best fit {p['identified']:.3f}); keeps {lo:.3f}..{hi:.3f}"
        lines.append(f"{name}: nominal 1.000, identified {p['identified']:.3f}: {status}")
    for d in result["flat_directions"]:
        combo = " + ".join(f"{w:+.2f} log {n}" for n, w in d["weights"].items())
        lines.append(f"flat direction (logs cannot pin it): {combo}")
    noise = ", ".join(f"{v:.4f}" for v in result["obs_noise_std"])
    lines.append(f"observation noise std: [{noise}]; action noise and pushes keep the configured values")
    return lines


def write_calibrated_yaml(result: dict, path: str | Path) -> Path:
    """The calibrated set as a bare RandomizationSet YAML (usable as --domains), the summary as comments."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "".join(
        f"# {line}\n" for line in ["calibrated randomization set (sim2real calibrate)", *summary_lines(result)]
    )
    path.write_text(header + yaml.safe_dump(result["calibrated"], sort_keys=True))
    return path
