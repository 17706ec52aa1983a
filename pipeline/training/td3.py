"""TD3 (twin delayed DDPG) with n-step targets and prioritized-replay importance weights.

The actor is SAC's network (`SquashedGaussianActor`) acting on its mean only, a = tanh(mean(s)) in
normalized units, so actors, the replay and export (normalize -> mean -> tanh -> scale) are shared
with SAC. Exploration is the Ape-X actors' Gaussian noise.

One `update(batch)`:
  a'     = clip(pi'(s') + clip(N(0, policy_noise^2), +-noise_clip), -1, 1)    (target policy smoothing)
  y      = R^(n) + discount * min_k Q'_k(s', a')
  critic = sum_k mean_i w_i (Q_k(s_i, a_i) - y_i)^2 / 2     (w: importance weights of the draw)
  every policy_delay steps: actor = -mean_i Q_1(s_i, pi(s_i)); Polyak averaging (rate tau) of pi' and Q'.
  New priorities |Q_1 - y|.
"""

from __future__ import annotations

import copy
import time

import numpy as np
import torch

from pipeline.training.nets import load_optimizer, replay_batch_tensors, to_cpu
from pipeline.training.sac import SquashedGaussianActor, TwinCritic, replay_step_figures, twin_critic_step


def smoothed(action: torch.Tensor, noise: torch.Tensor, noise_clip: float) -> torch.Tensor:
    """Target policy smoothing: the target action plus noise clipped to +-noise_clip, kept in [-1, 1]."""
    return (action + noise.clamp(-noise_clip, noise_clip)).clamp(-1.0, 1.0)


class Td3Learner:
    """Deterministic actor and its target, twin critics and their targets, two Adam optimizers."""

    stochastic_actor = False  # exploring actors act on the mean plus their Ape-X noise

    def __init__(self, model_spec: dict, td3_cfg, gamma: float, device: torch.device):
        self.cfg, self.device, self.gamma = td3_cfg, device, gamma
        self.actor = SquashedGaussianActor(**model_spec).to(device)
        self.act_dim = self.actor.act_dim
        self.pi_target = copy.deepcopy(self.actor.pi).requires_grad_(False)
        obs_dim, act_dim, hidden = model_spec["obs_dim"], model_spec["act_dim"], model_spec["hidden_sizes"]
        self.critic = TwinCritic(obs_dim, act_dim, hidden).to(device)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.actor_optim = torch.optim.Adam(self.actor.pi.parameters(), lr=td3_cfg.lr)
        self.critic_optim = torch.optim.Adam(self.critic.parameters(), lr=td3_cfg.lr)
        self.version = 0
        self.actor_loss = 0.0

    def _act(self, pi: torch.nn.Module, obs_norm: torch.Tensor) -> torch.Tensor:
        return torch.tanh(pi(obs_norm)[..., : self.act_dim])

    def cpu_weights(self) -> dict[str, torch.Tensor]:
        """The actor's state_dict on the CPU (weights + normalizer): what actors, export and checkpoints take."""
        return to_cpu(self.actor.state_dict())

    def update(self, batch: dict[str, np.ndarray]) -> tuple[dict[str, float], np.ndarray]:
        """One critic step (and every policy_delay steps an actor step) on a prioritized batch; (stats, priorities)."""
        start = time.perf_counter()
        t, obs, next_obs = replay_batch_tensors(batch, self.actor.obs_rms, self.device)
        with torch.no_grad():
            next_action = smoothed(
                self._act(self.pi_target, next_obs),
                torch.randn_like(t["action"]) * self.cfg.policy_noise,
                self.cfg.noise_clip,
            )
            target = t["reward"] + t["discount"] * torch.minimum(*self.critic_target(next_obs, next_action))
        critic_loss, q1, td = twin_critic_step(self.critic, self.critic_optim, obs, t, target)

        self.version += 1
        if self.version % self.cfg.policy_delay == 0:
            actor_loss = -self.critic(obs, self._act(self.actor.pi, obs))[0].mean()
            self.actor_optim.zero_grad(set_to_none=True)
            actor_loss.backward()
            self.actor_optim.step()
            self.actor_loss = actor_loss.item()
            with torch.no_grad():
                for net, target_net in ((self.critic, self.critic_target), (self.actor.pi, self.pi_target)):
                    for p, p_t in zip(net.parameters(), target_net.parameters()):
                        p_t.lerp_(p, self.cfg.tau)
        priorities = td.detach().abs().cpu().numpy()
        stats = dict(
            critic_loss=critic_loss.item(),
            actor_loss=self.actor_loss,
            **replay_step_figures(q1, priorities, batch, start),
        )
        return stats, priorities

    def state_dict(self) -> dict:
        """Everything needed to continue exactly: networks, normalizer, targets, optimizers, version."""
        return dict(
            actor=self.cpu_weights(),
            pi_target=to_cpu(self.pi_target.state_dict()),
            critic=to_cpu(self.critic.state_dict()),
            critic_target=to_cpu(self.critic_target.state_dict()),
            actor_optim=to_cpu(self.actor_optim.state_dict()),
            critic_optim=to_cpu(self.critic_optim.state_dict()),
            version=self.version,
        )

    def load_state_dict(self, state: dict) -> None:
        self.actor.load_state_dict(state["actor"])
        self.pi_target.load_state_dict(state["pi_target"])
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        load_optimizer(self.actor_optim, state["actor_optim"], self.cfg.lr)
        load_optimizer(self.critic_optim, state["critic_optim"], self.cfg.lr)
        self.version = int(state["version"])
