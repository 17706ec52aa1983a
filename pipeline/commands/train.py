"""`sim2real train`: train a policy (pipeline.training.train) and say where the run went."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.commands import command, emit


@command("train")
def run(args: argparse.Namespace) -> int:
    """args: config, steps, actors, envs_per_actor, out, ray_address, resume, json."""
    from pipeline import DEFAULT_CONFIG
    from pipeline.config import load_config
    from pipeline.training.train import is_adaptive, train

    # A resumed run keeps its own resolved config unless another one is named explicitly.
    config_path = args.config or (Path(args.resume) / "config.yaml" if args.resume else DEFAULT_CONFIG)
    cfg = load_config(config_path)
    if args.resume and not is_adaptive(cfg):  # an adaptive run refuses it in train
        from pipeline.training.metrics import trim_to_checkpoint

        trim_to_checkpoint(args.resume)
    result = train(
        cfg,
        out_dir=args.out,
        steps=args.steps,
        actors=args.actors,
        envs_per_actor=args.envs_per_actor,
        ray_address=args.ray_address,
        resume=args.resume,
        progress=True,
    )
    ret = "n/a" if result.final_return is None else f"{result.final_return:.1f}"
    lines = [
        f"trained {result.algorithm}: {result.updates} updates, {result.env_steps} env steps in {result.wall_s:.1f} s; "
        f"final return {ret}; run dir {result.run_dir}"
    ]
    if result.best_updates is not None:
        lines.append(
            f"selected checkpoint: update {result.best_updates} (best validation return "
            f"{result.best_validation_return:.1f}; {result.run_dir}/selection.json)"
            + (f"; stopped early: {result.stopped_early}" if result.stopped_early else "")
        )
    if result.entropy_collapsed:
        lines.append(collapse_note(result.entropy))
    if result.stall_note:
        lines.append(f"note: {result.stall_note}")
    emit(args, result.to_dict(), "\n".join(lines))
    return 0


def collapse_note(entropy: float) -> str:
    """What to do about a policy whose entropy collapsed (metrics.ENTROPY_COLLAPSE_NATS)."""
    from pipeline.training.metrics import ENTROPY_COLLAPSE_NATS

    return (
        f"note: the policy's entropy ended at {entropy:.2f} nats over its action dimensions, below "
        f"{ENTROPY_COLLAPSE_NATS} per dimension (collapsed: it barely explores any more); if the return stalled, "
        f"give it more entropy (train.entropy_coef, sac.target_entropy), or let `sim2real tune` search them "
        f"(tune.searchable)"
    )
