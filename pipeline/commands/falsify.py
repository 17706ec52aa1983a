"""`sim2real falsify`: search the config's envelope for a shielded violation (exit 1 when a case is found)."""

from __future__ import annotations

import argparse
import time

from pipeline.commands import CHECK_FAILED, OK, UsageError, command, emit


@command("falsify")
def run(args: argparse.Namespace) -> int:
    from pipeline.config import load_config
    from pipeline.evaluation.episodes import constraint_lines
    from pipeline.evaluation.falsify import falsify

    cfg = load_config(args.config)
    if args.budget_s is not None and not args.budget_s > 0:
        raise UsageError(f"--budget-s must be > 0, got {args.budget_s}")
    out_dir = args.out or f"reports/falsify-{cfg.task.name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    result = falsify(
        cfg, bundle=args.bundle, budget_s=args.budget_s, seed=args.seed, out_dir=out_dir, progress=not args.json
    )
    result["out"] = out_dir
    lines = [
        f"falsify {cfg.task.name}: {result['evaluated']} candidates in {result['wall_s']:.0f} s "
        f"({result['evals_per_s']:.1f}/s; {result['phases']}; {result['corners_total']} corner candidates in "
        f"all); worst h {result['min_h']} (the lowest barrier value the shield saw: below 0 "
        f"the plant was inside the shield's margin or braking distance; a case is the constraint itself crossed)"
    ]
    lines += [
        f"  CASE: set {case['set']}, policy {case['policy']}, seed {case['seed']}: {case['violations']} "
        f"violating step(s); domain {case.get('domain_file')}, replay {case.get('case_file')}"
        for case in result["cases"]
    ]
    if not result["cases"]:
        lines.append("  no shielded violation found within the budget")
    lines += constraint_lines(result.get("constraints", {}))
    emit(args, result, "\n".join(lines))
    return CHECK_FAILED if result["cases"] else OK
