"""`sim2real/QuadrotorGeofence-v0`: fly through waypoints under wind gusts, inside a geofence, around a person.

Observation (float32[15]), stable layout (world frame, z up):

    index   quantity                                  unit
    0:3     position x, y, z                          m
    3:6     velocity                                  m/s
    6:9     current waypoint minus position           m
    9:12    body z axis in the world frame (tilt)     -
    12:15   body angular velocity                     rad/s

Action (float32[3]) in [-1, 1]: acceleration set-point [ax, ay, az] as a
fraction of MAX_ACCEL (4 m/s^2 per axis), gravity compensated inside. An inner
attitude/thrust loop (envs/quadrotor_inner_loop.py) turns it into four rotor
thrusts at the physics rate (200 Hz, 4 substeps per 0.02 s control step); the
achieved acceleration follows the set-point as a first-order lag with time
constant ACCEL_TIME_CONSTANT (s) on every axis, also when the set-point jumps.

Plant (envs/assets/quadrotor_geofence.xml): 1.0 kg, "+" layout with 0.15 m
arms, rotors of 6.2 N each (thrust-to-weight 2.5), yaw torque 0.016 N m per N,
motor lag 0.02 s. Wind gusts: a world force mass x w with |w_x|, |w_y| <=
1.0 m/s^2 and |w_z| <= 0.3 m/s^2 (a quarter of the acceleration authority),
drifting toward a new random gust with time constant 0.5 s.

Safety (info["cost"] = 1.0 when any is violated by the true state): stay
inside the geofence box |x|, |y| <= 4 m, 0 <= z <= 3.5 m; stay above the
altitude floor z >= 0.5 m; stay out of the 1.0 m cylinder around the person
standing at the origin. Four waypoints per episode, in |x|, |y| <= 3 m,
1.0 <= z <= 2.5 m, at least 1.8 m from the person; a waypoint counts as
reached within 0.3 m, then the next one is shown (the last one stays).
`gymnasium.make(ENV_ID, wind_scale=0.0)` flies in calm air (wind_scale scales WIND_MAX).
Reward per step: 1 (alive) - 0.8 min(d, 5 m) / 5 m (d: distance to the
waypoint) + 5 x (progress toward it, m) + 5 per waypoint reached - 0.01 |a|^2
- 0.5 (if a constraint is violated). The legacy PID earns ~850 per episode,
holding its start position ~450. 1000 steps (20 s);
the episode terminates on a crash (z < 0.1 m), a flip, or |x|, |y|, z > 6 m.
"""

from __future__ import annotations

from pathlib import Path

import mujoco
import numpy as np

from envs.mujoco_task import MujocoTaskEnv
from envs.quadrotor_inner_loop import AttitudeThrustLoop
from envs.safety import constraint_values, cost_of

ENV_ID = "sim2real/QuadrotorGeofence-v0"
TASK_NAME = "quadrotor"
ASSET_PATH = Path(__file__).parent / "assets" / "quadrotor_geofence.xml"

CONTROL_PERIOD = 0.02  # s
SUBSTEPS = 4  # inner-loop/physics steps of 0.005 s per control step
EPISODE_STEPS = 1000
OBS_DIM = 15
ACT_DIM = 3
MAX_ACCEL = (4.0, 4.0, 4.0)  # m/s^2 per unit action, per axis
# s, first-order lag of the achieved acceleration behind the set-point, the same on every axis (the inner
# loop's set-point smoothing makes it so), measured as the velocity ramp's lag after a step
# (tests/envs/test_envs_quadrotor.py). The shield predicts with it.
ACCEL_TIME_CONSTANT = 0.15


def io_names() -> dict:
    """Names, sources and units of the observation and action vectors (the module docstring's table)."""
    xyz = ("x", "y", "z")
    obs = [(f"p{a}", "position", "m") for a in xyz] + [(f"v{a}", "velocity", "m/s") for a in xyz]
    obs += [(f"waypoint_d{a}", "current waypoint minus position", "m") for a in xyz]
    obs += [(f"tilt_{a}", "body z axis in the world frame", "1") for a in xyz]
    obs += [(f"w{a}", "body angular velocity", "rad/s") for a in xyz]
    return {
        "observations": [{"name": n, "source": s, "unit": u} for n, s, u in obs],
        "actions": [
            {
                "name": f"a{a}",
                "source": "acceleration set-point (gravity compensated)",
                "unit": "m/s^2",
                "units_per_action": scale,
            }
            for a, scale in zip(xyz, MAX_ACCEL)
        ],
    }


