"""`sim2real calibrate --config CFG --from-log LOGS [--out FILE.yaml]`: fit the twin to field logs.

Exit 1 when the fit says the twin is wrong: a `misfit` (the residual stays above
the noise floor a right twin would leave) or `outside` (no plant inside the
config's randomization ranges fits the logs). The calibrated set is still
written, with the verdict in its header, but nothing trained on it should be
promoted before the shield is re-synthesized for it.

`--bundle B` sets an adaptive policy's plant estimate on the same logs beside the fit.

`--plan [--params A,B] [--amplitude A] [--steps N] [--from-log QUIET] [--out plan.json]`
designs an excitation instead (pipeline.calibration.plan); exit 1 when no
candidate is safe at every corner of `reality` at that amplitude, or when the
safe one is expected to pin none of the chosen parameters.
"""

from __future__ import annotations

import argparse

from pipeline.commands import CHECK_FAILED, OK, UsageError, command, emit


@command("calibrate")
def run(args: argparse.Namespace) -> int:
    """Calibrate, print the summary (or JSON), write --out; exit 1 on a misfit or a plant outside the ranges."""
    from pipeline.config import load_config

    if getattr(args, "plan", False):
        return _plan(args, load_config(args.config))
    if not args.from_log:
        raise UsageError("--from-log: required (the shadow logs to calibrate to), unless --plan")
    from pipeline.calibration.calibrate import calibrate, summary_lines, write_calibrated_yaml

    cfg = load_config(args.config)
    result = calibrate(cfg, args.from_log, bundle=getattr(args, "bundle", None))
    if args.out:
        result["out"] = str(write_calibrated_yaml(result, args.out))
    emit(args, result, "\n".join(summary_lines(result) + ([f"wrote {result['out']}"] if args.out else [])))
    return CHECK_FAILED if result["verdict"] else OK


def _plan(args: argparse.Namespace, cfg) -> int:
    """Design the excitation plan, print its summary (or JSON), write --out; exit 1 when no candidate is safe or
    the safe one is expected to pin none of the chosen parameters."""
    from pipeline.calibration.plan import design_plan, plan_lines, plan_pins_something, write_plan
    from pipeline.evaluation.excitation import corner_check

    params = [p.strip() for p in args.params.split(",")] if args.params else None
    plan = design_plan(
        cfg,
        params=params,
        amplitude=args.amplitude,
        steps=args.steps,
        from_log=args.from_log,
        seed=args.seed,
        safety_check=lambda sequence: corner_check(cfg, sequence, args.seed),
    )
    lines = plan_lines(plan)
    if args.out:
        lines.append(f"wrote {write_plan(plan, args.out)}")
    emit(args, plan, "\n".join(lines))
    return OK if plan_pins_something(plan) else CHECK_FAILED
