"""An angle of a hinge that turns without limit is one heading, whatever turn the encoder counts: the env's
violation count reads it wrapped around the operating point, exactly as the linear shield model does."""

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
        assert abs(float(obs[0]) - k) <= 0.1 + 1e-6  # the observation is the encoder's count, as it comes
        assert info["cost"] == 0.0
        assert info["constraint_values"]["heading"] == pytest.approx(0.5 - abs(float(obs[0]) - k), abs=1e-5)
        for _ in range(20):  # turned hard one way: past the limit on every count of turns alike
            obs, _, _, _, info = env.step(np.array([1.0], np.float32))
        wrapped = math.remainder(float(obs[0]), 2.0 * math.pi)
        assert info["cost"] == (1.0 if wrapped > 0.5 else 0.0)
    env.close()
