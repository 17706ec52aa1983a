"""A declaration's actuators as the env applies them (ctrl[actuator] = scale x action) reach every model built from
the MJCF: the LQR's and the shield's linearization, the synthesis's stepped plants and the calibration twin. The
crane declared three ways that are one plant: its own MJCF; half the gear with `scale: 2`; and that, with an
undeclared actuator listed before the declared one. Each must give the same models, gains and predictions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline.config import load_config

ROOT = Path(__file__).resolve().parents[2]
MOTOR = '<motor name="trolley_force" joint="rail" gear="60" ctrlrange="-1 1"/>'
HALF = '<motor name="trolley_force" joint="rail" gear="30" ctrlrange="-2 2"/>'
# An actuator the declaration does not drive (a swing damper, say), listed first: the declared one is actuator 1.
EXTRA = '<motor name="swing_damper" joint="swing" gear="5" ctrlrange="-1 1"/>'


def crane_variant(folder: Path, name: str, motors: str, scale: float):
    xml = (ROOT / "configs" / "crane_gantry.xml").read_text()
    assert MOTOR in xml
    (folder / f"{name}.xml").write_text(xml.replace(MOTOR, motors))
    doc = yaml.safe_load((ROOT / "configs" / "crane.yaml").read_text())
    doc["task"] = {"name": name, "env_id": f"sim2real/{name.title().replace('_', '')}-v0"}
    doc["plant"]["mjcf"] = f"{name}.xml"
    doc["plant"]["actuators"][0]["scale"] = scale
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_config(path)


@pytest.fixture(scope="module")
def cranes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("actuators")
    return [
        load_config(ROOT / "configs" / "crane.yaml"),
        crane_variant(folder, "crane_half_gear", HALF, 2.0),
        crane_variant(folder, "crane_extra_motor", EXTRA + "\n    " + HALF, 2.0),
    ]


def test_the_lqr_and_the_shield_model_act_in_the_policy_s_units(cranes):
    import envs
    from pipeline.safety.shield_spec import linearize_mujoco

    models, gains = [], []
    for cfg in cranes:
        nominal = envs.nominal_model(cfg.task.env_id)
        states = sorted(nominal.obs_to_state)
        models.append(np.hstack(linearize_mujoco(nominal, states)[:2]))
        gains.append(envs.legacy_controller(cfg.task.env_id).gain)
    assert models[0].shape == (4, 5)  # one input column: the declared action, not every MJCF actuator
    for m, k in zip(models[1:], gains[1:]):
        np.testing.assert_allclose(m, models[0], rtol=1e-6, atol=1e-9)
        np.testing.assert_allclose(k, gains[0], rtol=1e-5)


def test_the_synthesis_plant_and_the_calibration_twin_step_as_the_env_does(cranes):
    """From one state under one action: the env, the synthesis's stepped plant and the twin land on the same state."""
    import envs
    from pipeline.calibration.twin import Twin
    from pipeline.safety.sampling import SteppedPlant

    x = np.array([0.1, 0.05, 0.2, -0.1])
    action = np.array([0.7])
    reached = []
    for cfg in cranes:
        nominal = envs.nominal_model(cfg.task.env_id)
        states = sorted(nominal.obs_to_state)
        cols = [nominal.obs_to_state[o] for o in states]
        qcols = {i: j for j, (kind, i) in enumerate(cols) if kind == "qpos"}
        vcols = {i: j for j, (kind, i) in enumerate(cols) if kind == "qvel"}
        plant = SteppedPlant(nominal, cfg.randomization["reality"], qcols, vcols, len(states)).step(x, action)
        twin = Twin(cfg.task.env_id)
        obs = np.zeros((1, 5))
        obs[0, states] = x
        predicted = twin.predict({}, twin.initial_states(obs), action[None, None, :])[0, 0]
        np.testing.assert_allclose(predicted, plant, rtol=1e-9, atol=1e-12)
        reached.append(plant)
    for r in reached[1:]:
        np.testing.assert_allclose(r, reached[0], rtol=1e-9, atol=1e-12)
    assert abs(reached[0][2] - x[2]) > 0.01  # the action moved the trolley: a zero B would not pass
