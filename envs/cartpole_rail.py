"""`sim2real/CartPoleRail-v0`: balance a pole while the cart tracks a moving set-point on a finite rail.

Observation (float32[5]), stable layout:

    index  quantity                          unit    MuJoCo state
    0      cart position x                   m       qpos[0]
    1      pole angle theta (0 = upright,    rad     qpos[1]
           positive tips the pole toward +x)
    2      cart velocity x_dot               m/s     qvel[0]
    3      pole angular velocity theta_dot   rad/s   qvel[1]
    4      set-point x_ref                   m       (exogenous)

Action (float32[1]) in [-1, 1]: cart force as a fraction of MAX_FORCE (30 N).

Plant (envs/assets/cartpole_rail.xml): cart 1.0 kg, pole 0.1 kg and 1.0 m long
(uniform capsule), rail stops at +-1.2 m (slider joint range), motor back-EMF
as 10 N s/m slider damping, so the cart's terminal speed is 3 m/s.
Braking authority for the safety shield: from the terminal speed 3 m/s under
full reverse force the cart stops within
m/c * (v0 - F/c * ln(1 + c v0 / F)) = 0.11 * (3 - 3 ln 2) = 0.10 m
(0.17 m even without the damping's help: v0^2 / (2 F / m)), inside the
0.2 m between the safe band (|x| <= X_SAFE = 1.0 m) and the stops.

Task: the set-point x_ref ramps at SETPOINT_SPEED (0.5 m/s) toward targets
drawn uniformly in [-0.85, 0.85] m (near the band's ends included), each held
for 2.0-3.0 s. Control period 0.02 s (4 physics steps of 5 ms), 500 steps.
Reward per step, in [-1.5, 1]: 1 (alive) - 0.5 min(|x - x_ref|, 1)
- 0.01 a^2 - 1 (if outside the safe band). The episode terminates when
|theta| > THETA_LIMIT (0.6 rad). info["cost"] is 1.0 when |x| > X_SAFE
(true state), else 0.0.
"""

from __future__ import annotations

from pathlib import Path

import mujoco
import numpy as np

from envs.linearization import NominalModel
from envs.mujoco_task import MujocoTaskEnv
from envs.safety import violated_constraints

ENV_ID = "sim2real/CartPoleRail-v0"
TASK_NAME = "cartpole"
ASSET_PATH = Path(__file__).parent / "assets" / "cartpole_rail.xml"

CONTROL_PERIOD = 0.02  # s
SUBSTEPS = 4  # physics steps of 0.005 s per control step
EPISODE_STEPS = 500
MAX_FORCE = 30.0  # N, actuator gear for a unit action
CART_MASS = 1.0  # kg
POLE_MASS = 0.1  # kg
POLE_LENGTH = 1.0  # m
RAIL_STOP = 1.2  # m, slider joint range
X_SAFE = 1.0  # m, safe band half-width
THETA_LIMIT = 0.6  # rad, the pole counts as fallen beyond this
SETPOINT_RANGE = 0.85  # m, targets are drawn in [-SETPOINT_RANGE, SETPOINT_RANGE]
SETPOINT_SPEED = 0.5  # m/s, how fast the observed set-point ramps to its target
SETPOINT_HOLD_S = (2.0, 3.0)  # s, how long each target is held
OBS_DIM = 5
ACT_DIM = 1

SAFETY = {
    "kinematics": {"position_index": [0], "velocity_index": [2]},
    "constraints": [
        {"name": "rail_band", "type": "box", "index": [0], "low": [-X_SAFE], "high": [X_SAFE]},
    ],
}


def nominal_model() -> NominalModel:
    """Return a fresh nominal MjModel with the upright equilibrium and the obs-to-state map."""
    model = mujoco.MjModel.from_xml_path(str(ASSET_PATH))
    return NominalModel(
        model=model,
        qpos=np.zeros(model.nq),
        qvel=np.zeros(model.nv),
        substeps=SUBSTEPS,
        obs_to_state={0: ("qpos", 0), 1: ("qpos", 1), 2: ("qvel", 0), 3: ("qvel", 1)},
    )


class CartPoleRailEnv(MujocoTaskEnv):
    """Cart-pole on a finite rail tracking a moving set-point; see the module docstring."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": int(round(1 / CONTROL_PERIOD))}

    def __init__(self, render_mode: str | None = None):
        self._load(ASSET_PATH, OBS_DIM, ACT_DIM, CONTROL_PERIOD, render_mode)
        self._setpoint = 0.0
        self._target = 0.0
        self._hold_left = 0

    def _new_target(self) -> None:
        rng = self.np_random
        self._target = float(rng.uniform(-SETPOINT_RANGE, SETPOINT_RANGE))
        lo, hi = SETPOINT_HOLD_S
        self._hold_left = int(rng.integers(round(lo / CONTROL_PERIOD), round(hi / CONTROL_PERIOD) + 1))

    def _obs(self) -> np.ndarray:
        q, v = self.data.qpos, self.data.qvel
        return np.array([q[0], q[1], v[0], v[1], self._setpoint], dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        rng = self.np_random
        mujoco.mj_resetData(self.model, self.data)
        self.data.qpos[0] = rng.uniform(-0.2, 0.2)
        self.data.qpos[1] = rng.uniform(-0.05, 0.05)
        self.data.qvel[:] = rng.uniform(-0.05, 0.05, size=2)
        mujoco.mj_forward(self.model, self.data)
        self._setpoint = 0.0
        self._new_target()
        return self._obs(), {"cost": self._cost(), "domain": {}}

    def _cost(self) -> float:
        # The one constraint definition (shield.constraints via envs.safety), on the true state.
        return 1.0 if violated_constraints(SAFETY, self._obs()) else 0.0

    def step(self, action):
        a = min(max(float(np.asarray(action, dtype=np.float64).reshape(-1)[0]), -1.0), 1.0)
        self.data.ctrl[0] = a
        mujoco.mj_step(self.model, self.data, nstep=SUBSTEPS)
        # Ramp the observed set-point toward the current target, then maybe draw the next target.
        ramp = SETPOINT_SPEED * CONTROL_PERIOD
        self._setpoint += min(max(self._target - self._setpoint, -ramp), ramp)
        self._hold_left -= 1
        if self._hold_left <= 0:
            self._new_target()
        x, theta = float(self.data.qpos[0]), float(self.data.qpos[1])
        cost = self._cost()
        reward = 1.0 - 0.5 * min(abs(x - self._setpoint), 1.0) - 0.01 * a * a - cost
        terminated = bool(abs(theta) > THETA_LIMIT or not np.isfinite(x))
        return self._obs(), reward, terminated, False, {"cost": cost}
