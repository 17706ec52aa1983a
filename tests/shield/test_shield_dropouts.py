"""Observation dropouts: the shield dead-reckons with an error box that grows every blind step, keeps the plant
safe for its blind horizon, and says (`info["blind"]`, `blind_past_horizon`) when it is past it."""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shield.cbf import CbfShield


@functools.cache
def _setup(task: str):
    from pipeline.config import load_config
    from pipeline.safety.shield_spec import build_shield_spec

    cfg = load_config(f"configs/{task}.yaml")
    return cfg, build_shield_spec(cfg)


@pytest.mark.parametrize("task", ["cartpole", "quadrotor"])
def test_the_blind_horizon_is_where_the_position_error_outgrows_the_margin(task):
    _, spec = _setup(task)
    shield = CbfShield(spec)
    s, K = shield.spec, shield.blind_horizon
    pos = [s.state_index.index(p) for p in s.position_index]
    assert K >= 1
    assert max(shield._blind_box(K)[pos]) <= s.margin < max(shield._blind_box(K + 1)[pos])
    assert np.all(shield._blind_box(K + 1) >= shield._blind_box(K))  # the error only grows while blind


@settings(max_examples=25, deadline=None, derandomize=True)
@given(blind=st.integers(0, 40), task=st.sampled_from(["cartpole", "quadrotor"]))
def test_dropouts_beyond_the_blind_horizon_raise_the_flag(blind, task):
    cfg, spec = _setup(task)
    shield = CbfShield(spec)
    K = shield.blind_horizon
    obs = np.zeros(shield.spec.obs_dim, np.float32)
    hold = np.asarray(shield.spec.fallback_action or np.zeros(shield.spec.act_dim), np.float32)
    for _ in range(5):
        _, info = shield.filter(obs, hold)
        assert not info["blind"] and info["blind_steps"] == 0
    for k in range(1, blind + 1):
        u, info = shield.filter(np.full_like(obs, np.nan), hold)
        assert info["blind_steps"] == k and info["blind"] == (k > K)
        assert np.all(np.isfinite(u))
    assert shield.blind_past_horizon == max(0, blind - K)
    _, info = shield.filter(obs, hold)  # seen again: the flag clears, the count stays
    assert not info["blind"] and info["blind_steps"] == 0 and shield.blind_past_horizon == max(0, blind - K)


@pytest.mark.parametrize("task", ["cartpole", "quadrotor"])
def test_dropouts_within_the_blind_horizon_keep_the_plant_safe(task):
    """MuJoCo, `reality`: every few observed steps the sensor drops out for the whole blind horizon, while an
    adversary and a random policy drive; no violating step, and the flag never raised."""
    from pipeline.evaluation.adversary import reference_policy

    cfg, spec = _setup(task)
    violations = flagged = 0
    for policy_name in ("adversarial", "random"):
        for seed in range(2):
            env = gym.make(cfg.task.env_id, randomization=cfg.randomization["reality"], max_episode_steps=300)
            shield = CbfShield(spec)
            K = shield.blind_horizon
            policy = reference_policy(policy_name, cfg, shield.spec, seed=seed)
            obs, _ = env.reset(seed=seed)
            for t in range(300):
                seen = t < 20 or (t - 20) % (K + 3) < 3
                u, info = shield.filter(obs if seen else np.full_like(obs, np.nan), policy(obs[None])[0])
                flagged += info["blind"]
                obs, _, terminated, truncated, step_info = env.step(u)
                violations += step_info["cost"] > 0
                if terminated or truncated:
                    break
            env.close()
    assert violations == 0 and flagged == 0
