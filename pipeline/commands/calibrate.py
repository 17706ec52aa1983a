"""`sim2real calibrate --config CFG --from-log LOGS [--out FILE.yaml]`: fit the twin to field logs.

Exit 1 when the fit says the twin is wrong: a `misfit` (the residual stays above
the noise floor a right twin would leave) or `outside` (no plant inside the
config's randomization ranges fits the logs). The calibrated set is still
written, with the verdict in its header, but nothing trained on it should be
promoted before the shield is re-synthesized for it.
"""

from __future__ import annotations

import argparse

from pipeline.commands import CHECK_FAILED, OK, command, emit


@command("calibrate")
def run(args: argparse.Namespace) -> int:
    """Calibrate, print the summary (or JSON), write --out; exit 1 on a misfit or a plant outside the ranges."""
    from pipeline.calibration.calibrate import calibrate, summary_lines, write_calibrated_yaml
    from pipeline.config import load_config

    cfg = load_config(args.config)
    result = calibrate(cfg, args.from_log)
    if args.out:
        result["out"] = str(write_calibrated_yaml(result, args.out))
    emit(args, result, "\n".join(summary_lines(result) + ([f"wrote {result['out']}"] if args.out else [])))
    return CHECK_FAILED if result["verdict"] else OK
