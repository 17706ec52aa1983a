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
        # MuJoCo answers a simulation that blew up (a bad qpos, qvel or qacc) by resetting it to qpos0 and going on,
        # so the state stays finite while the episode has become nonsense: its warning counters (cleared by
        # mj_resetData) end the episode instead (`diverged`). Views into MjData, read in a tenth of a microsecond.
        self._instability = [
            self.data.warning[int(w)]
            for w in (
                mujoco.mjtWarning.mjWARN_BADQPOS,
                mujoco.mjtWarning.mjWARN_BADQVEL,
                mujoco.mjtWarning.mjWARN_BADQACC,
            )
        ]
        self.dt = control_period
        self.render_mode = render_mode
        self._renderer = None
        high = np.full(obs_dim, np.inf, dtype=np.float32)
        self.observation_space = gym.spaces.Box(-high, high, dtype=np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (act_dim,), dtype=np.float32)

    def diverged(self) -> bool:
        """True once MuJoCo has had to reset this episode's simulation (see `_load`)."""
        qpos, qvel, qacc = self._instability
        return bool(qpos.number or qvel.number or qacc.number)

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
