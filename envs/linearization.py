"""Finite-difference linearization of a MuJoCo plant over one control period.

Used by the legacy LQR (envs) and by the shield's linear nominal model
(pipeline/shield_spec.py), so both are designed on the same model.
"""

from __future__ import annotations

import mujoco
import numpy as np


def linearize_control_step(nominal) -> tuple[np.ndarray, np.ndarray]:
    """Return (A, B) of one control period (ctrl held over the substeps) about the nominal equilibrium."""
    model = nominal.model
    data = mujoco.MjData(model)
    data.qpos[:] = nominal.qpos
    data.qvel[:] = nominal.qvel
    data.ctrl[:] = 0.0
    mujoco.mj_forward(model, data)
    nx = 2 * model.nv + model.na
    a1 = np.zeros((nx, nx))
    b1 = np.zeros((nx, model.nu))
    mujoco.mjd_transitionFD(model, data, 1e-6, True, a1, b1, None, None)
    # Zero-order hold over the substeps: x_{k+n} = A1^n x_k + (sum_i A1^i) B1 u.
    a, b = np.eye(nx), np.zeros_like(b1)
    for _ in range(nominal.substeps):
        b = a1 @ b + b1
        a = a1 @ a
    return a, b
