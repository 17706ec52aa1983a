"""Per-update training metrics: TensorBoard, metrics.jsonl and progress on stderr (pipeline/progress.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from pipeline.progress import Progress
from shield.bundle import atomic_write_bytes

# What the progress line shows; everything else goes only to the files.
PROGRESS_KEYS = (
    "env_steps_per_s",
    "episode_return",
    "episode_cost",
    "policy_lag_mean",
    "approx_kl",
    "entropy",
    "actor_restarts",
)

# The policy's entropy per action dimension (nats) below which the progress line and the run's result say it
# collapsed: a Gaussian of std 0.05 in a normalized action unit has -1.58 nats. Below it the policy barely
# explores any more; if the return has stalled there, more entropy (train.entropy_coef, sac.target_entropy)
# or a search over those settings (`sim2real tune`) is what to try.
ENTROPY_COLLAPSE_NATS = -1.5


def is_entropy_collapsed(entropy: float | None, act_dim: int) -> bool:
    """`entropy`: the policy's, summed over its `act_dim` action dimensions (what the learners report)."""
    return entropy is not None and entropy / act_dim < ENTROPY_COLLAPSE_NATS


class MetricsLogger:
    """Writes one record per learner update to `run_dir/metrics.jsonl` and TensorBoard, and shows progress."""

    def __init__(self, run_dir: Path, total_steps: int, act_dim: int, start_steps: int = 0, progress: bool = True):
        self.act_dim = act_dim
        self.jsonl = open(Path(run_dir) / "metrics.jsonl", "a", buffering=1)
        # Flushed every few seconds, not every two minutes: a run stopped from outside (a population member
        # that copies a better one, a lost node) keeps its TensorBoard scalars up to then. A run resumed from its
        # checkpoint at `start_steps` logs the updates after it again: TensorBoard's purge hides what an earlier
        # life logged past the checkpoint, so each step shows once (metrics.jsonl: trim_to_checkpoint).
        purge = start_steps + 1 if start_steps > 0 else None
        self.writer = SummaryWriter(log_dir=str(run_dir), flush_secs=5, purge_step=purge)
        self.progress = Progress(total_steps, "step", desc="train", initial=start_steps, enabled=progress)

    def log(self, record: dict) -> None:
        step = int(record["env_steps"])
        self.jsonl.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if isinstance(value, (int, float)) and key not in ("updates", "env_steps"):
                self.writer.add_scalar(f"train/{key}", value, step)
        shown = {k: _short(record[k]) for k in PROGRESS_KEYS if k in record}
        if is_entropy_collapsed(record.get("entropy"), self.act_dim):
            shown["entropy"] += (
                f" (collapsed: < {ENTROPY_COLLAPSE_NATS} nats per action dimension; see `sim2real tune`)"
            )
        self.progress.update_to(step, shown)

    def close(self) -> None:
        self.progress.close()
        self.writer.close()
        self.jsonl.close()


def trim_to_checkpoint(run_dir: str | Path) -> int:
    """Before a run resumes from its latest checkpoint: drop the metrics.jsonl records logged after it (a run that
    died some updates past its last checkpoint logged them, and the resumed run logs those updates again, so they
    appeared twice). Returns the records dropped. For a plain resume (`train --resume`, a night continued or
    retried); not for a population member restored from another's checkpoint, whose lineage indexes its records."""
    from pipeline.training.checkpoint import latest_checkpoint, read_checkpoint

    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return 0
    env_steps = int(read_checkpoint(latest_checkpoint(run_dir))["env_steps"])
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _env_steps(line) <= env_steps]
    if len(kept) != len(lines):
        atomic_write_bytes(path, "".join(kept).encode())
    return len(lines) - len(kept)


def _env_steps(line: str) -> float:
    """A record's env_steps (a line cut short by the crash counts as past every checkpoint)."""
    try:
        return float(json.loads(line)["env_steps"])
    except (ValueError, KeyError, TypeError):
        return math.inf


def _short(value):
    return f"{value:.3g}" if isinstance(value, float) else value
