"""The MuJoCo twin as calibration sees it: scales in, open-loop multi-step predictions out.

Parameters are the positive scales a RandomizationSet uses, by element name
(`body_mass.cart`, `actuator_gain.cart_force`, `gravity_scale`, ...). A model
with given scales is built through envs' public API (a fixed randomization set,
low == high, then a reset applies it), so calibration writes parameters exactly
the way training samples them. Replay is `mujoco.rollout` (C, batched): one call
predicts every log window at once.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import mujoco
import numpy as np
from mujoco import rollout

from envs.declared_env import unlimited_angles
from envs.domain import DomainRandomizer
from envs.randomization import SCALE_GROUPS, parse_randomization, sample_domain
from pipeline.calibration.logs import CalibrationError

PHYSICAL_GROUPS = SCALE_GROUPS  # the groups a calibration fits: every per-element scale a set may randomize


def put_range(rset: dict, name: str, entry: dict) -> None:
    """Set parameter `name` (`group.element` or `gravity_scale`) of a set dict (YAML format) to `entry`."""
    if name == "gravity_scale":
        rset["gravity_scale"] = entry
    else:
        group, element = name.split(".", 1)
        rset.setdefault(group, {})[element] = entry


def fixed_set(scales: dict[str, float], latency: int | None = None, like=None) -> dict:
    """A RandomizationSet dict (YAML format) whose every range is the single given scale.

    latency: whole control steps (fixed); like: a RandomizationSet whose noise and
    pushes are copied (a simulated plant with a fixed body and a realistic gap).
    """
    out: dict = {}
    for name, s in scales.items():
        put_range(out, name, {"low": float(s), "high": float(s)})
    if latency is not None:
        out["latency_steps"] = {"low": int(latency), "high": int(latency)}
    if like is not None:
        out.update(obs_noise_std=list(like.obs_noise_std), action_noise_std=list(like.action_noise_std))
        if like.push is not None:
            out["push"] = like.push.model_dump()
    return out


def task_facts(env_id: str) -> dict:
    """The task's row (obs_dim, act_dim, control_period_s, ...), registered from a file after import too."""
    import envs

    try:
        return envs.task(env_id).describe()
    except envs.UnknownTaskError:
        raise CalibrationError(f"task.env_id {env_id!r}: not a known task") from None


