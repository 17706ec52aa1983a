"""Builds and registers the tasks: the code task (the quadrotor) and every task declared in a YAML's `plant:` section.

Where task YAMLs are found (no path relative to a checkout is assumed):
the directory in $SIM2REAL_CONFIG_DIR, the `configs/` folder beside the
installed packages when there is one, and every file listed in
$SIM2REAL_TASKS (os.pathsep-separated). `register_task_file(path)` adds one
more and lists it in $SIM2REAL_TASKS, so Ray workers and subprocesses
started afterwards register it too.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from functools import partial
from pathlib import Path

import gymnasium as gym
import yaml

from envs import quadrotor_geofence
from envs.declaration import DeclarationError, PlantDeclaration, mjcf_identity, mjcf_path, parse_declaration
from envs.io_names import declared_io
from envs.randomization import RandomizationError, RandomizationSet, load_randomization_sets, parse_randomization
from envs.registry import TaskSpec, UnknownTaskError, all_tasks, config_dirs, register, task
from envs.wrappers import randomize
from shield.constraints import parse_constraints

TASKS_ENV = "SIM2REAL_TASKS"


# -- the code task --------------------------------------------------------------------------------------


def _quadrotor_legacy():
    from envs.legacy_quadrotor import QuadrotorCascadedPid

    return QuadrotorCascadedPid()


def _code_tasks() -> list[TaskSpec]:
    qd = quadrotor_geofence
    return [
        # The inner attitude loop (envs/quadrotor_inner_loop.py) is code, so this task is too.
        TaskSpec(
            env_id=qd.ENV_ID,
            name=qd.TASK_NAME,
            config_file=None,
            make_env=qd.QuadrotorGeofenceEnv,
            obs_dim=qd.OBS_DIM,
            act_dim=qd.ACT_DIM,
            control_period=qd.CONTROL_PERIOD,
            episode_steps=qd.EPISODE_STEPS,
            safety=qd.SAFETY,
            shield_model={"type": "double_integrator", "response_time_constant": qd.ACCEL_TIME_CONSTANT},
            action_scale=list(qd.MAX_ACCEL),
            legacy_name="cascaded_pid",
            make_legacy=_quadrotor_legacy,
            describe_io=qd.io_names,
            ends_early=True,  # a crash, a flip or leaving the 6 m box ends the episode
        ),
    ]


# -- declared tasks ------------------------------------------------------------------------------------


def read_declaration(path: Path) -> tuple[dict, PlantDeclaration] | None:
    """(task section, declaration) of a task YAML with a `plant:` section; None when it has none."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise DeclarationError(f"cannot read task config {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise DeclarationError(f"task config {path} is not valid YAML: {err}") from None
    if not isinstance(doc, dict) or doc.get("plant") is None:
        return None
    head = doc.get("task")
    if not isinstance(head, dict) or not isinstance(head.get("env_id"), str) or not isinstance(head.get("name"), str):
        raise DeclarationError(f"{path}: task.name and task.env_id are needed beside plant:")
    return head, parse_declaration(doc["plant"])


def _make_declared(decl: PlantDeclaration, mjcf: Path, **kwargs) -> gym.Env:
    from envs.declared_env import DeclaredTaskEnv

    return DeclaredTaskEnv(decl, mjcf, **kwargs)


def _nominal(decl: PlantDeclaration, mjcf: Path):
    from envs.declared_env import nominal_model

    return nominal_model(decl, mjcf)


def _declared_legacy(decl: PlantDeclaration, mjcf: Path):
    from envs.declaration import resolve_entry_point
    from envs.legacy_declared import DeclaredLqr, PidLoops

    legacy = decl.legacy
    name = legacy.name or legacy.type
    if legacy.type == "pid":
        holds = any(loop.feedforward == "hold" for loop in legacy.loops)
        return PidLoops(decl, name, _nominal(decl, mjcf).trim if holds else None)
    if legacy.type == "lqr":
        if decl.shield_model.type != "linear":
            raise DeclarationError(
                "plant.legacy: lqr needs shield_model.type linear (the linearization it is designed on)"
            )
        return DeclaredLqr(decl, _nominal(decl, mjcf), name)
    factory = resolve_entry_point(legacy.callable, "plant.legacy.callable")
    try:
        return factory()
    except Exception as err:  # the user's code: its error, with the key that names it
        raise DeclarationError(
            f"plant.legacy.callable: {legacy.callable}() raised {type(err).__name__}: {err}"
        ) from None


def compile_declaration(head: dict, decl: PlantDeclaration, path: Path) -> TaskSpec:
    """The TaskSpec of a declared task (nothing is compiled by MuJoCo until an env or a model is asked for)."""
    path = Path(path).resolve()
    # `module:function` entries (a legacy callable, a reward function) may live beside the YAML: its folder is
    # searched last, so a file there never shadows an installed module.
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    # Beside the YAML, else by name in the config folders (a copy of a shipped YAML edited elsewhere).
    mjcf = mjcf_path(decl, path, config_dirs())
    sm = decl.shield_model
    if sm.type == "double_integrator":
        if sm.accel_per_action is None or len(sm.accel_per_action) != len(decl.actuators):
            raise DeclarationError(
                f"plant.shield_model.accel_per_action: needs one value per actuator ({len(decl.actuators)})"
            )
        positions = len(decl.kinematics.positions)
        if positions and positions != len(decl.actuators):
            raise DeclarationError(
                f"plant.kinematics.positions: the double_integrator shield model drives each position with its own "
                f"actuator, and this plant declares {positions} position(s) for {len(decl.actuators)} actuator(s); "
                f"a coordinate no actuator drives directly (a swinging load) needs shield_model type linear"
            )
        shield_model, scale = {"type": sm.type, "response_time_constant": sm.response_time_s}, list(sm.accel_per_action)
    else:
        shield_model = {"type": "linear", "nominal": partial(_nominal, decl, mjcf)}
        scale = [a.scale if a.units_per_action is None else a.units_per_action for a in decl.actuators]
    steer = decl.index(decl.steerable_setpoint) if decl.steerable_setpoint else None
    canonical = decl.model_dump(mode="json") | {"mjcf": mjcf_identity(mjcf), "task": [head["name"], head["env_id"]]}
    fingerprint = hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()
    return TaskSpec(
        env_id=head["env_id"],
        name=head["name"],
        config_file=path,
        make_env=partial(_make_declared, decl, mjcf),
        obs_dim=len(decl.observations),
        act_dim=len(decl.actuators),
        control_period=decl.control_period,
        episode_steps=decl.episode_steps,
        safety=decl.safety(),
        shield_model=shield_model,
        action_scale=scale,
        legacy_name=decl.legacy.name or decl.legacy.type,
        make_legacy=partial(_declared_legacy, decl, mjcf),
        steerable_setpoint=steer,
        ends_early=bool(decl.termination),
        declared=True,
        fingerprint=fingerprint,
        describe_io=partial(declared_io, decl, mjcf),
    )


def _check(spec: TaskSpec, decl: PlantDeclaration) -> None:
    """Build everything a declared task names once: the MJCF and its element names, the reward functions,
    the legacy controller and (linear) the shield's operating point."""
    try:
        env = spec.make_env()
    except ValueError as err:  # MuJoCo's XML errors are ValueErrors too
        if isinstance(err, DeclarationError):
            raise
        raise DeclarationError(f"plant.mjcf: cannot load the MJCF of {spec.config_file}: {err}") from None
    env.close()
    if spec.shield_model["type"] == "linear":
        _check_linear_state(spec, spec.nominal_model(), [o.name for o in decl.observations])
    spec.make_legacy()


def _check_linear_state(spec: TaskSpec, nominal, names: list[str]) -> None:
    """A linear shield model's state is the joints' qpos and qvel the plant observes: every kinematics entry and
    every constrained observation must be one (a site or sensor reading is not in it)."""
    safety = spec.safety_spec()
    state = nominal.obs_to_state
    wanted = [
        (f"plant.kinematics.{key}[{k}]", o)
        for key, idx in (("positions", "position_index"), ("velocities", "velocity_index"))
        for k, o in enumerate(safety["kinematics"][idx])
    ]
    wanted += [
        (f"plant.constraints[{c}] ({con.name})", o)
        for c, con in enumerate(parse_constraints(safety["constraints"], len(names)))
        for o in con.used
    ]
    for where, o in wanted:
        if o not in state:
            raise DeclarationError(
                f"{where}: observation {names[o]!r} is not a joint's qpos or qvel, and a "
                f"linear shield model's state holds only those (linearized from the MJCF): write the limit "
                f"over the joints instead (a tip's height, say, bounded by limits on the joint angles that "
                f"imply it, as halfspaces over them), or, where each input drives one coordinate of its own "
                f"directly, use shield_model: double_integrator with that coordinate and its velocity observed"
            )


def register_task_file(path, check: bool = False) -> TaskSpec | None:
    """Register the task a YAML declares (None when it declares none) and list it in $SIM2REAL_TASKS,
    so Ray workers and subprocesses started afterwards register it too. `check` builds it all first."""
    path = Path(path).resolve()
    found = read_declaration(path)
    if found is None:
        return None
    spec = compile_declaration(*found, path)
    if check:
        _check(spec, found[1])
    spec = register(spec)
    listed = [p for p in os.environ.get(TASKS_ENV, "").split(os.pathsep) if p]
    if str(path) not in listed:
        os.environ[TASKS_ENV] = os.pathsep.join(listed + [str(path)])
    return spec


def check_task_file(path) -> TaskSpec:
    """Check a task YAML's declaration against its MJCF and entry points, then register it."""
    spec = register_task_file(path, check=True)
    if spec is None:
        raise DeclarationError(f"{path}: has no plant: section")
    return spec


def _discover() -> None:
    """Register the declared tasks found in the config directories and in $SIM2REAL_TASKS."""
    files = [p for d in config_dirs() for p in sorted(d.glob("*.yaml"))]
    files += [Path(p) for p in os.environ.get(TASKS_ENV, "").split(os.pathsep) if p]
    for path in files:
        try:
            found = read_declaration(path)
            if found is not None:
                register(compile_declaration(*found, path))
        except (DeclarationError, ValueError) as err:
            # One broken file must not make every task unimportable; `sim2real config --check` names the key.
            warnings.warn(f"task declaration {path} skipped: {err}", stacklevel=2)


def register_tasks() -> None:
    """Register the code task and every declared task that can be found (idempotent)."""
    for spec in _code_tasks():
        register(spec)
    _discover()


# -- what the rest of the project calls ------------------------------------------------------------------


def resolve_randomization(env_id: str, spec) -> RandomizationSet | None:
    """Turn None, a set name (looked up in the task's YAML), a dict, or a RandomizationSet into a set."""
    if spec is None or isinstance(spec, RandomizationSet):
        return spec
    if isinstance(spec, dict):
        return parse_randomization(spec)
    if isinstance(spec, str):
        path = task(env_id).config_path
        sets = load_randomization_sets(path)
        if spec not in sets:
            raise RandomizationError(
                f"randomization set {spec!r} is not in {path}; available: {sorted(sets) or 'none'}"
            )
        return sets[spec]
    raise RandomizationError(
        f"randomization must be None, a set name, a dict or a RandomizationSet, not {type(spec).__name__}"
    )


def make_task_env(env_id: str, randomization=None, **kwargs) -> gym.Env:
    """The gymnasium entry point of every registered task (randomization: None, set name, RandomizationSet or dict)."""
    env = task(env_id).make_env(**kwargs)
    rset = resolve_randomization(env_id, randomization)
    return env if rset is None else randomize(env, rset)


def task_config_path(env_id: str) -> Path:
    """The task's YAML (its randomization sets, and its declaration for declared tasks)."""
    return task(env_id).config_path


def safety_spec(env_id: str) -> dict:
    """SAFETY plus dt (s), action bounds, action_scale (physical units per unit action) and the shield model's kind."""
    return task(env_id).safety_spec()


def nominal_model(env_id: str):
    """The nominal plant the linear shield model is linearized from (tasks with a linear shield model)."""
    return task(env_id).nominal_model()


def measured_response(env_id: str, pushes: list[str] | None = None, rollouts: int = 4, steps: int = 100) -> dict:
    """How a declared plant at its nominal parameters answers, read on its kinematics velocities over one
    physics step from rest (the acceleration itself: damping, which only ever helps a brake, has not acted
    yet, and no joint stop is reached): what a `double_integrator` shield model is held to. Returns

    - ``per_action`` ([position][input], units/s^2 per unit action) at the middle of the initial state, each
      actuator's own lag settled (a MuJoCo `filter` actuator's state set to its control);
    - ``lag_s`` (per input): each actuator's first-order time constant in the MJCF (0 without dynamics);
    - ``drift`` (per position): the largest zero-action acceleration (gravity, a spring) over the states that
      `rollouts` episodes of random full actions visit inside the constraints, at rest, signed;
    - ``push`` ({body: [position][axis]}, units/s^2 per newton along world x, y, z): for each body in `pushes`.
    """
    import mujoco
    import numpy as np

    from envs.linearization import apply_held_action
    from envs.safety import violated_constraints

    spec = task(env_id)
    safety = spec.safety_spec()
    vel = list(safety["kinematics"]["velocity_index"])
    env = spec.make_env()
    try:
        base = env.unwrapped
        model, data = base.model, base.data
        h = float(model.opt.timestep)
        ctrl, scale = list(base._binding.ctrl), np.asarray(base._binding.scale, np.float64)
        filters = (int(mujoco.mjtDyn.mjDYN_FILTER), int(mujoco.mjtDyn.mjDYN_FILTEREXACT))
        lag = [float(model.actuator_dynprm[i][0]) if int(model.actuator_dyntype[i]) in filters else 0.0 for i in ctrl]
        # A state resting on a joint limit or in contact is held there by the constraint force, not drifting:
        # the drift is read where nothing but the plant's own dynamics acts.
        held = {
            int(c)
            for c in (
                mujoco.mjtConstraint.mjCNSTR_LIMIT_JOINT,
                mujoco.mjtConstraint.mjCNSTR_LIMIT_TENDON,
                mujoco.mjtConstraint.mjCNSTR_CONTACT_FRICTIONLESS,
                mujoco.mjtConstraint.mjCNSTR_CONTACT_PYRAMIDAL,
                mujoco.mjtConstraint.mjCNSTR_CONTACT_ELLIPTIC,
            )
        }

        def free(qpos: np.ndarray) -> bool:
            data.qpos[:], data.qvel[:] = qpos, 0.0
            mujoco.mj_forward(model, data)
            return not any(int(t) in held for t in data.efc_type[: data.nefc])

        def accel(qpos: np.ndarray, action: np.ndarray, body: int = -1, axis: int = 0) -> np.ndarray:
            data.qpos[:], data.qvel[:], data.act[:] = qpos, 0.0, 0.0
            apply_held_action(model, data, ctrl, scale, action)
            data.xfrc_applied[:] = 0.0
            if body >= 0:
                data.xfrc_applied[body, axis] = 1.0
            mujoco.mj_forward(model, data)
            before = base._values()[vel]
            mujoco.mj_step(model, data)
            mujoco.mj_forward(model, data)  # sensors and sites of the state reached (mj_step reads them before)
            data.xfrc_applied[:] = 0.0
            return (base._values()[vel] - before) / h

        base.reset(seed=0)
        for kind, adr, lo, hi in base._init:  # the middle of the initial state
            getattr(data, kind)[adr] = 0.5 * (lo + hi)
        center = data.qpos.copy()
        zero = np.zeros(spec.act_dim)
        per_action = np.empty((len(vel), spec.act_dim))
        for j in range(spec.act_dim):
            unit = np.eye(spec.act_dim)[j]
            per_action[:, j] = 0.5 * (accel(center, unit) - accel(center, -unit))
        visited = [center]
        rng = np.random.default_rng(0)
        for episode in range(rollouts):
            base.reset(seed=episode)
            for _ in range(steps):
                obs, _, terminated, _, _ = base.step(rng.choice([-1.0, 1.0], spec.act_dim))
                if terminated:
                    break
                if not violated_constraints(safety, obs):
                    visited.append(data.qpos.copy())
        visited = [q for q in visited if free(q)] or [center]
        drifts = np.array([accel(q, zero) for q in visited])
        drift = drifts[np.abs(drifts).argmax(axis=0), np.arange(len(vel))]
        push = {}
        for name in pushes or []:
            b = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, name)
            push[name] = np.array([accel(center, zero, b, a) - accel(center, zero) for a in range(3)]).T.tolist()
    finally:
        env.close()
    return {
        "per_action": per_action.tolist(),
        "lag_s": lag,
        "drift": drift.tolist(),
        "push": push,
        "states": len(visited),
    }


def legacy_controller(env_id: str):
    """The controller the plant runs today: batch policy obs float32[n, obs_dim] -> float32[n, act_dim]."""
    return task(env_id).make_legacy()


def describe_tasks() -> list[dict]:
    """One row per task: env_id, task, obs/act sizes, constraints, legacy controller, control period (s)."""
    return [t.describe() for t in all_tasks()]


__all__ = [
    "UnknownTaskError",
    "check_task_file",
    "compile_declaration",
    "config_dirs",
    "describe_tasks",
    "legacy_controller",
    "make_task_env",
    "measured_response",
    "nominal_model",
    "read_declaration",
    "register_task_file",
    "register_tasks",
    "resolve_randomization",
    "safety_spec",
    "task_config_path",
]
