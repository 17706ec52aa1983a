"""The quadrotor's built-in inner loop: acceleration set-point -> attitude and thrust -> four rotor thrusts.

Runs at the physics rate (200 Hz). It knows only the NOMINAL mass and inertia,
as a real autopilot would, so randomized plants show up as tracking error.
Geometric attitude control on SO(3) (Lee, Leok, McClamroch 2010) with yaw
held at 0; the "+" mixer maps [thrust N, roll/pitch/yaw torque N m] to rotors.

Two parts keep the achieved acceleration a first-order lag of the set-point on
every axis, the model the shield predicts with (`ACCEL_TIME_CONSTANT` in
envs/quadrotor_geofence.py), even when the set-point jumps every step:

- The force set-point is smoothed at the physics rate, the collective (vertical)
  part slower than the tilt (horizontal) part, so the thrust never changes faster
  than the attitude can follow. Without it a set-point that flips from diving to
  climbing while the attitude still leans the old way multiplied the thrust along
  the old tilt: 6-10 m/s^2 sideways against the model's 4.8 (flipping set-points
  took the shielded plant past its geofence in 33 of 200 corner episodes).
- The mixer keeps the collective thrust, scales roll/pitch torque to fit the
  rotors' range, and gives yaw only the room left (yaw is the least authority and
  the least needed: PX4's mixer does the same). Clipping each rotor on its own let a
  yaw correction zero both rotors of an axis and take that axis's attitude control.
"""

from __future__ import annotations

import math

import numpy as np

GRAVITY = 9.81  # m/s^2
# rad, the attitude set-point never leans further. 45 deg keeps the whole action box reachable:
# at az = -4 m/s^2 the horizontal authority is tan(45 deg) (g - 4) = 5.8 >= 4 sqrt(2) m/s^2.
MAX_TILT = math.radians(45.0)
MIN_THRUST_FRACTION = 0.2  # of the hover thrust, so the attitude stays controllable when diving
ATTITUDE_NATURAL_FREQ = 18.0  # rad/s
ATTITUDE_DAMPING = 0.9
# s, first-order smoothing of the force set-point's horizontal and vertical parts. The attitude loop adds
# ~0.09 s to the horizontal response and the motors ~0.02 s to the vertical one: 0.06 and 0.13 give both
# ~0.15 s (measured by tests/envs/test_envs_quadrotor.py against ACCEL_TIME_CONSTANT).
SETPOINT_TIME_CONSTANT_XY = 0.06
SETPOINT_TIME_CONSTANT_Z = 0.13


