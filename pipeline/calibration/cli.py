"""`sim2real calibrate --config CFG --from-log LOGS [--out FILE.yaml] [--json]`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from pipeline.calibration.logs import CalibrationError


def summary_lines(result: dict) -> list[str]:
    """Identified vs nominal, per parameter, latency, noise and prediction error: the human summary.

    The flow's markdown artifact uses the same lines (as a Markdown list).
    """
    err = result["prediction_error"]
    log = result["log"]
    lines = [f"calibration of {result['task']} from {log['seconds']:.0f} s of log "
             f"({log['windows']} windows of {log['horizon_steps']} steps, {result['wall_s']:.1f} s)",
             f"prediction error (RMS over the window, in noise std units): "
             f"nominal twin {err['before']['rms_normalized']:.2f} -> calibrated {err['after']['rms_normalized']:.2f}",
             f"latency: {result['latency_steps']['identified']} control steps"]
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
    header = "".join(f"# {line}\n" for line in ["calibrated randomization set (sim2real calibrate)",
                                                 *summary_lines(result)])
    path.write_text(header + yaml.safe_dump(result["calibrated"], sort_keys=True))
    return path


def run_cli(args: argparse.Namespace) -> int:
    """Calibrate, print the summary (or JSON), write --out."""
    from pipeline.calibration.calibrate import calibrate
    from pipeline.config import load_config

    cfg = load_config(args.config)
    try:
        result = calibrate(cfg, args.from_log)
    except CalibrationError as err:
        print(f"sim2real calibrate: error: {err}", file=sys.stderr)
        return 2
    if args.out:
        result["out"] = str(write_calibrated_yaml(result, args.out))
    if args.json:
        print(json.dumps(result, default=float))
    else:
        print("\n".join(summary_lines(result) + ([f"wrote {result['out']}"] if args.out else [])))
    return 0