class Twin:
    """The task's plant with chosen scales; predicts observations from logged states and actions.

    Needs the task to expose `nominal_model()` with `obs_to_state` (obs index ->
    qpos/qvel index) and `substeps`: the cart-pole does; a task whose
    observation is not its MuJoCo state (the quadrotor) cannot be replayed.
    """

    CACHE = 64  # models kept (least squares re-evaluates the same points)

    def __init__(self, env_id: str):
        import envs

        spec = envs.task(env_id)
        if spec.shield_model["type"] != "linear":
            raise CalibrationError(
                f"task {env_id}: calibration replays each logged state through the twin, which needs a plant "
                f"declared as data (plant: in the YAML, a linear shield_model, observations read from named joints); "
                f"this task is coded in Python (the shipped quadrotor is) and its observation is not its MuJoCo "
                f"state, so its logs cannot be fitted. Its randomization ranges stay as configured"
            )
        nominal = spec.nominal_model()
        self.env_id = env_id
        self.substeps = int(nominal.substeps)
        self.obs_to_state = dict(nominal.obs_to_state)
        self.state_obs = sorted(self.obs_to_state)  # obs indices the twin predicts
        self.derived = dict(getattr(nominal, "derived", None) or {})  # sites and sensors, computed from the state
        self._models: OrderedDict = OrderedDict()
        self._nominal: mujoco.MjModel | None = None
        base = self.model({})
        self._data = mujoco.MjData(base)
        self._spec = mujoco.mjtState.mjSTATE_FULLPHYSICS
        self._qpos0 = mujoco.mj_stateSize(base, mujoco.mjtState.mjSTATE_TIME)
        self._qvel0 = self._qpos0 + base.nq
        self.nu = base.nu
        # The logged actions drive the MJCF's actuators as the env applies them: the declaration's actuators,
        # each at its ctrl per unit action (an MJCF may list its actuators in another order, or have more).
        self._actuators = None if nominal.actuators is None else list(nominal.actuators)
        self._ctrl_per_action = (
            None if nominal.ctrl_per_action is None else np.asarray(nominal.ctrl_per_action, np.float64)
        )

    def action_box(self) -> tuple[np.ndarray, np.ndarray]:
        """The box the plant applies a logged action in (the declared env clips each action to [-1, 1])."""
        m = len(self._actuators) if self._actuators is not None else self.nu
        return -np.ones(m), np.ones(m)

    def position_limits(self) -> dict[int, tuple[float, float, str]]:
        """Observation index -> (low, high, joint name) of each observed position of a hinge or slide with a range."""
        base = self.model({})
        out = {}
        for o, (kind, adr) in self.obs_to_state.items():
            if kind != "qpos":
                continue
            for j in range(base.njnt):
                simple = int(base.jnt_type[j]) in (mujoco.mjtJoint.mjJNT_HINGE, mujoco.mjtJoint.mjJNT_SLIDE)
                if simple and int(base.jnt_qposadr[j]) == adr and base.jnt_limited[j]:
                    lo, hi = (float(v) for v in base.jnt_range[j])
                    out[o] = (lo, hi, mujoco.mj_id2name(base, mujoco.mjtObj.mjOBJ_JOINT, j) or f"joint {j}")
        return out

    def unlimited_angles(self) -> list[int]:
        """Observation indices of the positions of hinges without a range (they turn without limit): the declared
        env observes them wrapped, the twin predicts them as MuJoCo integrates them."""
        base = self.model({})
        return [o for o, _ in unlimited_angles(base, self.obs_to_state, base.qpos0)]

    def derived_observations(self, obs: np.ndarray) -> dict[int, np.ndarray]:
        """Per site or sensor observation, its value on the nominal plant at each logged state (n, obs_dim), where
        the logged joints are the whole state it depends on: every hinge and slide observed in position and
        velocity, and a sensor read before the accelerations (a force or an accelerometer needs the plant's
        parameters and the action). {} when that is not so."""
        base = self.model({})
        simple = (mujoco.mjtJoint.mjJNT_HINGE, mujoco.mjtJoint.mjJNT_SLIDE)
        if not self.derived or any(int(t) not in simple for t in base.jnt_type):
            return {}
        observed = set(self.obs_to_state.values())
        for j in range(base.njnt):
            if ("qpos", int(base.jnt_qposadr[j])) not in observed or ("qvel", int(base.jnt_dofadr[j])) not in observed:
                return {}
        sensor_at = {
            int(base.sensor_adr[s]) + k: s for s in range(base.nsensor) for k in range(int(base.sensor_dim[s]))
        }
        chosen = {}
        for o, src in self.derived.items():
            if src[0] == "site" or int(base.sensor_needstage[sensor_at[src[1]]]) <= int(mujoco.mjtStage.mjSTAGE_VEL):
                chosen[o] = src
        if not chosen:
            return {}
        states = self.initial_states(obs)
        out = {o: np.empty(len(obs)) for o in chosen}
        for i, state in enumerate(states):
            mujoco.mj_setState(base, self._data, state, self._spec)
            mujoco.mj_forward(base, self._data)
            for o, src in chosen.items():
                out[o][i] = self._data.site_xpos[src[1], src[2]] if src[0] == "site" else self._data.sensordata[src[1]]
        return out

    def joint_is_hinge(self, name: str) -> bool:
        """Whether the joint named `name` turns (a hinge: its position an angle) rather than slides."""
        base = self.model({})
        j = mujoco.mj_name2id(base, mujoco.mjtObj.mjOBJ_JOINT, name)
        return j >= 0 and int(base.jnt_type[j]) == mujoco.mjtJoint.mjJNT_HINGE

    def velocity_pairs(self) -> list[tuple[int, int, str]]:
        """(position obs index, velocity obs index, joint name) of each hinge or slide observed both ways."""
        base = self.model({})
        obs_of = {state: o for o, state in self.obs_to_state.items()}
        out = []
        for j in range(base.njnt):
            if int(base.jnt_type[j]) not in (mujoco.mjtJoint.mjJNT_HINGE, mujoco.mjtJoint.mjJNT_SLIDE):
                continue
            pos, vel = obs_of.get(("qpos", int(base.jnt_qposadr[j]))), obs_of.get(("qvel", int(base.jnt_dofadr[j])))
            if pos is not None and vel is not None:
                out.append((pos, vel, mujoco.mj_id2name(base, mujoco.mjtObj.mjOBJ_JOINT, j) or f"joint {j}"))
        return out

    def model(self, scales: dict[str, float]) -> mujoco.MjModel:
        """An MjModel with `scales` applied (nominal where absent), as the task's env applies a fixed randomization
        set on reset: the env's DomainRandomizer writes the set's draw into a copy of the nominal model.

        A least-squares fit asks for thousands of points, each new: the least recently used cached model is
        written over (the randomizer resets every array it scales from its nominal copy first), rather than the
        MJCF parsed again (a sixth of a fit's time) or a model and its randomizer built afresh."""
        key = tuple(sorted((k, round(float(v), 12)) for k, v in scales.items()))
        if key in self._models:
            self._models.move_to_end(key)
            return self._models[key][0]
        if self._nominal is None:
            import gymnasium as gym

            env = gym.make(self.env_id, disable_env_checker=True)
            env.reset(seed=0)
            self._nominal = env.unwrapped.model
            env.close()
        names = tuple(sorted(scales))
        slot = self._models.popitem(last=False)[1] if len(self._models) >= self.CACHE else None
        rset = parse_randomization(fixed_set(scales)) if scales else None
        if slot is None or slot[2] != names:
            model = copy.copy(self._nominal)  # mj_copyModel
            slot = (model, None if rset is None else DomainRandomizer(model, rset), names)
        model, randomizer, _ = slot
        if randomizer is not None and rset is not None:
            randomizer.apply(sample_domain(rset, np.random.default_rng(0)))
        self._models[key] = slot
        return model

    def _columns(self) -> list[int]:
        """Full-physics-state columns of the state observations, in `state_obs` order."""
        return [
            (self._qpos0 if kind == "qpos" else self._qvel0) + i
            for kind, i in (self.obs_to_state[o] for o in self.state_obs)
        ]

    def initial_states(self, obs: np.ndarray) -> np.ndarray:
        """Full physics states (n, nstate) with qpos/qvel taken from observations (n, obs_dim)."""
        model = self.model({})
        mujoco.mj_resetData(model, self._data)
        template = np.empty(mujoco.mj_stateSize(model, self._spec))
        mujoco.mj_getState(model, self._data, template, self._spec)
        return self.set_states(np.repeat(template[None], len(obs), axis=0), obs[:, self.state_obs])

    def set_states(self, states: np.ndarray, state_obs: np.ndarray) -> np.ndarray:
        """A copy of `states` (n, nstate) with the state observations (n, len(state_obs)) written in."""
        out = states.copy()
        out[:, self._columns()] = state_obs
        return out

    def predict(self, scales: dict[str, float], states: np.ndarray, controls: np.ndarray) -> np.ndarray:
        """Predicted state observations (n, H, len(state_obs)) after each of H control steps.

        controls: (n, H, act_dim) normalized actions, held over each control period's substeps.
        """
        model = self.model(scales)
        actions = np.clip(controls, -1.0, 1.0)
        if self._actuators is not None:
            actions, mapped = np.zeros(actions.shape[:2] + (self.nu,)), actions * self._ctrl_per_action
            actions[..., self._actuators] = mapped
        ctrl = np.repeat(actions, self.substeps, axis=1)
        out, _ = rollout.rollout(model, self._data, states, ctrl)
        out = out[:, self.substeps - 1 :: self.substeps]  # the state at each control step's end
        return out[:, :, self._columns()]