class AttitudeThrustLoop:
    """Turns a world acceleration set-point (m/s^2, gravity excluded) into rotor thrusts (N)."""

    def __init__(self, mass: float, inertia: np.ndarray, arm: float, yaw_coeff: float, max_thrust: float, dt: float):
        """`dt`: s between `rotor_thrusts` calls (the physics step): the set-point smoothing's step."""
        self.mass = mass
        self._alpha_xy = 1.0 - math.exp(-dt / SETPOINT_TIME_CONSTANT_XY)
        self._alpha_z = 1.0 - math.exp(-dt / SETPOINT_TIME_CONSTANT_Z)
        self.inertia = np.asarray(inertia, dtype=np.float64)  # principal, kg m^2
        self.max_thrust = max_thrust
        self.k_r = ATTITUDE_NATURAL_FREQ**2
        self.k_w = 2.0 * ATTITUDE_DAMPING * ATTITUDE_NATURAL_FREQ
        # Rows: total thrust, roll torque (about x), pitch torque (about y), yaw torque; rotors at +x, +y, -x, -y.
        mix = np.array(
            [
                [1.0, 1.0, 1.0, 1.0],
                [0.0, arm, 0.0, -arm],
                [-arm, 0.0, arm, 0.0],
                [-yaw_coeff, yaw_coeff, -yaw_coeff, yaw_coeff],
            ]
        )
        self.unmix = np.linalg.inv(mix)
        self._unmix_rows = [tuple(float(v) for v in row) for row in self.unmix]
        self._inertia_flat = tuple(float(v) for v in self.inertia)
        self.reset()

    def reset(self, accel=(0.0, 0.0, 0.0)) -> None:
        """Hold `accel` (m/s^2) with the smoothing settled on it (a new episode: the plant hovers)."""
        self.set_acceleration(accel)
        self._set_force(*self._target)

    def set_acceleration(self, accel) -> None:
        """Hold a new world acceleration set-point (m/s^2) until the next call; the force set-point moves toward it."""
        # Plain floats: this runs every control step and numpy's small-array overhead dominates here.
        fx, fy, fz = (self.mass * float(accel[0]), self.mass * float(accel[1]), self.mass * (float(accel[2]) + GRAVITY))
        fz = max(fz, MIN_THRUST_FRACTION * self.mass * GRAVITY)
        horizontal = math.hypot(fx, fy)
        limit = fz * math.tan(MAX_TILT)
        if horizontal > limit:
            fx, fy = fx * limit / horizontal, fy * limit / horizontal
        self._target = (fx, fy, fz)  # inside the tilt cone, as is every point between two such (it is convex)

    def _set_force(self, fx: float, fy: float, fz: float) -> None:
        """The force set-point (N) and the attitude that points the thrust along it."""
        self._force_flat = (fx, fy, fz)
        norm = math.sqrt(fx * fx + fy * fy + fz * fz)
        zx, zy, zz = fx / norm, fy / norm, fz / norm
        # y = z x (1, 0, 0) normalized (yaw held at 0); x = y x z.
        yx, yy, yz = 0.0, zz, -zy
        n = math.hypot(yy, yz)
        yy, yz = yy / n, yz / n
        xx, xy, xz = yy * zz - yz * zy, yz * zx - yx * zz, yx * zy - yy * zx
        self._rot_des_flat = (xx, yx, zx, xy, yy, zy, xz, yz, zz)

    def rotor_thrusts(self, rot, omega) -> list[float]:
        """Rotor thrusts (N) from the body rotation matrix (body to world, 9 floats row-major) and body rates (rad/s).

        One physics step: the force set-point moves one step toward the held target first."""
        # Plain floats: four calls per control step, where numpy's per-call overhead would dominate.
        (fx, fy, fz), (tx_, ty_, tz_) = self._force_flat, self._target
        a, az = self._alpha_xy, self._alpha_z
        self._set_force(fx + a * (tx_ - fx), fy + a * (ty_ - fy), fz + az * (tz_ - fz))
        r00, r01, r02, r10, r11, r12, r20, r21, r22 = rot
        d00, d01, d02, d10, d11, d12, d20, d21, d22 = self._rot_des_flat
        # e_R = vee(Rd^T R - R^T Rd) / 2, from the antisymmetric part of M = Rd^T R.
        m01 = d00 * r01 + d10 * r11 + d20 * r21
        m02 = d00 * r02 + d10 * r12 + d20 * r22
        m10 = d01 * r00 + d11 * r10 + d21 * r20
        m12 = d01 * r02 + d11 * r12 + d21 * r22
        m20 = d02 * r00 + d12 * r10 + d22 * r20
        m21 = d02 * r01 + d12 * r11 + d22 * r21
        wx, wy, wz = omega
        jx, jy, jz = self._inertia_flat
        kr, kw = self.k_r, self.k_w
        tx = jx * (-kr * 0.5 * (m21 - m12) - kw * wx)
        ty = jy * (-kr * 0.5 * (m02 - m20) - kw * wy)
        tz = jz * (-kr * 0.5 * (m10 - m01) - kw * wz)
        fx, fy, fz = self._force_flat
        top = self.max_thrust
        thrust = fx * r02 + fy * r12 + fz * r22  # the set-point force along the current body z axis
        thrust = 0.0 if thrust < 0.0 else (4.0 * top if thrust > 4.0 * top else thrust)
        rows = self._unmix_rows
        base = [u0 * thrust for u0, _, _, _ in rows]
        tilt = [u1 * tx + u2 * ty for _, u1, u2, _ in rows]
        s = _fit(base, tilt, top)
        mid = [b + s * d for b, d in zip(base, tilt)]
        yaw = [u3 * tz for _, _, _, u3 in rows]
        s = _fit(mid, yaw, top)
        return [min(max(m + s * d, 0.0), top) for m, d in zip(mid, yaw)]  # the clamp only absorbs rounding


def _fit(base: list[float], delta: list[float], top: float) -> float:
    """The largest s in [0, 1] with every base + s delta inside [0, top] (base is inside already)."""
    s = 1.0
    for b, d in zip(base, delta):
        if b + d < 0.0:
            s = min(s, max(b, 0.0) / -d)
        elif b + d > top:
            s = min(s, max(top - b, 0.0) / d)
    return s
