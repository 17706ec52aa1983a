"""Known gaps in the safety case, found by an outside review (session 13) and not yet closed: each test states what
must hold and fails today, so it is marked `xfail(strict=True)`. When a fix makes one pass, the strict marker turns
the pass into a failure: remove the marker then, and the test guards the fix.

Both are the shield's model failing to bound the real plant under an aggressive policy, on plants the configs admit
(here the nominal plant itself), through the real MuJoCo envs:

- arm: the linear model is linearized at q = 0; near the joint limits the real coupling between the joints is ~40 %
  of the model's, the braking the spec counts on (0.3 x the summed |B| row) exceeds what is left after the declared
  input-gain error and drift bound, and the hard brake drives an input to its end for a weakly coupled violated row.
- quadrotor: with each axis flipping at its own period, the inner loop's attitude overshoots its 45 deg tilt limit at
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


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="known gap: the arm's linear shield model does not bound the real arm near "
                                       "its joint limits (see the module docstring)")
def test_arm_at_full_torque_from_rest_stays_inside_its_joint_range():
    cfg = load_config("configs/arm.yaml")
    env = make_env(cfg, parse_randomization({}), 300)  # the nominal plant: no noise, latency or push
    start = {"qpos": [-0.2, -0.2], "qvel": [0.0, 0.0]}
    assert _shielded_violations(cfg, env, lambda t: np.float32([1.0, 1.0]), 0, 300, start) == 0


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="known gap: the quadrotor's inner loop overshoots its tilt limit under "
                                       "flipping set-points (see the module docstring)")
def test_quadrotor_under_flipping_set_points_stays_inside_its_geofence():
    cfg = load_config("configs/quadrotor.yaml")
    env = gym.make(cfg.task.env_id, randomization=None, wind_scale=0.0, max_episode_steps=1000)
    signs, half_periods = np.array([1.0, -1.0, -1.0]), np.array([28, 6, 23])
    policy = lambda t: np.float32(signs * np.where((t // half_periods) % 2, -1.0, 1.0))  # noqa: E731
    assert _shielded_violations(cfg, env, policy, 27, 1000) == 0
