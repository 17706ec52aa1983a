"""Per-update training metrics: TensorBoard, metrics.jsonl and a tqdm bar on stderr."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

# What the progress bar shows; everything else goes only to the files.
BAR_KEYS = ("env_steps_per_s", "episode_return", "episode_cost", "policy_lag_mean", "approx_kl", "actor_restarts")


class MetricsLogger:
    """Writes one record per learner update to `run_dir/metrics.jsonl` and TensorBoard."""

    def __init__(self, run_dir: Path, total_steps: int, start_steps: int = 0, progress: bool = True):
        self.jsonl = open(Path(run_dir) / "metrics.jsonl", "a", buffering=1)
        self.writer = SummaryWriter(log_dir=str(run_dir))
        self.bar = tqdm(total=total_steps, initial=start_steps, unit="step", file=sys.stderr,
                        disable=not progress, dynamic_ncols=True, smoothing=0.1)

    def log(self, record: dict) -> None:
        step = int(record["env_steps"])
        self.jsonl.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if isinstance(value, (int, float)) and key not in ("updates", "env_steps"):
                self.writer.add_scalar(f"train/{key}", value, step)
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix({k: _short(record[k]) for k in BAR_KEYS if k in record}, refresh=False)

    def close(self) -> None:
        self.bar.close()
        self.writer.close()
        self.jsonl.close()


def _short(value):
    return f"{value:.3g}" if isinstance(value, float) else value
