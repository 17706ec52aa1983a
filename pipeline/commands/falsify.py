"""`sim2real falsify`: search the config's envelope for a shielded violation (exit 1 when a case is found)."""

from __future__ import annotations

import argparse
import time

from pipeline.commands import CHECK_FAILED, OK, UsageError, command, emit


@command("falsify")
def run(args: argparse.Namespace) -> int:
    from pipeline.config import load_config
    from pipeline.evaluation.episodes import MIN_H_MEANING, constraint_lines
    from pipeline.evaluation.falsify import extent, falsify

    cfg = load_config(args.config)
    if args.replay:
        return _replay(cfg, args)
    if args.shield:
        raise UsageError("--shield goes with --replay (a search attacks the config's spec or --bundle's)")
    if args.budget_s is not None and not args.budget_s > 0:
        raise UsageError(f"--budget-s must be > 0, got {args.budget_s}")
    if args.candidates is not None and not args.candidates > 0:
        raise UsageError(f"--candidates must be > 0, got {args.candidates}")
    out_dir = args.out or f"reports/falsify-{cfg.task.name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    result = falsify(
        cfg,
        bundle=args.bundle,
        budget_s=args.budget_s,
        candidates=args.candidates,
        seed=args.seed,
        out_dir=out_dir,
        progress=not args.json,
    )
    result["out"] = out_dir
    clock = "--budget-s" if args.budget_s is not None else "falsify.budget_s"
    lines = [
        f"falsify {cfg.task.name}: {extent(result, clock)} ({result['evals_per_s']:.1f}/s; {result['phases']}); "
        f"worst h {result['min_h']} (the lowest barrier value the shield saw: {MIN_H_MEANING})"
    ]
    lines += [
        f"  CASE: set {case['set']}, policy {case['policy']}, seed {case['seed']}: {case['violations']} "
        f"violating step(s); domain {case.get('domain_file')}, replay {case.get('case_file')}"
        for case in result["cases"]
    ]
    if not result["cases"]:
        lines.append(f"  no shielded violation found in {result['evaluated']} candidates")
    lines += constraint_lines(result.get("constraints", {}))
    emit(args, result, "\n".join(lines))
    return CHECK_FAILED if result["cases"] else OK


def _replay(cfg, args: argparse.Namespace) -> int:
    """`--replay CASE`: the case's episodes again, against the shield it names (--shield, --bundle's, the config's)."""
    import json
    from pathlib import Path

    from pipeline.evaluation.episodes import constraint_lines
    from pipeline.evaluation.falsify import attacked, replay_case
    from shield.spec import ShieldSpec

    case_path = Path(args.replay)
    try:
        case = json.loads(case_path.read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"--replay {case_path}: not a readable case file ({err})") from None
    given = None
    if args.shield:
        try:
            given = ShieldSpec.from_dict(json.loads(Path(args.shield).read_text()))
        except (OSError, ValueError) as err:
            raise UsageError(f"--shield {args.shield}: not a readable shield spec ({err})") from None
    spec, runtime = attacked(cfg, args.bundle, given)
    try:
        result = replay_case(cfg, case, spec, bundle_policy=runtime)
    except (KeyError, ValueError) as err:
        raise UsageError(f"--replay {case_path}: {err}") from None
    result["case_file"] = str(case_path)
    import gymnasium as gym  # registered by the replay above

    # A case searched with falsify.episode_steps unset ran the plant's whole episode: say how long that is.
    steps = case["episode_steps"] or cfg.task.max_episode_steps or gym.spec(cfg.task.env_id).max_episode_steps
    lines = [
        f"replay {case_path}: set {case.get('set')}, policy {case['policy']}, seed {case['seed']}, "
        f"{case['episodes']} episode(s) of {steps} steps: {result['violations']} violating step(s) "
        f"(the case found {case.get('violations', '?')}); lowest h {result['min_h']}"
    ]
    lines += constraint_lines(result.get("constraints", {}))
    emit(args, result, "\n".join(lines))
    return CHECK_FAILED if result["violations"] else OK
