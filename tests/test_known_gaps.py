"""The safety case on the reproducers of an outside review (session 13), through the real MuJoCo envs, on the nominal
plant itself. A gap not closed yet is marked `xfail(strict=True)`: the day a fix makes it pass, the strict marker turns
the pass into a failure, the marker comes off, and the test guards the fix.

- arm (closed): the spec counted on 10.7 and 13.7 rad/s^2 of braking (0.3 x each joint's summed |B| row) where the
  weakest plant had 6.9 and -5.3 left after the declared input-gain error, the other joint's torque through the coupling and
  the declared model error; a constant full-torque policy took the elbow past its limit. `config --check` now holds
  braking to what is left (pipeline/safety/envelope.py), and the arm's motors are geared so that some is.
- arm, latency (closed): the shield predicted through exactly `latency_steps` (2); the sets admit 0 to 2. A plant
  with latency 1 applies each action a step earlier than predicted (and the prediction counted again the actions it
  had already applied), and a constant full-torque policy took a joint past its limit (6 steps here; 9 of 180
  episodes in the review's sweep). `shield.latency_min_steps` makes every admissible latency a case of the
  prediction, as the input-gain ends are (shield/prediction.py); the arm declares 0.
- quadrotor (open): with each axis flipping at its own period, the inner loop's attitude overshoots its 45 deg tilt limit at
  low collective thrust (68 deg measured) and the realized sideways acceleration reaches 9.8 m/s^2, against the
  model's bound of 4 x 1.2 + 1.5 = 6.3; the monitor never flags it.
"""

from __future__ import annotations

import gymnasium as gym
import mujoco
import numpy as np
import pytest

from envs.randomization import parse_randomization
from pipeline.config import load_config
from pipeline.evaluation.episodes import make_env
from pipeline.safety.shield_spec import build_shield_spec
from shield.cbf import CbfShield


def _shielded_violations(cfg, env, policy, seed: int, steps: int, start: dict | None = None) -> int:
    shield = CbfShield(build_shield_spec(cfg))
    obs, _ = env.reset(seed=seed)
    if start is not None:
        data = env.unwrapped.data
        data.qpos[:len(start["qpos"])], data.qvel[:len(start["qvel"])] = start["qpos"], start["qvel"]
        mujoco.mj_forward(env.unwrapped.model, data)
        obs = env.unwrapped._obs()
    violations = 0
    for t in range(steps):
        action, _ = shield.filter(np.asarray(obs, np.float32), policy(t))
        obs, _, terminated, truncated, info = env.step(action)
        violations += info["cost"] > 0
        if terminated or truncated:
            break
    env.close()
    return violations


def test_arm_at_full_torque_from_rest_stays_inside_its_joint_range():
    """Closed this session (the arm's plant, its declared bounds and the check that holds braking to them); it
    left its range at step 203 before. Kept here beside the open one, as the review's reproducer."""
    cfg = load_config("configs/arm.yaml")
    env = make_env(cfg, parse_randomization({}), 300)  # the nominal plant: no noise, latency or push
    start = {"qpos": [-0.2, -0.2], "qvel": [0.0, 0.0]}
    assert _shielded_violations(cfg, env, lambda t: np.float32([1.0, 1.0]), 0, 300, start) == 0


def test_arm_with_less_latency_than_the_shield_predicts_stays_inside_its_joint_range():
    cfg = load_config("configs/arm.yaml")
    env = make_env(cfg, parse_randomization({"latency_steps": {"low": 1, "high": 1}}), 300)  # the shield assumes 2
    assert _shielded_violations(cfg, env, lambda t: np.float32([1.0, 1.0]), 13, 300) == 0


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="known gap: the quadrotor's inner loop overshoots its tilt limit under "
                                       "flipping set-points (see the module docstring)")
def test_quadrotor_under_flipping_set_points_stays_inside_its_geofence():
    cfg = load_config("configs/quadrotor.yaml")
    env = gym.make(cfg.task.env_id, randomization=None, wind_scale=0.0, max_episode_steps=1000)
    signs, half_periods = np.array([1.0, -1.0, -1.0]), np.array([28, 6, 23])
    policy = lambda t: np.float32(signs * np.where((t // half_periods) % 2, -1.0, 1.0))  # noqa: E731
    assert _shielded_violations(cfg, env, policy, 27, 1000) == 0
