"""Drives the shield's linear model must not misread (helper-53's belt-driven stage, tests/pipeline/safety/plants/
friction_stage.*): dry friction does not hide the drive from the linearization, and a drive with dynamics of its
own or an equality tying joints together is refused by name, not certified on a model of another plant."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

HERE = Path(__file__).resolve().parent
PLANT = HERE / "plants" / "friction_stage.yaml"


def test_dry_friction_does_not_hide_the_drive_from_the_linear_model():
    """At rest a 1 N frictionloss absorbs any force below it, so finite differences there saw a drive 12 times
    weaker than its 30 N (`config --check` then refused the stage, blaming a 30 m/s^2 model error). The model is
    the same as the stage's without dry friction, and the friction stays in the plant."""
    import envs
    from envs.linearization import linearize_control_step
    from pipeline.config import load_config

    cfg = load_config(PLANT)
    nominal = envs.nominal_model(cfg.task.env_id)
    a, b = linearize_control_step(nominal)
    assert nominal.model.dof_frictionloss[0] == 1.0  # the plant keeps its friction
    nominal.model.dof_frictionloss[0] = 0.0
    try:
        a0, b0 = linearize_control_step(nominal)
    finally:
        nominal.model.dof_frictionloss[0] = 1.0
    np.testing.assert_allclose(a, a0, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(b, b0, rtol=1e-9, atol=1e-12)
    # 30 N on 2.5 kg (carriage and reflected rotor) over one 20 ms period, less what the damping takes.
    assert b[1, 0] == pytest.approx(30.0 / 2.5 * 0.02, rel=0.05)


_FILTER = ('gaintype="fixed" gainprm="30"', 'dyntype="filter" dynprm="0.02" gaintype="fixed" gainprm="30"')
_ROTOR = (
    "  </worldbody>",
    '    <body name="rotor" pos="0 0 0.3"><joint name="motor" type="hinge" axis="0 0 1" damping="0.0001"/>'
    '<geom name="rotor" type="cylinder" size="0.02 0.01" mass="0.1" contype="0" conaffinity="0"/></body>\n'
    "  </worldbody>\n"
    '  <equality><joint name="belt" joint1="stage" joint2="motor" polycoef="0 0.02 0 0 0"/></equality>',
)


_FREE_ROTOR = (_ROTOR[0], _ROTOR[1].split("\n  <equality>")[0])


@pytest.mark.parametrize(
    "edits,observe_motor,needles",
    [
        ([_FILTER], False, ["actuator 'drive' has dynamics of its own", "dyntype='filter', time constant 0.02 s"]),
        ([_ROTOR], True, ["equality constraint 'belt' (joint) ties", "Model the coupling into one joint"]),
        ([_FREE_ROTOR], False, ["not observed: motor's position, motor's velocity"]),
    ],
    ids=["lagging drive", "belt as an equality", "a joint not observed"],
)
def test_a_drive_the_linear_model_cannot_read_is_refused_by_name(tmp_path, edits, observe_motor, needles):
    from pipeline.config import load_config
    from pipeline.safety.shield_spec import build_shield_spec

    xml = (HERE / "plants" / "friction_stage.xml").read_text()
    for old, new in edits:
        assert old in xml
        xml = xml.replace(old, new)
    doc = yaml.safe_load(PLANT.read_text())
    name = f"stage_{len(needles[0])}"
    doc["task"] = {"name": name, "env_id": f"sim2real/Stage{len(needles[0])}-v0"}
    doc["plant"]["mjcf"] = f"{name}.xml"
    if observe_motor:  # every joint observed
        doc["plant"]["observations"] += [
            {"name": "m", "joint": "motor"},
            {"name": "m_dot", "joint": "motor", "quantity": "vel"},
        ]
        doc["plant"]["legacy"]["q"] = [50.0, 1.0, 0.0, 0.0]
    (tmp_path / f"{name}.xml").write_text(xml)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(Exception) as err:
        build_shield_spec(load_config(path))
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_noise_on_a_position_no_limit_reads_is_not_held_to_the_margin(tmp_path):
    """helper-54's reaction-wheel pendulum: 0.01 rad of noise on the free wheel's angle, a position of the model that
    no constraint reads, was refused as beyond the (synthesized) margin. The margin absorbs the noise of the
    positions the limits read: the same noise on the tilt widens it to cover 3 sigma."""
    from pipeline.config import load_config
    from pipeline.safety.shield_spec import build_shield_spec

    path = HERE / "plants" / "reaction_wheel.yaml"
    spec = build_shield_spec(load_config(path))
    assert 3 * 0.01 > spec["margin"]  # the wheel angle's noise, at 3 sigma, is past the margin: and need not fit
    doc = yaml.safe_load(path.read_text())
    for name in ("train", "validation", "reality"):
        doc["randomization"][name]["obs_noise_std"] = [0.01, 0.0, 0.0, 0.0]  # on the tilt instead
    doc["plant"]["mjcf"] = str(HERE / "plants" / "reaction_wheel.xml")
    doc["task"] = {"name": "reaction_wheel_tilt", "env_id": "sim2real/ReactionWheelTilt-v0"}
    noisy = tmp_path / "tilt.yaml"
    noisy.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert build_shield_spec(load_config(noisy))["margin"] >= 3 * 0.01


def test_synthesis_measures_a_randomized_rotor_inertia_as_the_drive_it_weakens(tmp_path):
    """The stage's rotor is reflected onto the carriage as the joint's armature (0.5 of its 2.5 kg at nominal).
    Randomized on its own (`joint_armature`, 1-2x) the heaviest plant is 4.0 kg instead of 3.5 (carriage at 1.5x),
    and synthesis, which measures the drive on the sets' own plants, finds the input's effect lower by that ratio:
    no shield number is told about it."""
    from pipeline.config import load_config
    from pipeline.safety import synthesis

    doc = yaml.safe_load(PLANT.read_text())
    doc["plant"]["mjcf"] = str(PLANT.parent / doc["plant"]["mjcf"])
    lows = []
    for rotor in (None, {"stage": {"dist": "uniform", "low": 1.0, "high": 2.0}}):
        if rotor:
            for rset in doc["randomization"].values():
                rset["joint_armature"] = rotor
        path = tmp_path / f"stage{len(lows)}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        lows.append(synthesis.measure(load_config(path), seed=0).gain_range[0][0])
    assert lows[1] / lows[0] == pytest.approx((2.0 * 1.5 + 0.5) / (2.0 * 1.5 + 1.0), rel=0.02)
