"""A declared PID loop's feed-forward: the steady action that carries a load. helper-65's hoist PID, with nothing
to carry its weight but an integral that starts from 0 each episode, let the cage sag at every reset and then
broke the speed limit catching it; the format had no key for the hold action an LQR gets from its trim."""

from __future__ import annotations

import numpy as np
import yaml

MASS, GEAR, KP, KD = 50.0, 1200.0, 3.0, 0.7
HOLD = MASS * 9.81 / GEAR  # the normalized action that carries the cage's weight
MJCF = f"""<mujoco model="hoist_pid">
  <option timestep="0.005" gravity="0 0 -9.81"/>
  <worldbody>
    <body name="cage" pos="0 0 0">
      <joint name="lift" type="slide" axis="0 0 1" range="0 3" damping="0"/>
      <geom type="box" size="0.3 0.3 0.3" mass="{MASS}" contype="0" conaffinity="0"/>
    </body>
  </worldbody>
  <actuator><motor name="winch" joint="lift" gear="{GEAR}" ctrlrange="-1 1"/></actuator>
</mujoco>
"""


def _hoist(tmp_path, name: str, feedforward: float | None) -> str:
    (tmp_path / "hoist_pid.xml").write_text(MJCF)
    loop = {"action": 0, "measured": "z", "setpoint": 1.5, "rate": "vz", "kp": KP, "kd": KD}
    if feedforward is not None:
        loop["feedforward"] = feedforward
    doc = {
        "task": {"name": name, "env_id": f"sim2real/{name.title()}-v0"},
        "plant": {
            "mjcf": "hoist_pid.xml",
            "control_period": 0.02,
            "episode_steps": 200,
            "actuators": [{"name": "winch", "scale": 1.0}],
            "initial_state": {"qpos": {"lift": [1.5, 1.5]}},
            "observations": [{"name": "z", "joint": "lift"}, {"name": "vz", "joint": "lift", "quantity": "vel"}],
            "reward": [{"term": "alive", "weight": 1.0}],
            "kinematics": {"positions": ["z"], "velocities": ["vz"]},
            "constraints": [{"name": "band", "type": "box", "observations": ["z"], "low": [0.3], "high": [2.7]}],
            "shield_model": {"type": "linear", "operating_point": {"lift": 1.5}},
            "legacy": {"type": "pid", "loops": [loop]},
        },
        "randomization": {"train": {}, "reality": {}},
        "validation": {"enabled": False},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def _settles_at(tmp_path, name: str, feedforward: float | None) -> float:
    import envs
    from pipeline.training.rollout import make_env

    envs.register_task_file(_hoist(tmp_path, name, feedforward), check=True)
    env_id = f"sim2real/{name.title()}-v0"
    env, legacy = make_env(env_id, None), envs.legacy_controller(env_id)
    obs, _ = env.reset(seed=0)
    legacy.reset()
    for _ in range(150):  # 3 s: the loop settles in about one
        obs, *_ = env.step(np.asarray(legacy(obs[None].astype(np.float32)))[0])
    env.close()
    return float(obs[0])


def test_a_pid_loop_s_feedforward_carries_the_load_where_proportional_action_alone_sags(tmp_path, monkeypatch):
    monkeypatch.setenv("SIM2REAL_TASKS", "")
    sag = 1.5 - _settles_at(tmp_path, "hoistpd", None)
    assert abs(sag - HOLD / KP) < 0.01, sag  # kp alone carries the weight only by erring by HOLD / KP
    held = 1.5 - _settles_at(tmp_path, "hoistff", round(HOLD, 4))
    assert abs(held) < 0.002, held


def test_set_points_past_a_limit_are_told_by_config_check(tmp_path, monkeypatch):
    """helper-65 declared a hoist's targets over the whole shaft, past its band: `config --check` said ok with no
    note. The arm's reach targets widened past its joint_range are named, by target, limit and observation; the
    shipped arm's are inside."""
    from pathlib import Path

    from pipeline.config import load_config
    from pipeline.training.rollout import plant_notes

    root = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("SIM2REAL_TASKS", "")
    assert plant_notes(load_config(root / "configs" / "arm.yaml"))[1] == []
    doc = yaml.safe_load((root / "configs" / "arm.yaml").read_text())
    doc["task"] = {"name": "arm_wide", "env_id": "sim2real/ArmWide-v0"}
    doc["plant"]["mjcf"] = str(root / "configs" / doc["plant"]["mjcf"])
    doc["plant"]["targets"]["reach"]["high"] = [1.5, 1.4]  # q1's band is [-1.3, 1.3]
    (tmp_path / "arm_wide.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    (note,) = plant_notes(load_config(tmp_path / "arm_wide.yaml"))[1]
    assert note.startswith("plant.targets.reach sets q1_ref over [-1, 1.5], past the limits [-1.3, 1.3]"), note
    assert "constraint 'joint_range' on q1" in note and "with room to stop" in note, note