ARM = 0.15  # m
YAW_COEFF = 0.016  # N m of yaw torque per N of thrust
MAX_ROTOR_THRUST = 6.2  # N
FENCE_XY = 4.0  # m
CEILING = 3.5  # m
FLOOR = 0.5  # m
PERSON_XY = (0.0, 0.0)  # m
KEEPOUT_RADIUS = 1.0  # m
WAYPOINTS = 4
WAYPOINT_XY = 3.0  # m
WAYPOINT_Z = (1.0, 2.5)  # m
WAYPOINT_CLEARANCE = 1.8  # m from the person
REACH_RADIUS = 0.3  # m
WIND_MAX = (1.0, 1.0, 0.3)  # m/s^2
WIND_TIME_CONSTANT = 0.5  # s
WIND_CHANGE_PROBABILITY = 0.02  # per control step

SAFETY = {
    "kinematics": {"position_index": [0, 1, 2], "velocity_index": [3, 4, 5]},
    "constraints": [
        {
            "name": "geofence",
            "type": "box",
            "index": [0, 1, 2],
            "low": [-FENCE_XY, -FENCE_XY, 0.0],
            "high": [FENCE_XY, FENCE_XY, CEILING],
        },
        {"name": "altitude_floor", "type": "halfspace", "a": [0.0, 0.0, -1.0] + [0.0] * (OBS_DIM - 3), "b": -FLOOR},
        {
            "name": "person_keepout",
            "type": "cylinder",
            "index": [0, 1],
            "center": list(PERSON_XY),
            "radius": KEEPOUT_RADIUS,
        },
    ],
}


