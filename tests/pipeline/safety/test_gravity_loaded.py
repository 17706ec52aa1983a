"""A plant that holds still only under a steady action (an arm lifting against gravity, a hoist): the action that
holds its operating point is computed from the MJCF and carried by every model built on it, and the shield keeps
it inside its limits with no number set by hand. The plant: a 1 kg, 0.8 m link in a vertical plane on a 10 N m
shoulder motor, linearized 0.5 rad above horizontal (tests/pipeline/safety/plants/arm_vertical.*)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import yaml

HERE = Path(__file__).resolve().parent
PLANT = HERE / "plants" / "arm_vertical.yaml"
# m g l_c cos(q_op) / gear: the uniform link's centre of mass is 0.4 m out; the motor gives 10 N m per unit action.
TRIM = 1.0 * 9.81 * 0.4 * math.cos(0.5) / 10.0
WRIST_OFF = {"shoulder": 0.5, "wrist": 0.3}  # a free link off its hanging rest: nothing holds it there


def test_the_action_that_holds_the_operating_point_is_the_closed_form_one_and_every_model_carries_it():
    """The trim is m g l cos(q) / gear; the linear model holds the operating point still under it (and only under
    it); the LQR, asked to stay where it is, answers with it."""
    import envs
    from pipeline.config import load_config
    from pipeline.safety.shield_spec import linearize_mujoco

    cfg = load_config(PLANT)
    nominal = envs.nominal_model(cfg.task.env_id)
    assert nominal.trim == pytest.approx((TRIM,), abs=1e-6)
    A, B, c = linearize_mujoco(nominal, [0, 1])
    x_op = np.array([0.5, 0.0])
    np.testing.assert_allclose(A @ x_op + B @ [TRIM] + c, x_op, atol=1e-9)
    assert abs((A @ x_op + c)[1]) > 0.1  # unpowered, the model lets the link fall: the trim is what holds it
    legacy = envs.legacy_controller(cfg.task.env_id)
    assert float(legacy(np.array([[0.5, 0.0, 0.5]], np.float32))[0, 0]) == pytest.approx(TRIM, abs=1e-6)


def test_a_pid_legacy_told_to_hold_adds_the_trim_the_mjcf_gives(tmp_path):
    """`feedforward: hold` is the action holding the operating point, computed as the lqr legacy and the shield take
    it: an outside user worked out a hoist's (m g / units_per_action) by hand, and a number outside the box is
    refused by its key."""
    import envs
    from pipeline.config import ConfigError, load_config

    doc = yaml.safe_load(PLANT.read_text())
    loop = {"action": 0, "measured": "q", "setpoint": "q_ref", "rate": "q_dot", "kp": 2.0, "kd": 0.3}
    (tmp_path / "arm_vertical.xml").write_text((HERE / "plants" / "arm_vertical.xml").read_text())
    for name, feedforward in (("arm_vertical_pid", "hold"), ("arm_vertical_pid_far", 1.5)):
        doc["task"] = {"name": name, "env_id": f"sim2real/{name.title().replace('_', '')}-v0"}
        doc["plant"] = {**doc["plant"], "mjcf": "arm_vertical.xml"}
        doc["plant"]["legacy"] = {"type": "pid", "loops": [{**loop, "feedforward": feedforward}]}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        if feedforward != "hold":
            with pytest.raises(ConfigError, match="feedforward"):
                load_config(tmp_path / f"{name}.yaml")
            continue
        legacy = envs.legacy_controller(load_config(tmp_path / f"{name}.yaml").task.env_id)
        at_rest = np.array([[0.5, 0.0, 0.5]], np.float32)  # q at q_ref, still: only the feedforward acts
        assert float(legacy(at_rest)[0, 0]) == pytest.approx(TRIM, abs=1e-6)


def test_dry_friction_on_the_driven_joint_leaves_the_trim_and_the_model_as_without_it(tmp_path):
    """Dry friction (frictionloss) is model error, left out of the linear model and of the holding action: at rest
    it absorbs part of any force, so no action balanced the load exactly, and a hoist with 20 N of it on its driven
    slide was refused as "not an equilibrium under any action" (0.378 N left at best)."""
    import envs
    from pipeline.config import load_config
    from pipeline.safety.shield_spec import linearize_mujoco

    xml = (HERE / "plants" / "arm_vertical.xml").read_text()
    assert 'damping="0.5" armature' in xml
    doc = yaml.safe_load(PLANT.read_text())
    models = []
    for name, friction in (("arm_vertical_dry", ' frictionloss="0.3"'), ("arm_vertical_smooth", "")):
        doc["task"] = {"name": name, "env_id": f"sim2real/{name.title().replace('_', '')}-v0"}
        doc["plant"] = {**doc["plant"], "mjcf": f"{name}.xml"}
        mjcf = xml.replace('damping="0.5" armature', f'damping="0.5"{friction} armature')
        (tmp_path / f"{name}.xml").write_text(mjcf)
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        nominal = envs.nominal_model(load_config(tmp_path / f"{name}.yaml").task.env_id)
        models.append((nominal.trim, linearize_mujoco(nominal, [0, 1])))
    (dry_trim, dry), (trim, smooth) = models
    assert dry_trim == pytest.approx(trim, abs=1e-9) and trim == pytest.approx((TRIM,), abs=1e-6)
    for a, b in zip(dry, smooth):
        np.testing.assert_allclose(a, b, atol=1e-9)


def test_a_gravity_loaded_arm_is_certified_and_its_shield_holds_every_policy_inside():
    """Synthesis certifies it with no number set by hand; the constant fallback is the holding action (a drive that
    let go would drop the link onto its stop); on reality the adversary and bang-bang get no violating step through
    the shield, and without it they cross the limits."""
    from pipeline.config import load_config
    from pipeline.evaluation.adversary import AdversarialPolicy, AdversaryParams
    from pipeline.evaluation.evaluate import evaluate, reference_policy
    from pipeline.safety.shield_spec import build_shield_spec
    from shield.spec import ShieldSpec

    cfg = load_config(PLANT)
    spec = build_shield_spec(cfg)
    assert spec["fallback_action"] == pytest.approx([TRIM], abs=1e-6)
    shield_spec = ShieldSpec.from_dict(spec)
    # The adversary's calm steps hold the link where it is (zero action would drop it, an attack calm is not).
    calm = AdversarialPolicy(shield_spec, params=AdversaryParams(start_step=3, strength=0.5))
    obs = np.array([[0.5, 0.0, 0.5]], np.float32)
    assert float(calm(obs)[0, 0]) == pytest.approx(TRIM, abs=1e-6)
    for _ in range(3):
        attack = float(calm(obs)[0, 0])
    assert attack in (pytest.approx(0.5 * (1 + TRIM), abs=1e-6), pytest.approx(0.5 * (-1 + TRIM), abs=1e-6))
    for name in ("adversarial", "bang_bang"):
        run = dict(domains="reality", episodes=8, seed=1)
        kept = evaluate(cfg, reference_policy(name, cfg, shield_spec, seed=1), **run, spec=shield_spec)
        bare = evaluate(cfg, reference_policy(name, cfg, shield_spec, seed=1), **run, shield=False)
        assert kept["violations"] == 0, (name, kept["constraints"])
        assert bare["violations"] > 0, name


def test_a_barrier_that_changes_much_of_legacy_says_which_position_its_model_error_crowds():
    """helper-52's lift arm: a certificate whose braking barrier changed more than CONSERVATIVE_SHARE of the legacy
    controller's steps crashed `shield synthesize` while saying so (it read the positions where the spec does not
    keep them). The line names the position and its model error over the weaker of its two brakings."""
    from pipeline.config import load_config
    from pipeline.safety.certificate import conservative_line, conservative_record
    from pipeline.safety.shield_spec import build_shield_spec

    cfg = load_config(PLANT)
    spec = build_shield_spec(cfg)
    assert "predictive" not in spec  # the braking barrier keeps this arm
    record = conservative_record(cfg, spec, {"episodes": 10, "intervention_rate": 0.4})
    (row,) = record["error_over_braking"]
    brake = spec["kinematics"]["brake_accel"][0]
    assert row["position"] == "q" and row["ratio"] == pytest.approx(spec["disturbance_accel"][0] / min(brake), abs=1e-3)
    assert "40.0%" in conservative_line(record) and "on q is" in conservative_line(record)


@pytest.mark.parametrize(
    "edit,needles",
    [
        # A weaker motor: holding the link 0.5 rad up takes 1.15x the action box.
        (lambda xml, doc: (xml.replace('gear="10"', 'gear="3"'), doc), ["beyond the action box", "'shoulder'"]),
        # A second, free link hanging off the first at 0.3 rad from vertical: gravity swings it, and no actuator
        # drives it.
        (
            lambda xml, doc: (
                xml.replace(
                    '<geom name="link"',
                    '<body name="tip" pos="0.8 0 0"><joint name="wrist" type="hinge" axis="0 -1 0"/><geom name="tip" '
                    'type="sphere" size="0.03" mass="0.2" pos="0 0 -0.3" contype="0" conaffinity="0"/></body>\n'
                    '      <geom name="link"',
                ),
                {**doc, "plant": {**doc["plant"], "shield_model": {"type": "linear", "operating_point": WRIST_OFF}}},
            ),
            ["not an equilibrium under any action", "'wrist'"],
        ),
    ],
    ids=["drive too weak", "unactuated joint"],
)
def test_an_operating_point_no_action_in_the_box_holds_is_refused_by_name(tmp_path, edit, needles):
    from pipeline.config import ConfigError, load_config

    xml, doc = edit((HERE / "plants" / "arm_vertical.xml").read_text(), yaml.safe_load(PLANT.read_text()))
    name = f"arm_vertical_{abs(hash(needles[0])) % 10**6}"
    doc["task"] = {"name": name, "env_id": f"sim2real/{name.title().replace('_', '')}-v0"}
    doc["plant"] = {**doc["plant"], "mjcf": f"{name}.xml"}
    if "wrist" in xml:  # every joint observed: the linear model's state is the whole plant's
        doc["plant"]["observations"] = doc["plant"]["observations"] + [
            {"name": "w", "joint": "wrist"},
            {"name": "w_dot", "joint": "wrist", "quantity": "vel"},
        ]
        doc["plant"]["legacy"] = {**doc["plant"]["legacy"], "q": [20.0, 1.0, 1.0, 0.1]}
    (tmp_path / f"{name}.xml").write_text(xml)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    for needle in needles:
        assert needle in str(err.value), str(err.value)
