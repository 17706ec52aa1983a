"""`sim2real tune`: population-based training of the config's trainer (pipeline.training.tune), and its winner."""

from __future__ import annotations

import argparse
import contextlib
import sys

from pipeline.commands import command, emit


@command("tune")
def run(args: argparse.Namespace) -> int:
    """args: config, population, budget_s, steps, out, ray_address, json."""
    from pipeline.config import load_config
    from pipeline.training.tune import tune

    cfg = load_config(args.config)
    # Ray Tune and the members' processes print their own status; stdout keeps only the summary (--json).
    with contextlib.redirect_stdout(sys.stderr):
        result = tune(
            cfg,
            out_dir=args.out,
            population=args.population,
            budget_s=args.budget_s,
            steps=args.steps,
            ray_address=args.ray_address,
        )
    lines = [
        f"tuned {result.algorithm}: {result.population} members, {result.perturbations} perturbations, "
        f"{result.resumes} resumes from a member's own checkpoint, in {result.wall_s:.0f} s"
    ]
    for m in result.members:
        score = "n/a" if m.best_validation_return is None else f"{m.best_validation_return:.1f}"
        hps = ", ".join(f"{k}={v:.3g}" for k, v in m.hyperparameters.items())
        lines.append(f"  {m.member}: best validation return {score}, {m.env_steps} env steps; {hps}")
    if result.best_member is None:
        lines.append("no member finished a validation: nothing selected (raise --budget-s or train.total_env_steps)")
    else:
        hps = ", ".join(f"{k}={v:.3g}" for k, v in result.best_hyperparameters.items())
        lines.append(
            f"best: {result.best_member} (validation return {result.best_validation_return:.1f} at update "
            f"{result.best_updates}; {hps}); run dir {result.run_dir} (`sim2real export {result.run_dir}`)"
        )
    emit(args, result.to_dict(), "\n".join(lines))
    return 0 if result.best_member is not None else 1
