"""Building blocks every algorithm's networks share: the observation normalizer, the MLP, CPU copies of state,
replay minibatches as tensors.

The normalizer's buffers travel in each network's state_dict, so checkpoints,
rollout actors and the exported graph all normalize the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

# Normalized observations are clipped to +-OBS_CLIP: a state far outside what
# training saw must not drive the network into a region it never fitted.
OBS_CLIP = 10.0
VAR_EPS = 1e-8


class RunningMeanStd(nn.Module):
    """Running mean/variance of observations (parallel Welford merge).

    Buffers, not parameters: they live in the state_dict (so checkpoints and
    export carry them) but the optimizer never touches them. Only the learner
    calls `update`; rollout actors receive the stats with the weights.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("var", torch.ones(dim, dtype=torch.float64))
        # Starts at a tiny count so the first batch essentially replaces the prior.
        self.register_buffer("count", torch.tensor(1e-4, dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Merge a batch `[n, dim]` of raw observations into the statistics."""
        x = x.reshape(-1, self.mean.shape[0]).to(self.mean)
        batch_mean, batch_var, n = x.mean(0), x.var(0, unbiased=False), x.shape[0]
        delta = batch_mean - self.mean
        total = self.count + n
        self.mean += delta * n / total
        m2 = self.var * self.count + batch_var * n + delta.pow(2) * self.count * n / total
        self.var.copy_(m2 / total)
        self.count.copy_(total)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """Normalize raw observations; float32 in, float32 out, clipped to +-OBS_CLIP."""
        mean = self.mean.to(obs.dtype)
        std = torch.sqrt(self.var + VAR_EPS).to(obs.dtype)
        return torch.clamp((obs - mean) / std, -OBS_CLIP, OBS_CLIP)


def mlp(sizes: Sequence[int], out_gain: float) -> nn.Sequential:
    """Tanh MLP with orthogonal init; `out_gain` scales the last layer."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        linear = nn.Linear(sizes[i], sizes[i + 1])
        last = i == len(sizes) - 2
        # Orthogonal init (as in PPO implementations): small output gain keeps
        # the initial policy near its mean and the value near 0.
        nn.init.orthogonal_(linear.weight, out_gain if last else np.sqrt(2))
        nn.init.zeros_(linear.bias)
        layers.append(linear)
        if not last:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def action_bounds(
    act_dim: int, action_low: Sequence[float] | float, action_high: Sequence[float] | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) float32[act_dim], a scalar bound broadcast to every action; ValueError unless low < high."""
    low = np.broadcast_to(np.asarray(action_low, np.float32), (act_dim,)).copy()
    high = np.broadcast_to(np.asarray(action_high, np.float32), (act_dim,)).copy()
    if not np.all(low < high):
        raise ValueError(f"action_low {low.tolist()} must be below action_high {high.tolist()}")
    return torch.as_tensor(low), torch.as_tensor(high)


def to_cpu(obj):
    """A (nested) state_dict with every tensor copied to the CPU: what checkpoints store."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def load_optimizer(optimizer: torch.optim.Optimizer, state: dict, lr: float) -> None:
    """Restore an optimizer's moments from a checkpoint, with the learning rate the config says now.

    torch's `load_state_dict` also restores the learning rate the checkpoint's writer had. A population
    search (pipeline/training/tune.py) restores one member's checkpoint under another member's perturbed
    config: keeping the checkpoint's rate there would silently undo the perturbation.
    """
    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        group["lr"] = lr


# What an off-policy learner reads of a replay minibatch (replay.py's n-step transitions and their draw's weights).
REPLAY_BATCH_KEYS = ("obs", "action", "reward", "next_obs", "discount", "weight")


def replay_batch_tensors(
    batch: dict[str, np.ndarray], obs_rms: RunningMeanStd, device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """(the minibatch as tensors on `device`, its normalized obs, its normalized next_obs), after `obs_rms` has
    merged the batch's raw observations (the learner is the only one that updates the statistics)."""
    t = {k: torch.as_tensor(batch[k], device=device) for k in REPLAY_BATCH_KEYS}
    obs_rms.update(t["obs"])
    return t, obs_rms(t["obs"]), obs_rms(t["next_obs"])
