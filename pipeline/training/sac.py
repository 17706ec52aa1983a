"""Soft actor-critic with n-step targets and prioritized-replay importance weights.

Networks work in normalized action units a in [-1, 1] (a tanh-squashed Gaussian);
the env receives low + (a + 1) (high - low) / 2. Observations pass through a
running normalizer (the same `RunningMeanStd` as the on-policy model), updated
by the learner from the observations it samples and shipped to the actors with
the weights.

One `update(batch)`:
  y      = R^(n) + discount * (min_k Q'_k(s', a') - temperature * log pi(a'|s')),  a' ~ pi(.|s')
           (discount = gamma^n, or 0 when the episode terminated inside the n steps)
  critic = sum_k mean_i w_i (Q_k(s_i, a_i) - y_i)^2 / 2     (w: importance weights of the draw)
  actor  = mean_i temperature * log pi(a~|s_i) - min_k Q_k(s_i, a~),  a~ ~ pi(.|s_i)
  temperature: log alpha follows -(log pi + target_entropy)
  targets: Polyak averaging with rate tau; new priorities |Q_1 - y|.

`SacDeterministicPolicy` is what export ships: normalize -> mean -> tanh -> scale,
with the same `obs_mean` / `obs_std` buffers as the on-policy `DeterministicPolicy`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from pipeline.training.nets import (
    OBS_CLIP,
    VAR_EPS,
    RunningMeanStd,
    action_bounds,
    load_optimizer,
    mlp,
    replay_batch_tensors,
    to_cpu,
)

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


class SquashedGaussianActor(nn.Module):
    """Raw observation -> tanh-squashed Gaussian over normalized actions; owns the obs normalizer."""

    def __init__(
        self,
        obs_dim: int,
        act_dim: int,
        hidden_sizes: Sequence[int] = (64, 64),
        action_low: Sequence[float] | float = -1.0,
        action_high: Sequence[float] | float = 1.0,
    ):
        super().__init__()
        self.obs_dim, self.act_dim, self.hidden_sizes = int(obs_dim), int(act_dim), [int(h) for h in hidden_sizes]
        self.obs_rms = RunningMeanStd(self.obs_dim)
        self.pi = mlp([self.obs_dim, *self.hidden_sizes, 2 * self.act_dim], out_gain=0.01)  # mean, log-std
        low, high = action_bounds(self.act_dim, action_low, action_high)
        self.register_buffer("action_low", low)
        self.register_buffer("action_high", high)

    def normalize(self, obs_raw: torch.Tensor) -> torch.Tensor:
        return self.obs_rms(obs_raw)

    def sample(
        self, obs_norm: torch.Tensor, generator: torch.Generator | None = None, deterministic: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(action in [-1, 1], log-probability of it) for normalized observations (reparameterized)."""
        mean, log_std = self.pi(obs_norm).split(self.act_dim, dim=-1)
        if deterministic:
            return torch.tanh(mean), torch.zeros(mean.shape[:-1], device=mean.device)
        log_std = torch.clamp(log_std, LOG_STD_MIN, LOG_STD_MAX)
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        u = mean + log_std.exp() * noise
        action = torch.tanh(u)
        # log N(u) - sum log(1 - tanh(u)^2), the latter written stably as 2 (log 2 - u - softplus(-2u)).
        logp = (-0.5 * noise.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        logp = logp - (2 * (math.log(2) - u - nn.functional.softplus(-2 * u))).sum(-1)
        return action, logp

    def to_env(self, action: np.ndarray) -> np.ndarray:
        """Normalized action in [-1, 1] -> env units."""
        low, high = self.action_low.cpu().numpy(), self.action_high.cpu().numpy()
        return low + (np.clip(action, -1.0, 1.0) + 1.0) * 0.5 * (high - low)


class TwinCritic(nn.Module):
    """Two Q networks of (normalized observation, normalized action), evaluated together:
    each layer is one batched matmul over a leading axis of 2 (half the kernel launches of two MLPs)."""

    def __init__(self, obs_dim: int, act_dim: int, hidden_sizes: Sequence[int]):
        super().__init__()
        sizes = [obs_dim + act_dim, *hidden_sizes, 1]
        self.weights, self.biases = nn.ParameterList(), nn.ParameterList()
        for i in range(len(sizes) - 1):
            weight = torch.empty(2, sizes[i + 1], sizes[i])
            for k in range(2):  # the same init as `mlp`, per network
                nn.init.orthogonal_(weight[k], 1.0 if i == len(sizes) - 2 else np.sqrt(2))
            self.weights.append(nn.Parameter(weight.transpose(1, 2).contiguous()))
            self.biases.append(nn.Parameter(torch.zeros(2, 1, sizes[i + 1])))

    def forward(self, obs_norm: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([obs_norm, action], dim=-1).expand(2, -1, -1)
        for i, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            x = torch.baddbmm(bias, x, weight)
            if i < len(self.weights) - 1:
                x = torch.tanh(x)
        return x[0, :, 0], x[1, :, 0]


class SacDeterministicPolicy(nn.Module):
    """obs_raw float32[n, obs_dim] -> action float32[n, act_dim]: normalize, mean, tanh, scale to the bounds."""

    def __init__(self, actor: SquashedGaussianActor):
        super().__init__()
        self.pi = mlp([actor.obs_dim, *actor.hidden_sizes, 2 * actor.act_dim], out_gain=0.01)
        self.pi.load_state_dict(actor.pi.state_dict())
        self.register_buffer("obs_mean", actor.obs_rms.mean.float().clone())
        self.register_buffer("obs_std", torch.sqrt(actor.obs_rms.var + VAR_EPS).float().clone())
        self.register_buffer("action_mid", ((actor.action_high + actor.action_low) / 2).float().clone())
        self.register_buffer("action_half", ((actor.action_high - actor.action_low) / 2).float().clone())
        self.obs_dim, self.act_dim = actor.obs_dim, actor.act_dim
        self.eval()

    def forward(self, obs_raw: torch.Tensor) -> torch.Tensor:
        x = torch.clamp((obs_raw - self.obs_mean) / self.obs_std, -OBS_CLIP, OBS_CLIP)
        return self.action_mid + self.action_half * torch.tanh(self.pi(x)[..., : self.act_dim])


def policy_from_checkpoint(ckpt: dict) -> SacDeterministicPolicy:
    """The deployable policy of a checkpoint of a squashed-Gaussian actor (SAC's; TD3 acts on its mean too)."""
    actor = SquashedGaussianActor(**ckpt["model_spec"])
    actor.load_state_dict(ckpt["model"])
    return SacDeterministicPolicy(actor)


def soft_target(
    reward: torch.Tensor,
    discount: torch.Tensor,
    q1_next: torch.Tensor,
    q2_next: torch.Tensor,
    next_logp: torch.Tensor,
    temperature: torch.Tensor,
) -> torch.Tensor:
    """y = R^(n) + discount * (min(Q'_1, Q'_2)(s', a') - temperature * log pi(a'|s'))."""
    return reward + discount * (torch.minimum(q1_next, q2_next) - temperature * next_logp)


def twin_critic_loss(q1: torch.Tensor, q2: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """mean_i w_i ((Q_1 - y)^2 + (Q_2 - y)^2) / 2, w the draw's importance weights."""
    return 0.5 * (weight * ((q1 - target).pow(2) + (q2 - target).pow(2))).mean()


def twin_critic_step(
    critic: TwinCritic,
    optim: torch.optim.Optimizer,
    obs: torch.Tensor,
    t: dict[str, torch.Tensor],
    target: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One optimizer step of the twin critics toward `target` on the minibatch `t` (its actions and importance
    weights); (critic loss, Q_1, TD error Q_1 - y, whose magnitude is the transitions' new priority)."""
    q1, q2 = critic(obs, t["action"])
    critic_loss = twin_critic_loss(q1, q2, target, t["weight"])
    optim.zero_grad(set_to_none=True)
    critic_loss.backward()
    optim.step()
    return critic_loss, q1, q1 - target


def replay_step_figures(q1: torch.Tensor, priorities: np.ndarray, batch: dict[str, np.ndarray], start: float) -> dict:
    """The figures every off-policy step reports: mean Q_1, mean |TD|, mean importance weight, the step's time (s)."""
    return dict(
        q_mean=q1.detach().mean().item(),
        td_abs_mean=float(priorities.mean()),
        is_weight_mean=float(batch["weight"].mean()),
        learner_s=time.perf_counter() - start,
    )


def soft_actor_loss(
    logp: torch.Tensor, q1_pi: torch.Tensor, q2_pi: torch.Tensor, temperature: torch.Tensor
) -> torch.Tensor:
    """mean_i temperature * log pi(a~|s_i) - min(Q_1, Q_2)(s_i, a~)."""
    return (temperature * logp - torch.minimum(q1_pi, q2_pi)).mean()


def temperature_loss(log_temperature: torch.Tensor, logp: torch.Tensor, target_entropy: float) -> torch.Tensor:
    """-log alpha * mean(log pi + target_entropy): alpha falls while the entropy (-log pi) is above its target."""
    return -(log_temperature * (logp + target_entropy)).mean()


class SacLearner:
    """Actor, twin critics, their targets, the temperature and three Adam optimizers."""

    stochastic_actor = True  # exploring actors sample the policy (plus their Ape-X noise)

    def __init__(self, model_spec: dict, sac_cfg, gamma: float, device: torch.device):
        self.cfg, self.device, self.gamma = sac_cfg, device, gamma
        self.actor = SquashedGaussianActor(**model_spec).to(device)
        obs_dim, act_dim, hidden = model_spec["obs_dim"], model_spec["act_dim"], model_spec["hidden_sizes"]
        self.critic = TwinCritic(obs_dim, act_dim, hidden).to(device)
        self.critic_target = TwinCritic(obs_dim, act_dim, hidden).to(device)
        self.critic_target.load_state_dict(self.critic.state_dict())
        self.critic_target.requires_grad_(False)
        self.log_temperature = torch.tensor(math.log(sac_cfg.init_temperature), device=device, requires_grad=True)
        self.target_entropy = -float(act_dim) if sac_cfg.target_entropy is None else float(sac_cfg.target_entropy)
        self.actor_optim = torch.optim.Adam(self.actor.pi.parameters(), lr=sac_cfg.lr)
        self.critic_optim = torch.optim.Adam(self.critic.parameters(), lr=sac_cfg.lr)
        self.temperature_optim = torch.optim.Adam([self.log_temperature], lr=sac_cfg.lr)
        self.version = 0

    def cpu_weights(self) -> dict[str, torch.Tensor]:
        """The actor's state_dict on the CPU (weights + normalizer): what actors, export and checkpoints take."""
        return to_cpu(self.actor.state_dict())

    def update(self, batch: dict[str, np.ndarray]) -> tuple[dict[str, float], np.ndarray]:
        """One gradient step on a prioritized batch (with `weight`); returns (stats, new |TD| priorities)."""
        start = time.perf_counter()
        t, obs, next_obs = replay_batch_tensors(batch, self.actor.obs_rms, self.device)
        temperature = self.log_temperature.exp().detach()

        # One actor pass for s and s': the s' half feeds the target without gradients.
        both_action, both_logp = self.actor.sample(torch.cat([obs, next_obs]))
        n = obs.shape[0]
        action, logp = both_action[:n], both_logp[:n]
        with torch.no_grad():
            next_action, next_logp = both_action[n:].detach(), both_logp[n:].detach()
            target = soft_target(
                t["reward"], t["discount"], *self.critic_target(next_obs, next_action), next_logp, temperature
            )
        critic_loss, q1, td = twin_critic_step(self.critic, self.critic_optim, obs, t, target)

        actor_loss = soft_actor_loss(logp, *self.critic(obs, action), temperature)
        self.actor_optim.zero_grad(set_to_none=True)
        actor_loss.backward()
        self.actor_optim.step()

        temp_loss = temperature_loss(self.log_temperature, logp.detach(), self.target_entropy)
        self.temperature_optim.zero_grad(set_to_none=True)
        temp_loss.backward()
        self.temperature_optim.step()

        with torch.no_grad():
            for p, p_t in zip(self.critic.parameters(), self.critic_target.parameters()):
                p_t.lerp_(p, self.cfg.tau)
        self.version += 1
        priorities = td.detach().abs().cpu().numpy()
        stats = dict(
            critic_loss=critic_loss.item(),
            actor_loss=actor_loss.item(),
            temperature=float(temperature),
            entropy=-logp.detach().mean().item(),
            **replay_step_figures(q1, priorities, batch, start),
        )
        return stats, priorities

    def state_dict(self) -> dict:
        """Everything needed to continue exactly: networks, normalizer, targets, temperature, optimizers, version."""
        return dict(
            actor=self.cpu_weights(),
            critic=to_cpu(self.critic.state_dict()),
            critic_target=to_cpu(self.critic_target.state_dict()),
            log_temperature=self.log_temperature.detach().cpu().clone(),
            actor_optim=to_cpu(self.actor_optim.state_dict()),
            critic_optim=to_cpu(self.critic_optim.state_dict()),
            temperature_optim=to_cpu(self.temperature_optim.state_dict()),
            version=self.version,
        )

    def load_state_dict(self, state: dict) -> None:
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        with torch.no_grad():
            self.log_temperature.copy_(state["log_temperature"])
        load_optimizer(self.actor_optim, state["actor_optim"], self.cfg.lr)
        load_optimizer(self.critic_optim, state["critic_optim"], self.cfg.lr)
        load_optimizer(self.temperature_optim, state["temperature_optim"], self.cfg.lr)
        self.version = int(state["version"])
