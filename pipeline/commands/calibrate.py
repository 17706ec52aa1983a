"""`sim2real calibrate --config CFG --from-log LOGS [--out FILE.yaml]`: fit the twin to field logs."""

from __future__ import annotations

import argparse

from pipeline.commands import command, emit


@command("calibrate")
def run(args: argparse.Namespace) -> int:
    """Calibrate, print the summary (or JSON), write --out."""
    from pipeline.calibration.calibrate import calibrate, summary_lines, write_calibrated_yaml
    from pipeline.config import load_config

    cfg = load_config(args.config)
    result = calibrate(cfg, args.from_log)
    if args.out:
        result["out"] = str(write_calibrated_yaml(result, args.out))
    emit(args, result, "\n".join(summary_lines(result) + ([f"wrote {result['out']}"] if args.out else [])))
    return 0
