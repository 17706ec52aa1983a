"""A declared plant with a `double_integrator` shield model is held to what its MJCF does.

The model says input k accelerates position k by `accel_per_action[k]` per unit action and nothing else moves
it. Declared plants drive their MJCF's motors directly: nothing compensates gravity (the quadrotor's inner loop
does, a MuJoCo slide does not). A stage whose vertical axis falls under gravity, whose positions are listed in
another order than its actuators, or whose declared acceleration is more than its motor gives, crossed its
floor 5, 162 and 181 times in a few reality episodes while `config --check` said ok. Each is now refused with
the key to change and the measured number; the stage declared as it is passes and the shield holds it.
"""

from __future__ import annotations

import json

import pytest
import yaml

from pipeline.cli import main as sim2real

# x and y slides, and a head on a vertical slide that gravity pulls down: 20 N on 2 kg (x: both carriages and
# the head move), 15 N on 1 kg, 10 N on 0.5 kg at full action.
MJCF = """<mujoco model="stage">
  <option timestep="0.005"/>
  <worldbody>
    <body name="carriage_x" pos="0 0 0.5">
      <joint name="sx" type="slide" axis="1 0 0" range="-0.7 0.7" damping="1"/>
      <geom type="box" size="0.05 0.3 0.02" mass="1.0" contype="0" conaffinity="0"/>
      <body name="carriage_y">
        <joint name="sy" type="slide" axis="0 1 0" range="-0.7 0.7" damping="1"/>
        <geom type="box" size="0.05 0.05 0.02" mass="0.5" contype="0" conaffinity="0"/>
        <body name="head">
          <joint name="sz" type="slide" axis="0 0 1" range="-0.4 0.4" damping="1"/>
          <geom type="sphere" size="0.03" mass="0.5" contype="0" conaffinity="0"/>
        </body>
      </body>
    </body>
  </worldbody>
  <actuator>
    <motor name="mx" joint="sx" gear="20" ctrlrange="-1 1"/>
    <motor name="my" joint="sy" gear="15" ctrlrange="-1 1"/>
    <motor name="mz" joint="sz" gear="10" ctrlrange="-1 1"/>
  </actuator>
</mujoco>
"""
TRUE_ACCEL = [10.0, 15.0, 20.0]  # gear / moved mass (the first physics step's damping aside)


