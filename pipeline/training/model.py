"""The policy network: a Gaussian actor-critic MLP with its observation normalizer.

`ActorCritic` is what the learner trains and the rollout actors sample from.
`DeterministicPolicy` is the deployable slice of it (normalize -> mean -> clip)
that export turns into ONNX. `load_policy(run_dir)` rebuilds it from a run:
the best checkpoint by validation return when the run has one, else the latest.

With `history_length` H > 0 the network's input is the current observation
followed by the flattened history (shield.policy.HistoryBuffer's layout:
H rows of [obs, sent action], newest first), input_dim = obs_dim + H * (obs_dim + act_dim).
The learner and the normalizer see only that flat input; the deterministic
policy takes (obs, history) separately, as the ONNX graph does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

# Normalized observations are clipped to +-OBS_CLIP: a state far outside what
# training saw must not drive the network into a region it never fitted.
OBS_CLIP = 10.0
_VAR_EPS = 1e-8


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
        std = torch.sqrt(self.var + _VAR_EPS).to(obs.dtype)
        return torch.clamp((obs - mean) / std, -OBS_CLIP, OBS_CLIP)


def _mlp(sizes: Sequence[int], out_gain: float) -> nn.Sequential:
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


class ActorCritic(nn.Module):
    """MLP Gaussian policy with a state-independent log-std, plus a value head.

    Actions are in the env's (normalized) units; the distribution is unbounded
    and samples are clipped to [action_low, action_high] before the env, while
    the log-probability is that of the unclipped sample (standard for PPO/IMPALA).
    """

    def __init__(self, obs_dim: int, act_dim: int, hidden_sizes: Sequence[int] = (64, 64),
                 action_low: Sequence[float] | float = -1.0, action_high: Sequence[float] | float = 1.0,
                 log_std_init: float = -0.5, history_length: int = 0):
        super().__init__()
        self.obs_dim, self.act_dim, self.hidden_sizes = int(obs_dim), int(act_dim), [int(h) for h in hidden_sizes]
        self.history_length = int(history_length)
        self.input_dim = input_dim(self.obs_dim, self.act_dim, self.history_length)
        self.obs_rms = RunningMeanStd(self.input_dim)
        self.pi = _mlp([self.input_dim, *self.hidden_sizes, self.act_dim], out_gain=0.01)
        self.v = _mlp([self.input_dim, *self.hidden_sizes, 1], out_gain=1.0)
        self.log_std = nn.Parameter(torch.full((self.act_dim,), float(log_std_init)))
        low = torch.as_tensor(np.broadcast_to(np.asarray(action_low, np.float32), (self.act_dim,)).copy())
        high = torch.as_tensor(np.broadcast_to(np.asarray(action_high, np.float32), (self.act_dim,)).copy())
        if not torch.all(low < high):
            raise ValueError(f"action_low {low.tolist()} must be below action_high {high.tolist()}")
        self.register_buffer("action_low", low)
        self.register_buffer("action_high", high)

    def forward(self, obs_raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(action mean, log-std broadcast to the batch, value) for raw inputs `[..., input_dim]`."""
        x = self.obs_rms(obs_raw)
        mean = self.pi(x)
        return mean, self.log_std.expand_as(mean), self.v(x).squeeze(-1)

    def distribution(self, obs_raw: torch.Tensor) -> tuple[torch.distributions.Normal, torch.Tensor]:
        """(diagonal Gaussian over actions, value) for raw observations."""
        mean, log_std, value = self(obs_raw)
        return torch.distributions.Normal(mean, log_std.exp()), value

    def spec(self) -> dict:
        """Constructor arguments, as plain data (checkpoints store this)."""
        return dict(obs_dim=self.obs_dim, act_dim=self.act_dim, hidden_sizes=list(self.hidden_sizes),
                    action_low=self.action_low.tolist(), action_high=self.action_high.tolist(),
                    history_length=self.history_length)


def input_dim(obs_dim: int, act_dim: int, history_length: int) -> int:
    """Width of the network input: the observation plus H (observation, action) pairs."""
    return obs_dim + history_length * (obs_dim + act_dim)


class DeterministicPolicy(nn.Module):
    """(obs_raw float32[n, obs_dim] [, history float32[n, H, obs_dim + act_dim]]) -> action float32[n, act_dim].

    Normalize, mean head, clip. No data-dependent control flow, so
    `torch.onnx.export` with a dynamic batch axis captures normalization and
    clipping inside the graph. `obs_mean`/`obs_std` cover the whole flat input.
    """

    def __init__(self, actor_critic: ActorCritic):
        super().__init__()
        self.history_length = actor_critic.history_length
        self.pi = _mlp([actor_critic.input_dim, *actor_critic.hidden_sizes, actor_critic.act_dim], out_gain=0.01)
        self.pi.load_state_dict(actor_critic.pi.state_dict())
        # Normalizer precomputed in float32 so the exported graph holds no float64 ops.
        self.register_buffer("obs_mean", actor_critic.obs_rms.mean.float().clone())
        self.register_buffer("obs_std", torch.sqrt(actor_critic.obs_rms.var + _VAR_EPS).float().clone())
        self.register_buffer("action_low", actor_critic.action_low.clone())
        self.register_buffer("action_high", actor_critic.action_high.clone())
        self.obs_dim, self.act_dim = actor_critic.obs_dim, actor_critic.act_dim
        self.eval()

    def forward(self, obs_raw: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        if self.history_length:
            obs_raw = torch.cat([obs_raw, history.reshape(obs_raw.shape[0], -1)], dim=-1)
        x = torch.clamp((obs_raw - self.obs_mean) / self.obs_std, -OBS_CLIP, OBS_CLIP)
        return torch.maximum(torch.minimum(self.pi(x), self.action_high), self.action_low)


def load_policy(run_dir: str | Path, which: str = "selected") -> tuple[DeterministicPolicy, dict]:
    """Rebuild the deterministic policy from a run directory.

    which: "selected" (the best checkpoint by validation return when the run
    has one, else the latest), "best" or "latest". Returns (policy, meta) with
    meta = env_id, task, obs_dim, act_dim, action_low, action_high,
    history_length, config_hash, updates, env_steps, hidden_sizes, checkpoint,
    and `selection` (why this checkpoint) when it is the best one.
    """
    from pipeline.training.checkpoint import best_checkpoint, latest_checkpoint, read_checkpoint

    path = best_checkpoint(run_dir) if which in ("selected", "best") else None
    if path is None and which == "best":
        from pipeline.training.checkpoint import CheckpointError

        raise CheckpointError(f"{run_dir}: no best checkpoint (was validation enabled?)")
    path = path or latest_checkpoint(run_dir)
    ckpt = read_checkpoint(path)
    spec = ckpt["model_spec"]
    meta = dict(env_id=ckpt["env_id"], task=ckpt["task"], config_hash=ckpt["config_hash"],
                updates=int(ckpt["updates"]), env_steps=int(ckpt["env_steps"]), checkpoint=Path(path).name,
                **{"history_length": 0, **spec})
    if "selection" in ckpt:
        meta["selection"] = ckpt["selection"]
    if ckpt.get("algorithm") == "sac":  # tanh-squashed actor: its own deployable slice, same interface
        from pipeline.training.sac import policy_from_checkpoint

        return policy_from_checkpoint(ckpt), meta
    model = ActorCritic(**spec)
    model.load_state_dict(ckpt["model"])
    return DeterministicPolicy(model), meta
