"""The CBF shield in simulation: a gymnasium wrapper running the same `CbfShield` as the edge box.

Wrap outermost (around the randomization, noise and latency wrappers) so the
shield sees what the edge box would see: noisy observations, delayed actuation.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from shield.cbf import CbfShield
from shield.spec import ShieldSpec


class ShieldedEnv(gym.Wrapper):
    """Filters every action through a CbfShield; `info["shield"]` carries the shield's info.

    With `intervention_penalty` > 0 the reward is reduced by that much on each
    step the shield changed the action, so a policy trained in the loop learns
    to stay clear of the boundaries instead of leaning on the shield.
    """

    def __init__(self, env: gym.Env, spec: ShieldSpec | dict, *, intervention_penalty: float = 0.0):
        super().__init__(env)
        self.shield = CbfShield(spec)
        spec_dims = (self.shield.spec.obs_dim, self.shield.spec.act_dim)
        env_dims = (env.observation_space.shape[0], env.action_space.shape[0])
        if spec_dims != env_dims:
            raise ValueError(f"shield spec is for (obs_dim, act_dim) {spec_dims}, the env has {env_dims}")
        self.intervention_penalty = float(intervention_penalty)
        self._obs: np.ndarray | None = None

    def reset(self, **kwargs) -> tuple[np.ndarray, dict[str, Any]]:
        """Reset the env and the shield's pending-action memory."""
        obs, info = self.env.reset(**kwargs)
        self.shield.reset()
        self._obs = np.asarray(obs, np.float32)
        return obs, info

    def step(self, action):
        """Send the shielded action; the reward carries the intervention penalty."""
        if self._obs is None:
            raise RuntimeError("ShieldedEnv.step called before reset")
        safe, sinfo = self.shield.filter(self._obs, np.asarray(action, np.float32))
        obs, reward, terminated, truncated, info = self.env.step(safe)
        info = dict(info)
        info["shield"] = sinfo
        info["shield_action"] = safe
        if sinfo["intervened"]:
            reward = float(reward) - self.intervention_penalty
        self._obs = np.asarray(obs, np.float32)
        return obs, reward, terminated, truncated, info