def stage(tmp_path, name: str, mjcf: str = MJCF, push: dict | None = None, **edits) -> str:
    """The stage's YAML, as a user writes it; `edits` replace plant keys (kinematics, shield_model) or shield's;
    `push`: the reality set's push."""
    (tmp_path / "stage.xml").write_text(mjcf)
    plant = {
        "mjcf": "stage.xml",
        "control_period": 0.02,
        "episode_steps": 200,
        "actuators": [{"name": n, "scale": 1.0} for n in ("mx", "my", "mz")],
        "targets": {"goal": {"low": [-0.3, -0.3, -0.1], "high": [0.3, 0.3, 0.1], "hold_s": [1.0, 2.0]}},
        "initial_state": {"qpos": {"sx": [-0.1, 0.1], "sy": [-0.1, 0.1]}},
        "observations": [{"name": n, "joint": j} for n, j in (("x", "sx"), ("y", "sy"), ("z", "sz"))]
        + [{"name": n, "joint": j, "quantity": "vel"} for n, j in (("vx", "sx"), ("vy", "sy"), ("vz", "sz"))]
        + [{"name": f"{a}_ref", "target": "goal", "index": i} for i, a in enumerate("xyz")],
        "reward": [
            {"term": "alive", "weight": 1.0},
            {
                "term": "tracking",
                "observations": ["x", "y", "z"],
                "targets": ["x_ref", "y_ref", "z_ref"],
                "weight": -1.0,
                "clip": 1.0,
            },
        ],
        "termination": [{"observation": "x", "abs_above": 0.68}],
        "kinematics": {"positions": ["x", "y", "z"], "velocities": ["vx", "vy", "vz"]},
        "constraints": [
            {"name": "workspace", "type": "box", "observations": ["x", "y"], "low": [-0.5, -0.5], "high": [0.5, 0.5]},
            {"name": "floor", "type": "halfspace", "a": {"z": -1.0}, "b": 0.3},
        ],
        "shield_model": {"type": "double_integrator", "accel_per_action": TRUE_ACCEL},
        "legacy": {
            "type": "pid",
            "loops": [
                {"action": i, "measured": a, "setpoint": f"{a}_ref", "rate": f"v{a}", "kp": 2.0, "kd": 0.3}
                for i, a in enumerate("xyz")
            ],
        },
    }
    shield = {
        "enabled": True,
        "margin": 0.01,
        "brake_fraction": 0.3,
        "input_gain_error": 0.2,
        "disturbance_accel": [0.5, 0.5, 10.5],
    }  # z: gravity, 9.81
    for key, value in edits.items():
        (shield if key in shield else plant)[key] = value
    doc = {
        "task": {"name": name, "env_id": f"sim2real/{name.capitalize()}-v0"},
        "plant": plant,
        "randomization": {
            "train": {"actuator_gain": {m: {"dist": "uniform", "low": 0.9, "high": 1.1} for m in ("mx", "my", "mz")}},
            "reality": {
                "actuator_gain": {m: {"dist": "uniform", "low": 0.9, "high": 1.05} for m in ("mx", "my", "mz")},
                "latency_steps": {"low": 0, "high": 1},
                **({"push": push} if push else {}),
            },
        },
        "shield": shield,
        "validation": {"enabled": False},
        "shadow": {"episodes": 2, "domains": "reality"},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


@pytest.mark.parametrize(
    "edits,key,number",
    [
        ({"disturbance_accel": [0.5, 0.5, 0.5]}, "shield.disturbance_accel[2]", "9.7"),  # gravity on z uncovered
        (
            {"kinematics": {"positions": ["z", "x", "y"], "velocities": ["vz", "vx", "vy"]}},
            "plant.kinematics.positions[0]",
            "19.",
        ),  # input 2 moves the first position listed
        (
            {"shield_model": {"type": "double_integrator", "accel_per_action": [100.0, 15.0, 20.0]}},
            "plant.shield_model.accel_per_action[0]",
            "declare 9.9",
        ),  # ten times the motor
    ],
)
def test_a_double_integrator_the_mjcf_does_not_follow_is_refused_with_its_key(
    tmp_path, capsys, monkeypatch, edits, key, number
):
    monkeypatch.setenv("SIM2REAL_TASKS", "")
    name = f"stage{abs(hash(key)) % 10**6}"
    assert sim2real(["config", "--check", stage(tmp_path, name, **edits)]) == 2
    err = capsys.readouterr().err
    assert key in err and number in err and "Traceback" not in err, err


def test_the_stage_declared_as_it_is_passes_and_the_shield_holds_its_floor(tmp_path, capsys, monkeypatch):
    """Gravity declared as the z disturbance it is (the model has no inner loop compensating it): the check
    passes, and the adversary and bang-bang stay above the floor on reality, which the shield is needed for."""
    monkeypatch.setenv("SIM2REAL_TASKS", "")
    path = stage(tmp_path, "stagegood")
    assert sim2real(["config", "--check", path]) == 0, capsys.readouterr().err
    capsys.readouterr()
    runs = {}
    for policy, shield in (("adversarial", []), ("bang_bang", []), ("adversarial", ["--no-shield"])):
        assert sim2real(
            ["eval", "--config", path, "--policy", policy, "--domains", "reality", "--episodes", "4", "--json", *shield]
        ) in (0, 1)
        runs[(policy, bool(shield))] = json.loads(capsys.readouterr().out)["violations"]
    assert runs[("adversarial", False)] == 0 and runs[("bang_bang", False)] == 0, runs
    assert runs[("adversarial", True)] > 0, runs  # without the shield the adversary does cross: the test can fail


LAGGED = (
    MJCF.replace(
        '<motor name="mx" joint="sx" gear="20" ctrlrange="-1 1"/>',
        '<general name="mx" joint="sx" gear="20" ctrlrange="-1 1" dyntype="filter" dynprm="0.1"/>',
    )
    .replace(
        '<motor name="my" joint="sy" gear="15" ctrlrange="-1 1"/>',
        '<general name="my" joint="sy" gear="15" ctrlrange="-1 1" dyntype="filter" dynprm="0.1"/>',
    )
    .replace(
        '<motor name="mz" joint="sz" gear="10" ctrlrange="-1 1"/>',
        '<general name="mz" joint="sz" gear="10" ctrlrange="-1 1" dyntype="filter" dynprm="0.1"/>',
    )
)


def test_an_actuator_lag_is_read_from_the_mjcf_and_a_push_from_the_body_it_pushes(tmp_path, capsys, monkeypatch):
    """Actuators with a 0.1 s first-order filter: declared with that response time the stage passes (its gain
    is read with the lag settled, from rest: damping and the joint stops a 0.3 s window reached made a right
    declaration fail before); declared 0.05 s it is refused (a gain fitted to the wrong lag passed and crossed
    the floor). An 8 N push on the 0.5 kg head gives it 16 m/s^2, which the weakest plant cannot answer (the
    moving bodies' summed mass said 4, and the stage crossed its floor)."""
    monkeypatch.setenv("SIM2REAL_TASKS", "")
    lagged = {"shield_model": {"type": "double_integrator", "accel_per_action": TRUE_ACCEL, "response_time_s": 0.1}}
    assert sim2real(["config", "--check", stage(tmp_path, "stagelag", mjcf=LAGGED, **lagged)]) == 0, (
        capsys.readouterr().err
    )
    capsys.readouterr()
    short = {"shield_model": {"type": "double_integrator", "accel_per_action": TRUE_ACCEL, "response_time_s": 0.05}}
    assert sim2real(["config", "--check", stage(tmp_path, "stageshortlag", mjcf=LAGGED, **short)]) == 2
    err = capsys.readouterr().err
    assert "plant.shield_model.response_time_s" in err and "declare 0.1" in err, err
    push = {"body": "head", "max_force": 8.0, "probability": 0.05, "duration_steps": 5, "axes": ["z"]}
    assert sim2real(["config", "--check", stage(tmp_path, "stagepush", push=push)]) == 2
    err = capsys.readouterr().err
    assert "randomization.reality.push.max_force" in err and "a push gives 15.8" in err, err  # 16, damped 1 step


def test_sensor_and_site_observations_are_of_the_state_the_step_reached(tmp_path, monkeypatch):
    """mj_step computes sensors and sites before it integrates: read after it, they were one physics step older
    than the joints' own observations. A jointpos sensor and a site on the head now read what the joint does."""
    import gymnasium as gym
    import numpy as np

    import envs

    monkeypatch.setenv("SIM2REAL_TASKS", "")
    mjcf = MJCF.replace(
        '<geom type="sphere" size="0.03" mass="0.5" contype="0" conaffinity="0"/>',
        '<geom type="sphere" size="0.03" mass="0.5" contype="0" conaffinity="0"/><site name="tip" pos="0 0 0"/>',
    ).replace("</actuator>", '</actuator>\n  <sensor><jointpos name="zpos" joint="sz"/></sensor>')
    path = stage(tmp_path, "stagesensed", mjcf=mjcf)
    doc = yaml.safe_load(open(path))
    doc["plant"]["observations"] += [
        {"name": "z_sensed", "sensor": "zpos"},
        {"name": "z_site", "site": "tip", "axis": 2},
    ]
    with open(path, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    spec = envs.register_task_file(path, check=True)
    env = gym.make(spec.env_id)
    env.reset(seed=0)
    for action in ([0.0, 0.0, 1.0], [0.0, 0.0, -1.0], [0.5, -0.5, 1.0]):
        obs = env.step(np.array(action, np.float32))[0]
        assert obs[9] == obs[2], (obs[9], obs[2])  # jointpos sensor == the joint
        assert abs(float(obs[10]) - (0.5 + float(obs[2]))) < 1e-6  # the site: the carriage's 0.5 m plus z
    env.close()


def test_a_start_past_a_limit_is_drawn_again_and_the_check_says_so(tmp_path, capsys, monkeypatch):
    """A start outside a constraint is a violation before any action, which no shield can prevent (an outside
    user's spring-driven link, its two joints' boxes drawn independently, started past its deflection limit and
    the shield was blamed): reset draws such a start again, `config --check` says how many, and a box with no
    start inside is refused by its key. A box inside the limits draws exactly what it drew before."""
    import gymnasium as gym
    import numpy as np
    from gymnasium.utils import seeding

    import envs

    monkeypatch.setenv("SIM2REAL_TASKS", "")
    wide = stage(tmp_path, "stagewide", initial_state={"qpos": {"sx": [-0.65, 0.65], "sy": [-0.1, 0.1]}})
    assert sim2real(["config", "--check", wide]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "note: " in out and "starts drawn from plant.initial_state lie past a limit (workspace by up to" in out
    env = gym.make(envs.register_task_file(wide, check=True).env_id)
    xs = []
    for seed in range(300):
        obs, info = env.reset(seed=seed)
        assert info["cost"] == 0.0 and min(info["constraint_values"].values()) >= 0.0, (seed, obs)
        xs.append(float(obs[0]))
    assert max(np.abs(xs)) > 0.45  # the box is not clamped: starts near the limit stay
    env.close()
    # Inside the limits: the first draw, as before the redraw existed.
    inside = gym.make(envs.register_task_file(stage(tmp_path, "stageinside"), check=True).env_id)
    for seed in (0, 7):
        obs, _ = inside.reset(seed=seed)
        rng = seeding.np_random(seed)[0]
        assert np.float32(rng.uniform(-0.1, 0.1)) == obs[0] and np.float32(rng.uniform(-0.1, 0.1)) == obs[1]
    inside.close()
    outside = stage(tmp_path, "stageout", initial_state={"qpos": {"sx": [0.55, 0.65]}})
    assert sim2real(["config", "--check", outside]) == 2
    err = capsys.readouterr().err
    assert "plant.initial_state: none of 1000 starts" in err and "workspace" in err and "Traceback" not in err, err