class QuadrotorGeofenceEnv(MujocoTaskEnv):
    """Quadrotor with a built-in attitude/thrust loop flying waypoints; see the module docstring."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": int(round(1 / CONTROL_PERIOD))}

    def __init__(self, render_mode: str | None = None, wind_scale: float = 1.0):
        """wind_scale multiplies the gusts' bounds WIND_MAX (0 = calm air)."""
        if not wind_scale >= 0.0:
            raise ValueError(f"wind_scale must be >= 0, got {wind_scale!r}")
        self._load(ASSET_PATH, OBS_DIM, ACT_DIM, CONTROL_PERIOD, render_mode)
        body = mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_BODY, "quad")
        self._body = body
        # Nominal mass/inertia, read once: the inner loop does not learn a randomized plant.
        self.nominal_mass = float(self.model.body_subtreemass[body])
        self.loop = AttitudeThrustLoop(
            self.nominal_mass,
            self.model.body_inertia[body].copy(),
            ARM,
            YAW_COEFF,
            MAX_ROTOR_THRUST,
            float(self.model.opt.timestep),
        )
        self._accel_scale = np.asarray(MAX_ACCEL)
        self._wind_max = np.asarray(WIND_MAX) * float(wind_scale)
        self.wind = np.zeros(3)
        self._gust = np.zeros(3)
        self.waypoints = np.zeros((WAYPOINTS, 3))
        self.waypoint_index = 0
        self.reached_count = 0

    # -- episode setup ---------------------------------------------------------------------
    def _clear_point(self, rng, z_range) -> np.ndarray:
        while True:
            p = np.array([*rng.uniform(-WAYPOINT_XY, WAYPOINT_XY, 2), rng.uniform(*z_range)])
            if np.hypot(p[0] - PERSON_XY[0], p[1] - PERSON_XY[1]) >= WAYPOINT_CLEARANCE:
                return p

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        rng = self.np_random
        mujoco.mj_resetData(self.model, self.data)
        start = self._clear_point(rng, WAYPOINT_Z)
        self.data.qpos[:3] = start
        self.data.qpos[3:7] = (1.0, 0.0, 0.0, 0.0)
        hover = self.nominal_mass * 9.81 / 4
        self.data.ctrl[:] = hover
        self.data.act[:] = hover
        previous = start
        for i in range(WAYPOINTS):
            while True:
                w = self._clear_point(rng, WAYPOINT_Z)
                if 2.0 <= np.linalg.norm(w - previous) <= 5.0:
                    break
            self.waypoints[i] = previous = w
        self.waypoint_index = 0
        self.reached_count = 0
        self.wind[:] = 0.0
        self._gust = rng.uniform(-1.0, 1.0, 3) * self._wind_max
        self.loop.reset()
        mujoco.mj_forward(self.model, self.data)
        obs = self._obs()
        return obs, {
            "cost": self._cost(obs),
            "constraint_values": self._constraint_values,
            "domain": {},
            "waypoints_reached": 0,
        }

    # -- dynamics ----------------------------------------------------------------------------
    def _obs(self) -> np.ndarray:
        d = self.data
        d.mocap_pos[0] = self.waypoints[self.waypoint_index]  # the visual marker only
        rot = d.xmat[self._body].reshape(3, 3)
        pos = d.qpos[:3]
        return np.concatenate(
            (pos, d.qvel[:3], self.waypoints[self.waypoint_index] - pos, rot[:, 2], d.qvel[3:6])
        ).astype(np.float32)

    def _cost(self, obs) -> float:
        # Evaluated on the true (noise-free) observation, so cost == "some SAFETY constraint violated".
        self._constraint_values = constraint_values(SAFETY, obs)
        return cost_of(self._constraint_values)

    def _update_wind(self) -> None:
        rng = self.np_random
        if rng.random() < WIND_CHANGE_PROBABILITY:
            self._gust = rng.uniform(-1.0, 1.0, 3) * self._wind_max
        self.wind += (self._gust - self.wind) * (CONTROL_PERIOD / WIND_TIME_CONSTANT)
        # Free-joint translational dofs take world-frame forces; pushes use xfrc_applied, not this.
        self.data.qfrc_applied[:3] = self.nominal_mass * self.wind

    def step(self, action):
        a = np.clip(np.asarray(action, dtype=np.float64).reshape(ACT_DIM), -1.0, 1.0)
        d, m = self.data, self.model
        before = float(np.linalg.norm(self.waypoints[self.waypoint_index] - d.qpos[:3]))
        self._update_wind()
        self.loop.set_acceleration(a * self._accel_scale)
        xmat, qvel, body = d.xmat, d.qvel, self._body
        for _ in range(SUBSTEPS):
            d.ctrl[:] = self.loop.rotor_thrusts(xmat[body].tolist(), qvel[3:6].tolist())
            mujoco.mj_step(m, d)
        pos = d.qpos[:3]
        after = float(np.linalg.norm(self.waypoints[self.waypoint_index] - pos))
        obs = self._obs()
        cost = self._cost(obs)
        # The current waypoint is reached once (reached_count == index + 1 afterward); the last one stays shown.
        reached = after < REACH_RADIUS and self.reached_count == self.waypoint_index
        if reached:
            self.reached_count += 1
            if self.waypoint_index < WAYPOINTS - 1:
                self.waypoint_index += 1
                obs = self._obs()
        # Survival dominates (a safe step far away still earns ~0.2), so ending an episode early never
        # pays; the distance term and the waypoint bonus separate flying the route from hovering.
        reward = (
            1.0
            - 0.8 * min(after, 5.0) / 5.0
            + 5.0 * (before - after)
            + 5.0 * reached
            - 0.01 * float(a @ a)
            - 0.5 * cost
        )
        upright = d.xmat[self._body][8]
        terminated = bool(
            pos[2] < 0.1
            or upright < 0.0
            or abs(pos[0]) > 6
            or abs(pos[1]) > 6
            or pos[2] > 6
            or not np.all(np.isfinite(pos))
        )
        info = {"cost": cost, "constraint_values": self._constraint_values, "waypoints_reached": self.reached_count}
        if self.diverged():
            terminated = info["diverged"] = True
        return obs, reward, terminated, False, info
