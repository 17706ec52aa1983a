"""Training checkpoints: atomic writes, plain tensors/dicts only.

A checkpoint is `run_dir/checkpoints/ckpt_<updates:08d>.pt` written with
torch.save to a temp file, fsynced, then renamed, so a crash never leaves a
half-written file under the final name. Everything in it is a tensor, number,
string, list or dict, so `torch.load(weights_only=True)` reads it and nothing
from the file is unpickled as arbitrary objects.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

CHECKPOINT_DIR = "checkpoints"
BEST_NAME = "best.pt"  # the best weights by validation return (model selection); never pruned
_NAME = re.compile(r"^ckpt_(\d{8})\.pt$")


class CheckpointError(RuntimeError):
    """A run directory has no readable checkpoint."""


def checkpoint_path(run_dir: str | Path, updates: int) -> Path:
    """Where the checkpoint for `updates` goes."""
    return Path(run_dir) / CHECKPOINT_DIR / f"ckpt_{updates:08d}.pt"


def write_checkpoint(run_dir: str | Path, updates: int, state: dict, keep: int = 3) -> Path:
    """Atomically write `state` as the checkpoint for `updates`; keep the newest `keep`."""
    final = _atomic_save(checkpoint_path(run_dir, updates), state)
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def write_best(run_dir: str | Path, state: dict) -> Path:
    """Atomically write the best checkpoint so far (model weights, spec, `selection`: why it is the best)."""
    return _atomic_save(Path(run_dir) / CHECKPOINT_DIR / BEST_NAME, state)


def best_checkpoint(run_dir: str | Path) -> Path | None:
    """Path of the run's best checkpoint by validation return, or None."""
    path = Path(run_dir) / CHECKPOINT_DIR / BEST_NAME
    return path if path.is_file() else None


def _atomic_save(final: Path, state: dict) -> Path:
    ckpt_dir = final.parent
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = final.with_suffix(".pt.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    # fsync the directory so the rename itself survives a power loss.
    dir_fd = os.open(ckpt_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint files of a run, oldest first."""
    ckpt_dir = Path(run_dir) / CHECKPOINT_DIR
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir() if _NAME.match(p.name))


def latest_checkpoint(run_dir: str | Path) -> Path:
    """Path of the newest checkpoint in `run_dir`; CheckpointError if there is none."""
    found = list_checkpoints(run_dir)
    if not found:
        raise CheckpointError(
            f"no checkpoint in {Path(run_dir) / CHECKPOINT_DIR} (is {run_dir} a training run directory?)"
        )
    return found[-1]


def read_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    """Load a checkpoint with weights_only=True (no arbitrary unpickling)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch raises several types for corrupt/hostile files
        raise CheckpointError(f"cannot read checkpoint {path}: {err}") from None
