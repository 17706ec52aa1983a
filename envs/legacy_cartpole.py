"""The cart-pole's legacy controller: discrete LQR on the MuJoCo linearization of the nominal plant.

Set-point tracking shifts the state error by the set-point (obs 4): the
upright cart at rest anywhere on the rail is an equilibrium (the slider has
no spring), so u = -K (s - [x_ref, 0, 0, 0]) needs no feed-forward term.
"""

from __future__ import annotations

import numpy as np

from envs import cartpole_rail
from envs.linearization import discrete_lqr, linearize_control_step  # noqa: F401  (discrete_lqr re-exported)

# State and action weights (state = [x m, theta rad, x_dot m/s, theta_dot rad/s], action normalized).
LQR_Q = np.diag([20.0, 20.0, 0.5, 1.0])
LQR_R = np.array([[1.0]])


class CartPoleLqr:
    """LQR from the nominal model's linearization; batch policy obs float32[n, 5] -> float32[n, 1]."""

    name = "lqr"

    def __init__(self):
        a, b = linearize_control_step(cartpole_rail.nominal_model())
        self.gain = discrete_lqr(a, b, LQR_Q, LQR_R)  # (1, 4), normalized action per state unit

    def reset(self) -> None:
        """Nothing to clear: the LQR is static."""

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        obs = np.asarray(obs, dtype=np.float64)
        if obs.ndim == 1:
            obs = obs[None, :]
        err = obs[:, :4].copy()
        err[:, 0] -= obs[:, 4]
        return np.clip(-err @ self.gain.T, -1.0, 1.0).astype(np.float32)
