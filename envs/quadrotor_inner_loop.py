"""The quadrotor's built-in inner loop: acceleration set-point -> attitude and thrust -> four rotor thrusts.

Runs at the physics rate (200 Hz). It knows only the NOMINAL mass and inertia,
as a real autopilot would, so randomized plants show up as tracking error.
Geometric attitude control on SO(3) (Lee, Leok, McClamroch 2010) with yaw
held at 0; the "+" mixer maps [thrust N, roll/pitch/yaw torque N m] to rotors.
"""

from __future__ import annotations

import math

import numpy as np

GRAVITY = 9.81  # m/s^2
MAX_TILT = math.radians(35.0)  # rad, the attitude set-point never leans further
MIN_THRUST_FRACTION = 0.2  # of the hover thrust, so the attitude stays controllable when diving
ATTITUDE_NATURAL_FREQ = 18.0  # rad/s
ATTITUDE_DAMPING = 0.9


class AttitudeThrustLoop:
    """Turns a world acceleration set-point (m/s^2, gravity excluded) into rotor thrusts (N)."""

    def __init__(self, mass: float, inertia: np.ndarray, arm: float, yaw_coeff: float, max_thrust: float):
        self.mass = mass
        self.inertia = np.asarray(inertia, dtype=np.float64)  # principal, kg m^2
        self.max_thrust = max_thrust
        self.k_r = ATTITUDE_NATURAL_FREQ**2
        self.k_w = 2.0 * ATTITUDE_DAMPING * ATTITUDE_NATURAL_FREQ
        # Rows: total thrust, roll torque (about x), pitch torque (about y), yaw torque; rotors at +x, +y, -x, -y.
        mix = np.array([
            [1.0, 1.0, 1.0, 1.0],
            [0.0, arm, 0.0, -arm],
            [-arm, 0.0, arm, 0.0],
            [-yaw_coeff, yaw_coeff, -yaw_coeff, yaw_coeff],
        ])
        self.unmix = np.linalg.inv(mix)
        self.force = np.array([0.0, 0.0, mass * GRAVITY])
        self.rot_des = np.eye(3)

    def set_acceleration(self, accel) -> None:
        """Hold a new world acceleration set-point (m/s^2) until the next call: computes the attitude set-point."""
        # Plain floats: this runs every control step and numpy's small-array overhead dominates here.
        fx, fy, fz = (self.mass * float(accel[0]), self.mass * float(accel[1]),
                      self.mass * (float(accel[2]) + GRAVITY))
        fz = max(fz, MIN_THRUST_FRACTION * self.mass * GRAVITY)
        horizontal = math.hypot(fx, fy)
        limit = fz * math.tan(MAX_TILT)
        if horizontal > limit:
            fx, fy = fx * limit / horizontal, fy * limit / horizontal
        self.force = np.array((fx, fy, fz))
        norm = math.sqrt(fx * fx + fy * fy + fz * fz)
        zx, zy, zz = fx / norm, fy / norm, fz / norm
        # y = z x (1, 0, 0) normalized (yaw held at 0); x = y x z.
        yx, yy, yz = 0.0, zz, -zy
        n = math.hypot(yy, yz)
        yy, yz = yy / n, yz / n
        xx, xy, xz = yy * zz - yz * zy, yz * zx - yx * zz, yx * zy - yy * zx
        self.rot_des = np.array(((xx, yx, zx), (xy, yy, zy), (xz, yz, zz)))

    def rotor_thrusts(self, rot: np.ndarray, omega: np.ndarray) -> np.ndarray:
        """Rotor thrusts (N) from the body rotation matrix (body to world) and body angular velocity (rad/s)."""
        m = self.rot_des.T @ rot
        e_r = 0.5 * np.array((m[2, 1] - m[1, 2], m[0, 2] - m[2, 0], m[1, 0] - m[0, 1]))
        torque = self.inertia * (-self.k_r * e_r - self.k_w * omega)
        thrust = float(self.force @ rot[:, 2])
        rotors = self.unmix @ np.array((thrust, torque[0], torque[1], torque[2]))
        return np.minimum(np.maximum(rotors, 0.0), self.max_thrust)
