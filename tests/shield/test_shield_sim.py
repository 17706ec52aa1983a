"""The shield in simulation: the MuJoCo-derived spec, and the gymnasium wrapper used for training in the loop."""

from __future__ import annotations

import json

import gymnasium as gym
import mujoco
import numpy as np
import pytest

import envs
from pipeline.config import load_config
from pipeline.safety.shield_spec import build_shield_spec
from pipeline.safety.shielded_env import ShieldedEnv
from shield.spec import ShieldSpec, ShieldSpecError


def test_cartpole_spec_predicts_mujoco_one_control_step_ahead():
    spec = ShieldSpec.from_dict(json.loads(json.dumps(build_shield_spec(load_config("configs/cartpole.yaml")))))
    model = spec.linear_model()
    nominal = envs.nominal_model("sim2real/CartPoleRail-v0")
    data = mujoco.MjData(nominal.model)
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = np.array([rng.uniform(-0.8, 0.8), rng.uniform(-0.05, 0.05), rng.uniform(-1, 1), rng.uniform(-0.3, 0.3)])
        u = rng.uniform(-1, 1, 1)
        mujoco.mj_resetData(nominal.model, data)
        data.qpos[:], data.qvel[:], data.ctrl[:] = x[:2], x[2:], u
        mujoco.mj_step(nominal.model, data, nstep=nominal.substeps)
        predicted = model.A @ x + model.B @ u + model.c
        np.testing.assert_allclose(predicted, np.r_[data.qpos, data.qvel], atol=2e-3)


def test_quadrotor_spec_is_a_lagged_double_integrator_with_the_task_constraints():
    d = build_shield_spec(load_config("configs/quadrotor.yaml"))
    spec = ShieldSpec.from_dict(d)
    assert spec.model["type"] == "double_integrator" and spec.linear_model().internal_dim == 3
    assert [c["name"] for c in spec.constraints] == [
        c["name"] for c in envs.safety_spec(envs.quadrotor_geofence.ENV_ID)["constraints"]
    ]
    assert spec.assumptions["max_latency_s"] == pytest.approx(0.04) and spec.assumptions["statement"]


def test_unknown_constraint_in_gains_is_named():
    cfg = load_config("configs/cartpole.yaml")
    cfg.shield.gains = {"rail_bnd": 0.5}
    with pytest.raises(ShieldSpecError, match="rail_bnd"):
        build_shield_spec(cfg)


def test_wrapper_filters_actions_and_charges_the_intervention_penalty():
    cfg = load_config("configs/cartpole.yaml")
    spec = build_shield_spec(cfg)
    shielded = ShieldedEnv(gym.make(cfg.task.env_id), spec, intervention_penalty=0.25)
    bare = gym.make(cfg.task.env_id)
    obs, _ = shielded.reset(seed=3)
    bare.reset(seed=3)
    lqr = envs.legacy_controller(cfg.task.env_id)
    intervened = 0
    for t in range(150):
        # the LQR steered at x_ref = 2 m drives the cart into the rail end; the same actions go to `bare`
        steered = obs.copy()
        steered[4] = 2.0
        action = lqr(steered[None])[0]
        obs, reward, term, trunc, info = shielded.step(action)
        _, bare_reward, bare_term, _, _ = bare.step(info["shield_action"])
        assert set(info["shield"]) >= {"intervened", "fallback", "h", "slack", "solve_us", "bad_input"}
        expected = bare_reward - (0.25 if info["shield"]["intervened"] else 0.0)
        assert reward == pytest.approx(expected)
        assert info["cost"] == 0.0
        intervened += info["shield"]["intervened"]
        if term or bare_term:
            break
    assert intervened > 0


def test_training_envs_follow_the_shield_in_loop_switch():
    from pipeline.training.rollout import make_env
    from pipeline.training.scaffold import shield_in_loop

    cfg = load_config("configs/cartpole.yaml")
    assert shield_in_loop(cfg) is None
    assert not isinstance(make_env(cfg.task.env_id, "train", shield=shield_in_loop(cfg)), ShieldedEnv)
    cfg.shield.train_in_loop = True
    cfg.shield.intervention_penalty = 0.1
    wrapped = make_env(cfg.task.env_id, "train", shield=shield_in_loop(cfg))
    assert isinstance(wrapped, ShieldedEnv) and wrapped.intervention_penalty == 0.1
