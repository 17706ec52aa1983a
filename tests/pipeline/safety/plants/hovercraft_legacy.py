"""The hovercraft's legacy controller: a PD on position as a desired force, the heading steered toward it (kept in
the heading box) and the thrust its projection on the heading. Observation: x, y, psi, vx, vy, wz, nose_x, nose_y,
x_ref, y_ref; action: thrust, yaw torque, normalized."""

import numpy as np


class HeadingPD:
    name = "heading_pd"

    def reset(self):
        pass

    def __call__(self, obs):
        obs = np.asarray(obs, dtype=np.float64).reshape(-1, 10)
        x, y, psi, vx, vy, wz, _, _, xr, yr = obs.T
        fx, fy = 1.2 * (xr - x) - 1.5 * vx, 1.2 * (yr - y) - 1.5 * vy
        thrust = fx * np.cos(psi) + fy * np.sin(psi)
        want = np.clip(np.mod(np.arctan2(fy, fx), np.pi), 0.35, 1.22)
        want = np.where(np.hypot(fx, fy) > 0.05, want, psi)
        torque = want - psi - 0.25 * wz
        return np.clip(np.stack([thrust, torque], axis=1), -1.0, 1.0).astype(np.float32)


def make():
    return HeadingPD()
