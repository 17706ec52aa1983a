"""What the project's MuJoCo tasks share: loading the MJCF, the spaces, offscreen rendering."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import mujoco
import numpy as np


class MujocoTaskEnv(gym.Env):
    """Base of the tasks: float32 observations, normalized Box(-1, 1) actions, `rgb_array` rendering."""

    def _load(self, asset: Path, obs_dim: int, act_dim: int, control_period: float, render_mode: str | None) -> None:
        """Compile the MJCF and set the spaces; control_period in s."""
        self.model = mujoco.MjModel.from_xml_path(str(asset))
        self.data = mujoco.MjData(self.model)
        self.dt = control_period
        self.render_mode = render_mode
        self._renderer = None
        high = np.full(obs_dim, np.inf, dtype=np.float32)
        self.observation_space = gym.spaces.Box(-high, high, dtype=np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (act_dim,), dtype=np.float32)

    def render(self):
        """Return an RGB frame (uint8[480, 640, 3]) when render_mode is "rgb_array" (MUJOCO_GL=osmesa or egl)."""
        if self.render_mode != "rgb_array":
            return None
        if self._renderer is None:
            self._renderer = mujoco.Renderer(self.model, 480, 640)
        self._renderer.update_scene(self.data)
        return self._renderer.render()

    def close(self):
        """Free the offscreen renderer, if one was made."""
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
