"""The task table: ids, config files, safety specs, legacy controllers, and the registered env factories."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import gymnasium as gym

from envs import cartpole_rail, quadrotor_geofence

_TASK_MODULES = {m.ENV_ID: m for m in (cartpole_rail, quadrotor_geofence)}
LEGACY_NAMES = {cartpole_rail.ENV_ID: "lqr", quadrotor_geofence.ENV_ID: "cascaded_pid"}


def _task_module(env_id: str):
    try:
        return _TASK_MODULES[env_id]
    except KeyError:
        raise ValueError(f"unknown task env id {env_id!r}; known: {sorted(_TASK_MODULES)}") from None


def task_config_path(env_id: str) -> Path:
    """Path of the task's YAML: $SIM2REAL_CONFIG_DIR/<task>.yaml, else <repo>/configs/<task>.yaml."""
    name = _task_module(env_id).TASK_NAME
    root = os.environ.get("SIM2REAL_CONFIG_DIR")
    base = Path(root) if root else Path(__file__).resolve().parent.parent / "configs"
    return base / f"{name}.yaml"


def safety_spec(env_id: str) -> dict:
    """Return SAFETY plus dt (s), action bounds, action_scale (physical units per unit action) and model."""
    module = _task_module(env_id)
    spec = copy.deepcopy(module.SAFETY)
    spec.update(
        dt=module.CONTROL_PERIOD,
        action_low=[-1.0] * module.ACT_DIM,
        action_high=[1.0] * module.ACT_DIM,
        obs_dim=module.OBS_DIM,
        act_dim=module.ACT_DIM,
    )
    if module is cartpole_rail:
        # Linearize envs.cartpole_rail.nominal_model() (MuJoCo derivatives) for the shield's model.
        spec.update(action_scale=[cartpole_rail.MAX_FORCE], model="linear", substeps=cartpole_rail.SUBSTEPS)
    else:
        spec.update(
            action_scale=list(quadrotor_geofence.MAX_ACCEL),
            model="double_integrator",
            response_time_constant=quadrotor_geofence.ACCEL_TIME_CONSTANT,
        )
    return spec


def legacy_controller(env_id: str):
    """Return the controller the plant runs today: batch policy obs float32[n, obs_dim] -> float32[n, act_dim]."""
    _task_module(env_id)
    if env_id == cartpole_rail.ENV_ID:
        from envs.legacy_cartpole import CartPoleLqr

        return CartPoleLqr()
    from envs.legacy_quadrotor import QuadrotorCascadedPid

    return QuadrotorCascadedPid()


def describe_tasks() -> list[dict]:
    """One row per task: env_id, task, obs_dim, act_dim, constraints, legacy controller, control period (s)."""
    return [
        {
            "env_id": env_id,
            "task": m.TASK_NAME,
            "obs_dim": m.OBS_DIM,
            "act_dim": m.ACT_DIM,
            "constraints": [c["name"] for c in m.SAFETY["constraints"]],
            "legacy_controller": LEGACY_NAMES[env_id],
            "legacy": LEGACY_NAMES[env_id],  # short alias used by `sim2real envs`
            "control_period_s": m.CONTROL_PERIOD,
            "dt": m.CONTROL_PERIOD,  # alias of control_period_s (s)
            "max_episode_steps": m.EPISODE_STEPS,
        }
        for env_id, m in _TASK_MODULES.items()
    ]


def _make(env_cls, env_id: str, randomization=None, **kwargs) -> gym.Env:
    env = env_cls(**kwargs)
    if randomization is None:
        return env
    from envs.randomization import resolve_randomization
    from envs.wrappers import randomize

    return randomize(env, resolve_randomization(env_id, randomization))


def make_cartpole(randomization=None, **kwargs) -> gym.Env:
    """Entry point of sim2real/CartPoleRail-v0 (randomization: None, set name, RandomizationSet or dict)."""
    return _make(cartpole_rail.CartPoleRailEnv, cartpole_rail.ENV_ID, randomization, **kwargs)


def make_quadrotor(randomization=None, **kwargs) -> gym.Env:
    """Entry point of sim2real/QuadrotorGeofence-v0 (randomization: None, set name, RandomizationSet or dict)."""
    return _make(quadrotor_geofence.QuadrotorGeofenceEnv, quadrotor_geofence.ENV_ID, randomization, **kwargs)


def register_tasks() -> None:
    """Register both task ids with gymnasium (idempotent)."""
    for env_id, entry, steps in (
        (cartpole_rail.ENV_ID, "envs.tasks:make_cartpole", cartpole_rail.EPISODE_STEPS),
        (quadrotor_geofence.ENV_ID, "envs.tasks:make_quadrotor", quadrotor_geofence.EPISODE_STEPS),
    ):
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry, max_episode_steps=steps)
