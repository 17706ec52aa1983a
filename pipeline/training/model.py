"""The policy network: a Gaussian actor-critic MLP with its observation normalizer.

`ActorCritic` is what the learner trains and the rollout actors sample from.
`DeterministicPolicy` is the deployable slice of it (normalize -> mean -> clip)
that export turns into ONNX (`policy_from_checkpoint`; pipeline/training/policy.py
picks the checkpoint).

With `history_length` H > 0 the network's input is the current observation
followed by the flattened history (shield.policy.HistoryBuffer's layout:
H rows of [obs, sent action], newest first), input_dim = obs_dim + H * (obs_dim + act_dim).
The learner and the normalizer see only that flat input; the deterministic
policy takes (obs, history) separately, as the ONNX graph does.

With `estimates` (an adaptive student's: `envs.wrappers.domain_encoding` of the
train ranges, [name, low, high, log scale] each) a third head reads the same
input and regresses the episode's domain parameters, encoded to [-1, 1]; the
deterministic policy decodes them to physical values (`plant_estimate`), which
the edge exposes so an operator sees which plant the policy believes it is on.
The head shares no weights with the policy: training it leaves the actions as
they were.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from pipeline.training.nets import OBS_CLIP, VAR_EPS, RunningMeanStd, action_bounds, mlp


class ActorCritic(nn.Module):
    """MLP Gaussian policy with a state-independent log-std, plus a value head.

    Actions are in the env's (normalized) units; the distribution is unbounded
    and samples are clipped to [action_low, action_high] before the env, while
    the log-probability is that of the unclipped sample (standard for PPO/IMPALA).
    """

    def __init__(
        self,
        obs_dim: int,
        act_dim: int,
        hidden_sizes: Sequence[int] = (64, 64),
        action_low: Sequence[float] | float = -1.0,
        action_high: Sequence[float] | float = 1.0,
        log_std_init: float = -0.5,
        history_length: int = 0,
        estimates: Sequence[Sequence] | None = None,
    ):
        super().__init__()
        self.obs_dim, self.act_dim, self.hidden_sizes = int(obs_dim), int(act_dim), [int(h) for h in hidden_sizes]
        self.history_length = int(history_length)
        self.input_dim = input_dim(self.obs_dim, self.act_dim, self.history_length)
        self.obs_rms = RunningMeanStd(self.input_dim)
        self.pi = mlp([self.input_dim, *self.hidden_sizes, self.act_dim], out_gain=0.01)
        self.v = mlp([self.input_dim, *self.hidden_sizes, 1], out_gain=1.0)
        self.log_std = nn.Parameter(torch.full((self.act_dim,), float(log_std_init)))
        self.estimates = [[str(n), float(lo), float(hi), bool(log)] for n, lo, hi, log in (estimates or ())]
        # out_gain 1: the targets fill [-1, 1], unlike the near-zero initial action mean.
        self.estimate = mlp([self.input_dim, *self.hidden_sizes, len(self.estimates)], 1.0) if self.estimates else None
        low, high = action_bounds(self.act_dim, action_low, action_high)
        self.register_buffer("action_low", low)
        self.register_buffer("action_high", high)

    def forward(self, obs_raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(action mean, log-std broadcast to the batch, value) for raw inputs `[..., input_dim]`."""
        x = self.obs_rms(obs_raw)
        mean = self.pi(x)
        return mean, self.log_std.expand_as(mean), self.v(x).squeeze(-1)

    def encoded_estimate(self, obs_raw: torch.Tensor) -> torch.Tensor:
        """The estimate head's domain parameters, encoded to [-1, 1] (`encode_domain`), for raw inputs."""
        return self.mean_and_estimate(obs_raw)[1]

    def mean_and_estimate(self, obs_raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(action mean, encoded estimate) for raw inputs, both heads read from one normalization of them
        (distillation trains the two together on every minibatch)."""
        if self.estimate is None:
            raise ValueError("this network has no estimate head (built without `estimates`)")
        x = self.obs_rms(obs_raw)
        return self.pi(x), self.estimate(x)

    def distribution(self, obs_raw: torch.Tensor) -> tuple[torch.distributions.Normal, torch.Tensor]:
        """(diagonal Gaussian over actions, value) for raw observations."""
        mean, log_std, value = self(obs_raw)
        return torch.distributions.Normal(mean, log_std.exp()), value

    def spec(self) -> dict:
        """Constructor arguments, as plain data (checkpoints store this)."""
        return dict(
            obs_dim=self.obs_dim,
            act_dim=self.act_dim,
            hidden_sizes=list(self.hidden_sizes),
            action_low=self.action_low.tolist(),
            action_high=self.action_high.tolist(),
            history_length=self.history_length,
            **({"estimates": [list(e) for e in self.estimates]} if self.estimates else {}),
        )


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
        self.pi = mlp([actor_critic.input_dim, *actor_critic.hidden_sizes, actor_critic.act_dim], out_gain=0.01)
        self.pi.load_state_dict(actor_critic.pi.state_dict())
        # Normalizer precomputed in float32 so the exported graph holds no float64 ops.
        self.register_buffer("obs_mean", actor_critic.obs_rms.mean.float().clone())
        self.register_buffer("obs_std", torch.sqrt(actor_critic.obs_rms.var + VAR_EPS).float().clone())
        self.register_buffer("action_low", actor_critic.action_low.clone())
        self.register_buffer("action_high", actor_critic.action_high.clone())
        self.obs_dim, self.act_dim = actor_critic.obs_dim, actor_critic.act_dim
        self.estimates = [list(e) for e in actor_critic.estimates]
        self.estimate_head = None
        if actor_critic.estimate is not None:
            self.estimate_head = mlp([actor_critic.input_dim, *actor_critic.hidden_sizes, len(self.estimates)], 1.0)
            self.estimate_head.load_state_dict(actor_critic.estimate.state_dict())
            # Decoding [-1, 1] back to the range, in log space for log-uniform parameters (encode_domain's inverse).
            low = torch.tensor([math.log(lo) if log else lo for _, lo, _, log in self.estimates], dtype=torch.float32)
            high = torch.tensor([math.log(hi) if log else hi for _, _, hi, log in self.estimates], dtype=torch.float32)
            self.register_buffer("estimate_low", low)
            self.register_buffer("estimate_half_width", (high - low) / 2)
            self.register_buffer("estimate_log", torch.tensor([bool(e[3]) for e in self.estimates]))
            # truth ~ offset + scale * head (encoded), fitted on fresh episodes (pipeline/training/adaptive.py);
            # identity until `recalibrate_estimate`.
            self.register_buffer("estimate_offset", torch.zeros(len(self.estimates)))
            self.register_buffer("estimate_scale", torch.ones(len(self.estimates)))
        self.eval()

    def _normalized(self, obs_raw: torch.Tensor, history: torch.Tensor | None) -> torch.Tensor:
        if self.history_length:
            obs_raw = torch.cat([obs_raw, history.reshape(obs_raw.shape[0], -1)], dim=-1)
        return torch.clamp((obs_raw - self.obs_mean) / self.obs_std, -OBS_CLIP, OBS_CLIP)

    def forward(self, obs_raw: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        x = self._normalized(obs_raw, history)
        return torch.maximum(torch.minimum(self.pi(x), self.action_high), self.action_low)

    def recalibrate_estimate(self, offset, scale) -> None:
        """Set the estimate's recalibration (encoded units, one (offset, scale) per parameter)."""
        self.estimate_offset.copy_(torch.as_tensor(offset, dtype=torch.float32))
        self.estimate_scale.copy_(torch.as_tensor(scale, dtype=torch.float32))

    def plant_estimate(self, obs_raw: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """float32[n, P]: the domain parameters this input suggests, in physical units (scales of nominal,
        latency in control steps), each clipped to its train range: the policy knows no plant outside it."""
        if self.estimate_head is None:
            raise ValueError("this policy has no estimate head")
        raw = torch.clamp(self.estimate_head(self._normalized(obs_raw, history)), -1.0, 1.0)
        encoded = torch.clamp(self.estimate_offset + self.estimate_scale * raw, -1.0, 1.0)
        value = self.estimate_low + (encoded + 1.0) * self.estimate_half_width
        return torch.where(self.estimate_log, torch.exp(value), value)


def policy_from_checkpoint(ckpt: dict) -> DeterministicPolicy:
    """The deployable policy of an IMPALA / APPO checkpoint (its `model` weights and `model_spec`)."""
    model = ActorCritic(**ckpt["model_spec"])
    model.load_state_dict(ckpt["model"])
    return DeterministicPolicy(model)
