"""Plants outside the envelope under a steady force, and shield specs whose monitor bounds are measured over the
envelope: shared by the assumption monitor's tests and the predictive filter's conservative-mode tests (one
synthesis and one measurement per task and session)."""

from __future__ import annotations

import functools

import numpy as np


@functools.cache
def synthesized(task: str):
    """(config, synthesized shield spec dict) of `configs/<task>.yaml`."""
    from pipeline.config import load_config
    from pipeline.safety.shield_spec import build_shield_spec

    cfg = load_config(f"configs/{task}.yaml")
    return cfg, build_shield_spec(cfg)


@functools.cache
def measured(task: str):
    """(config, spec dict) with the monitor's bounds measured over the config's envelope."""
    from pipeline.evaluation.monitor_bounds import with_measured_monitor

    cfg, spec = synthesized(task)
    return cfg, with_measured_monitor(cfg, spec, runs_per_set=8, seed=0)


def steadily_pushed(cfg, body: str, force: float, axes: list[str]):
    """Reality's plants (nominal masses and gains, its latency and noise) under a steady force on `body` held the
    whole episode (each episode draws it in [-force, force] per axis): beyond the declared gusts."""
    from envs.randomization import parse_randomization

    reality = cfg.randomization["reality"]
    return parse_randomization(
        {
            "latency_steps": {"low": 0, "high": 2},
            "obs_noise_std": reality.obs_noise_std,
            "action_noise_std": reality.action_noise_std,
            "push": {"body": body, "max_force": force, "probability": 1.0, "duration_steps": 500, "axes": axes},
        }
    )


def force_accel(env, cfg, spec, body: str) -> np.ndarray:
    """Per velocity of `spec`, the acceleration (units/s^2) the force applied now on `body` gives it in the plant's
    present state: M^-1 J^T f, from MuJoCo's own mass matrix."""
    import mujoco

    model, data = env.unwrapped.model, env.unwrapped.data
    b = model.body(body).id
    jac = np.zeros((3, model.nv))
    mujoco.mj_jacBody(model, data, jac, None, b)
    qacc = np.zeros((1, model.nv))
    mujoco.mj_solveM(model, data, qacc, (jac.T @ data.xfrc_applied[b, :3])[None])
    dofs = [model.joint(cfg.plant["observations"][o]["joint"]).dofadr[0] for o in spec.velocity_index]
    return qacc[0, dofs]
