"""`sim2real shadow BUNDLE`: shadow evaluation beside the legacy controller, then the gate (exit 1 unless it passes)."""

from __future__ import annotations

import argparse

from pipeline.commands import CHECK_FAILED, OK, command, emit


@command("shadow")
def run(args: argparse.Namespace) -> int:
    from pipeline.config import load_config
    from pipeline.evaluation.shadow import run_shadow

    cfg = load_config(args.config)
    result = run_shadow(args.bundle, cfg, domains=args.domains, episodes=args.episodes, seed=args.seed,
                        report_dir=args.report, legacy=args.legacy, from_log=args.from_log)
    m = result["metrics"]
    lines = [f"{m['episodes']} episodes, {m['steps']} steps ({m['source']}): action RMSE "
             f"{[round(x, 4) for x in m['action_rmse']]}, agreement {m['agreement_rate']:.3f}, "
             f"would-be interventions {m['would_be_intervention_rate']:.3f}",
             f"gate: {result['decision'].upper()}",
             *(f"  {reason}" for reason in result["reasons"]),
             f"report: {result['report']}"]
    emit(args, result, "\n".join(lines))
    return OK if result["decision"] == "pass" else CHECK_FAILED
