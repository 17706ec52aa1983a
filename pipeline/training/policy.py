"""A run's deployable policy: the checkpoint export takes, rebuilt by the algorithm that wrote it."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from pipeline.training.algorithms import algorithm
from pipeline.training.checkpoint import CheckpointError, best_checkpoint, latest_checkpoint, read_checkpoint
from pipeline.training.scaffold import algorithm_of


def load_policy(run_dir: str | Path, which: str = "selected") -> tuple[nn.Module, dict]:
    """Rebuild the deterministic policy (float32[n, obs_dim] -> float32[n, act_dim]) from a run directory.

    which: "selected" (the best checkpoint by validation return when the run
    has one, else the latest), "best" or "latest". Returns (policy, meta) with
    meta = env_id, task, obs_dim, act_dim, action_low, action_high,
    history_length, config_hash, updates, env_steps, hidden_sizes, checkpoint,
    algorithm, and `selection` (why this checkpoint) when it is the best one.
    """
    path = best_checkpoint(run_dir) if which in ("selected", "best") else None
    if path is None and which == "best":
        raise CheckpointError(f"{run_dir}: no best checkpoint (was validation enabled?)")
    path = path or latest_checkpoint(run_dir)
    ckpt = read_checkpoint(path)
    meta = dict(
        env_id=ckpt["env_id"],
        task=ckpt["task"],
        config_hash=ckpt["config_hash"],
        updates=int(ckpt["updates"]),
        env_steps=int(ckpt["env_steps"]),
        checkpoint=Path(path).name,
        algorithm=algorithm_of(ckpt),
        **{"history_length": 0, **ckpt["model_spec"]},
    )
    if "selection" in ckpt:
        meta["selection"] = ckpt["selection"]
    return algorithm(algorithm_of(ckpt)).deployable(ckpt), meta
