"""An angle of a hinge that turns without limit is one heading, whatever turn the encoder counts: the env observes
it wrapped around the operating point, exactly as the linear shield model reads it, so the policy, the legacy
controller and the violation count see the heading it is; the bundle's contract says so, and the edge wraps a
plant's multi-turn reading the same way before the policy sees it."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import yaml

# A turntable on an unlimited hinge, a motor on it, its heading kept within +-0.5 rad.
MJCF = """<mujoco model="turntable">
  <option timestep="0.005"/>
  <worldbody>
    <body name="table">
      <joint name="yaw" type="hinge" axis="0 0 1" damping="0.5"/>
      <geom type="cylinder" size="0.3 0.02" mass="2.0" contype="0" conaffinity="0"/>
    </body>
  </worldbody>
  <actuator><motor name="drive" joint="yaw" gear="2" ctrlrange="-1 1"/></actuator>
</mujoco>
"""


def _turntable(tmp_path, name: str, start: tuple[float, float]) -> str:
    (tmp_path / "turntable.xml").write_text(MJCF)
    doc = {
        "task": {"name": name, "env_id": f"sim2real/{name.capitalize()}-v0"},
        "plant": {
            "mjcf": "turntable.xml",
            "control_period": 0.02,
            "episode_steps": 50,
            "actuators": [{"name": "drive", "scale": 1.0}],
            "initial_state": {"qpos": {"yaw": list(start)}},
            "observations": [{"name": "th", "joint": "yaw"}, {"name": "w", "joint": "yaw", "quantity": "vel"}],
            "reward": [{"term": "alive", "weight": 1.0}],
            "kinematics": {"positions": ["th"], "velocities": ["w"]},
            "constraints": [{"name": "heading", "type": "box", "observations": ["th"], "low": [-0.5], "high": [0.5]}],
            "shield_model": {"type": "linear", "operating_point": {"yaw": 0.0}},
            "legacy": {"type": "lqr", "q": [1.0, 0.1], "r": [1.0]},
        },
        "randomization": {"train": {}, "reality": {}},
        "validation": {"enabled": False},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


@pytest.mark.parametrize("turns", [0, 1, -2])
def test_a_heading_counted_turns_away_is_the_same_heading(tmp_path, monkeypatch, turns):
    import envs

    monkeypatch.setenv("SIM2REAL_TASKS", "")
    k = 2.0 * math.pi * turns
    env = gym.make(envs.register_task_file(_turntable(tmp_path, f"turn{turns + 5}", (k - 0.1, k + 0.1))).env_id)
    for seed in range(5):
        obs, info = env.reset(seed=seed)
        assert abs(float(obs[0])) <= 0.1 + 1e-6  # the heading it is, not the encoder's count of turns
        assert info["cost"] == 0.0
        assert info["constraint_values"]["heading"] == pytest.approx(0.5 - abs(float(obs[0])), abs=1e-5)
        for _ in range(20):  # turned hard one way: past the limit on every count of turns alike
            obs, _, _, _, info = env.step(np.array([1.0], np.float32))
        assert -math.pi < float(obs[0]) <= math.pi + 1e-6
        assert info["cost"] == (1.0 if float(obs[0]) > 0.5 else 0.0)
    env.close()


def test_a_wheel_counted_turns_away_is_observed_as_the_angle_it_is_and_the_edge_agrees(tmp_path, monkeypatch):
    """helper-70's reaction wheel: the plant sends its encoder's count, 16 turns on; the policy behind the shield
    changed 6.1 % of its steps there against 0.03 % at the same angle 16 turns back. The contract says the heading
    is observed wrapped around 0, and the edge wraps the plant's reading before the policy and its history see
    it: the same action as at the angle it is, and bitwise the same where the reading needs no wrapping."""
    import envs
    from envs.registry import describe_io
    from shield.contract import observation_wraps
    from shield.policy import OnnxPolicy
    from tests.helpers.serve_bundles import tiny_policy_onnx

    monkeypatch.setenv("SIM2REAL_TASKS", "")
    env_id = envs.register_task_file(_turntable(tmp_path, "wheel", (-0.1, 0.1))).env_id
    io, _ = describe_io(env_id)
    assert io["observations"][0]["wraps_around"] == 0.0 and "wraps_around" not in io["observations"][1]
    wraps = observation_wraps(io)
    assert wraps == [(0, 0.0)]
    onnx = tiny_policy_onnx(0, obs_dim=2, act_dim=1)
    edge, bare = OnnxPolicy(onnx, wraps=wraps), OnnxPolicy(onnx)
    rng = np.random.default_rng(0)
    for _ in range(50):
        heading, rate = rng.uniform(-math.pi, math.pi), rng.normal()
        seen = np.array([heading, rate], np.float32)
        assert np.array_equal(edge.act(seen), bare.act(seen))  # in range: untouched
        counted = np.array([heading + 2.0 * math.pi * rng.integers(-40, 40), rate], np.float32)
        assert np.allclose(edge.act(counted), bare.act(seen), atol=1e-4)
        assert np.allclose(edge(counted[None]), bare(seen[None]), atol=1e-4)
