"""Offscreen rendering shared by the project's MuJoCo tasks (MUJOCO_GL=osmesa or egl)."""

from __future__ import annotations

import mujoco


class OffscreenRender:
    """`render()`/`close()` for an env holding `model`, `data`, `render_mode` and `_renderer` (None until first use)."""

    def render(self):
        """Return an RGB frame (uint8[480, 640, 3]) when render_mode is "rgb_array"."""
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
