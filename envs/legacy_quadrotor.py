"""The quadrotor's legacy controller: cascaded PID (position -> velocity -> acceleration set-point).

Its waypoint path respects the safety constraints on a nominal plant: when the
straight line to the waypoint passes near the person, it flies to a via-point
on a circle of AVOID_RADIUS around them instead (recomputed every step, so it
slides around the person), and its targets are clamped inside the geofence
and above the altitude floor with margins. Speeds are capped, so overshoot
stays well inside those margins.
"""

from __future__ import annotations

import numpy as np

from envs import quadrotor_geofence as task

POSITION_GAIN = 1.2  # 1/s
VELOCITY_GAIN = 3.0  # 1/s
VELOCITY_INTEGRAL_GAIN = 1.0  # 1/s^2
INTEGRAL_LIMIT = 1.5  # m/s^2 of accumulated correction
MAX_SPEED_XY = 1.5  # m/s
MAX_SPEED_Z = 0.8  # m/s
AVOID_RADIUS = task.KEEPOUT_RADIUS + 0.6  # m, paths closer than this to the person detour
VIA_RADIUS = task.KEEPOUT_RADIUS + 1.0  # m, radius of the detour's via-points
TARGET_XY_LIMIT = task.FENCE_XY - 0.8  # m
TARGET_Z_LIMITS = (task.FLOOR + 0.5, task.CEILING - 0.7)  # m


def detour_targets(pos: np.ndarray, waypoint: np.ndarray) -> np.ndarray:
    """Per row, the waypoint, or a via-point around the person when the straight path passes too close (m)."""
    center = np.asarray(task.PERSON_XY)
    p, w = pos[:, :2], waypoint[:, :2]
    d = w - p
    length2 = np.maximum(np.einsum("ij,ij->i", d, d), 1e-9)
    t = np.clip(np.einsum("ij,ij->i", center - p, d) / length2, 0.0, 1.0)
    closest = p + t[:, None] * d
    away = closest - center
    dist = np.linalg.norm(away, axis=1)
    # A path straight through the centre: go around on the left of the direction of travel.
    left = np.stack((-d[:, 1], d[:, 0]), axis=1) / np.sqrt(length2)[:, None]
    direction = np.where(dist[:, None] > 1e-6, away / np.maximum(dist, 1e-6)[:, None], left)
    targets = waypoint.copy()
    blocked = dist < AVOID_RADIUS
    targets[blocked, :2] = center + VIA_RADIUS * direction[blocked]
    return targets


class QuadrotorCascadedPid:
    """Cascaded PID; batch policy obs float32[n, 15] -> normalized acceleration float32[n, 3]."""

    name = "cascaded_pid"

    def __init__(self, dt: float = task.CONTROL_PERIOD):
        self.dt = dt
        self._integral: np.ndarray | None = None
        self._scale = np.asarray(task.MAX_ACCEL)

    def reset(self) -> None:
        """Clear the velocity-loop integrators."""
        self._integral = None

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        obs = np.asarray(obs, dtype=np.float64)
        if obs.ndim == 1:
            obs = obs[None, :]
        pos, vel = obs[:, 0:3], obs[:, 3:6]
        target = detour_targets(pos, pos + obs[:, 6:9])
        target[:, :2] = np.clip(target[:, :2], -TARGET_XY_LIMIT, TARGET_XY_LIMIT)
        target[:, 2] = np.clip(target[:, 2], *TARGET_Z_LIMITS)
        v_des = POSITION_GAIN * (target - pos)
        speed_xy = np.linalg.norm(v_des[:, :2], axis=1, keepdims=True)
        v_des[:, :2] *= np.minimum(1.0, MAX_SPEED_XY / np.maximum(speed_xy, 1e-9))
        v_des[:, 2] = np.clip(v_des[:, 2], -MAX_SPEED_Z, MAX_SPEED_Z)
        err = v_des - vel
        if self._integral is None or self._integral.shape != err.shape:
            self._integral = np.zeros_like(err)
        self._integral = np.clip(
            self._integral + VELOCITY_INTEGRAL_GAIN * err * self.dt, -INTEGRAL_LIMIT, INTEGRAL_LIMIT
        )
        accel = VELOCITY_GAIN * err + self._integral
        return np.clip(accel / self._scale, -1.0, 1.0).astype(np.float32)
