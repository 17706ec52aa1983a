"""shield.json schema: validation names the bad key, round trip, and the edge import rule."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import numpy as np
import pytest

from shield.spec import ShieldSpec, ShieldSpecError
from tests.helpers.shield_specs import planar_double_integrator


def test_round_trip_through_a_file(tmp_path):
    spec = ShieldSpec.from_dict(planar_double_integrator(latency_steps=1, response_time_s=0.05))
    path = tmp_path / "shield.json"
    spec.save(path)
    again = ShieldSpec.load(path)
    assert again.to_dict() == spec.to_dict()
    np.testing.assert_array_equal(again.linear_model().A, spec.linear_model().A)


@pytest.mark.parametrize(
    "edit,key",
    [
        (lambda d: d.pop("dt"), "dt"),
        (lambda d: d.update(bogus=1), "bogus"),
        (lambda d: d.update(schema_version=9), "schema_version"),
        (lambda d: d.update(action_low=[-1.0]), "action_low"),
        (lambda d: d["constraints"][2].update(radius=-1.0), "constraints[2].radius"),
        (lambda d: d["constraints"][0].update(type="donut"), "constraints[0].type"),
        (lambda d: d["constraints"][1].update(a=[1.0, 1.0]), "constraints[1].a"),
        (lambda d: d["constraints"][3].update(gain=0.0), "constraints[3].gain"),
        (lambda d: d["constraints"][0].update(index=[0, 9]), "constraints[0].index[1]"),
        (lambda d: d["kinematics"].update(brake_accel=[1.0, float("nan")]), "kinematics.brake_accel[1]"),
        (lambda d: d["kinematics"].update(brake_accel=[1.0, [2.0, 0.0]]), "kinematics.brake_accel[1]"),
        (lambda d: d["kinematics"].update(brake_accel=[1.0, [2.0, 1.0, 3.0]]), "kinematics.brake_accel[1]"),
        (lambda d: d["kinematics"].update(brake_accel=[1.0]), "kinematics.brake_accel"),
        (lambda d: d["model"].update(gain_scaled_accel=[9.81]), "model.gain_scaled_accel"),
        (lambda d: d["model"].update(accel_per_action=[[1.0, 0.0]]), "model.accel_per_action"),
        (lambda d: d.update(latency_steps=-1), "latency_steps"),
        (lambda d: d.update(latency_steps=1, latency_min_steps=2), "latency_min_steps"),
        (lambda d: d.update(fallback_action=[2.0, 0.0]), "fallback_action[0]"),
        (lambda d: d.update(push_velocity=[0.1]), "push_velocity"),
        (lambda d: d.update(push_velocity=[0.1, -0.2]), "push_velocity[1]"),
        (lambda d: d.update(push_velocity=[0.1, float("inf")]), "push_velocity[1]"),
        (lambda d: d.update(angles=[1]), "angles"),
        (lambda d: d.update(angles={"index": [9]}), "angles.index[0]"),
        (lambda d: d.update(angles={"index": [1, 1]}), "angles.index"),
        (
            lambda d: (
                d.update(obs_dim=5, angles={"index": [4]}),
                d["constraints"][1].update(a=[1.0, 1.0, 0.0, 0.0, 0.0]),
            ),
            "angles.index",
        ),  # entry 4 is observed but not in state_index
        (lambda d: d.update(angles={"index": [1], "center": [float("nan")]}), "angles.center[0]"),
        (lambda d: d.update(angles={"index": [1], "center": [0.0, 1.0]}), "angles.center"),
        (lambda d: d.update(angles={"index": [1], "centre": [0.0]}), "angles.centre"),
        (lambda d: d.update(input_gain_range=[0.7]), "input_gain_range"),
        (lambda d: d.update(input_gain_range=[1.1, 1.2]), "input_gain_range"),  # nominal itself outside it
        (
            lambda d: d.update(input_gain_error=0.2, input_gain_range=[0.7, 1.1]),
            "input_gain_range",
        ),  # beyond 1 +- error
    ],
)
def test_invalid_spec_names_the_key(edit, key):
    d = copy.deepcopy(planar_double_integrator())
    edit(d)
    with pytest.raises(ShieldSpecError) as err:
        ShieldSpec.from_dict(d)
    assert key in str(err.value)


def test_angles_round_trip_and_the_builder_declares_exactly_the_hinges_that_turn_without_limit():
    d = planar_double_integrator()
    d["angles"] = {"index": [1], "center": [0.5]}
    spec = ShieldSpec.from_dict(d)
    assert spec.angles == [(1, 0.5)]
    assert ShieldSpec.from_dict(spec.to_dict()).to_dict() == spec.to_dict()
    d["angles"] = {"index": [1]}
    assert ShieldSpec.from_dict(d).angles == [(1, 0.0)]  # the center defaults to 0
    assert "angles" not in ShieldSpec.from_dict(planar_double_integrator()).to_dict()

    from pipeline.config import load_config
    from pipeline.safety.shield_spec import build_shield_spec

    # The cart-pole's pole hinge has no range (it can fall and spin round); the arm's joints have ranges and
    # the quadrotor's shield state has no angle: their specs are what they were.
    assert build_shield_spec(load_config("configs/cartpole.yaml"))["angles"] == {"index": [1], "center": [0.0]}
    for task in ("arm", "quadrotor"):
        assert "angles" not in build_shield_spec(load_config(f"configs/{task}.yaml"))


def test_load_reports_unreadable_and_non_json_files(tmp_path):
    with pytest.raises(ShieldSpecError, match="cannot read"):
        ShieldSpec.load(tmp_path / "missing.json")
    bad = tmp_path / "shield.json"
    bad.write_bytes(b"\x80\x04not json")
    with pytest.raises(ShieldSpecError, match="not valid JSON"):
        ShieldSpec.load(bad)
    bad.write_text(json.dumps({"schema_version": 1}))
    with pytest.raises(ShieldSpecError, match="shield.json: .*obs_dim"):
        ShieldSpec.load(bad)


def test_double_integrator_model_integrates_a_constant_acceleration():
    spec = ShieldSpec.from_dict(planar_double_integrator())  # no lag: exact for constant acceleration
    m = spec.linear_model()
    x = m.A @ np.array([0.0, 0.0, 1.0, 0.0]) + m.B @ np.array([0.5, 0.0]) + m.c
    dt, a = spec.dt, 2.0  # 0.5 x 4 m/s^2
    # 50 semi-implicit Euler substeps: p = v dt + a dt^2 (1 + 1/50) / 2
    np.testing.assert_allclose(x, [dt + a * dt * dt * (1 + 1 / 50) / 2, 0.0, 1.0 + a * dt, 0.0], rtol=1e-12)


def test_directional_braking_round_trips_and_the_weaker_direction_is_the_symmetric_figure():
    d = planar_double_integrator()
    d["kinematics"]["brake_accel"] = [2.5, [3.0, 0.5]]  # y: 3.0 toward -y, 0.5 toward +y
    spec = ShieldSpec.from_dict(d)
    assert spec.brake_accel_pairs == [(2.5, 2.5), (3.0, 0.5)] and spec.brake_accel == [2.5, 0.5]
    assert spec.to_dict()["kinematics"]["brake_accel"] == [2.5, [3.0, 0.5]]
    assert ShieldSpec.from_dict(spec.to_dict()).brake_accel_pairs == spec.brake_accel_pairs


@pytest.mark.parametrize("tau", [0.0, 0.1])
@pytest.mark.parametrize("scale", [0.8, 1.0, 1.25])
def test_gain_scaled_acceleration_is_the_model_of_a_plant_whose_gain_scales_its_compensation(scale, tau):
    """A vertical axis whose inner loop adds g for the nominal mass: a plant with gain/mass r feels r (4 u + g) - g.

    The input-gain case at scale r must be exactly the double integrator of that plant:
    A, r B and offset(r) equal the model built with accel r x 4 per action and offset (r - 1) g.
    """
    from shield.spec import double_integrator_model

    d = planar_double_integrator(response_time_s=tau)
    d["model"]["gain_scaled_accel"] = [0.0, 9.81]
    m = ShieldSpec.from_dict(d).linear_model()
    plant = double_integrator_model(
        [0, 1, 2, 3], [0, 1], [2, 3], scale * np.diag([4.0, 4.0]), np.array([0.0, (scale - 1.0) * 9.81]), tau, d["dt"]
    )
    np.testing.assert_allclose(m.A, plant.A, atol=1e-12)
    np.testing.assert_allclose(scale * m.B, plant.B, atol=1e-12)
    np.testing.assert_allclose(m.offset(scale), plant.c, atol=1e-12)
    z0 = plant.internal_init if tau else np.zeros(0)
    np.testing.assert_allclose(m.initial_internal(scale), z0, atol=1e-12)
    if scale == 1.0:  # the nominal plant's gravity is compensated exactly: no drift
        np.testing.assert_array_equal(m.offset(1.0), np.zeros(len(m.c)))


def test_importing_the_shield_pulls_in_no_training_stack():
    code = (
        "import shield.cbf, shield.spec, shield.fallback, sys; "
        "print([m for m in ('torch','ray','mujoco','gymnasium','prefect','scipy','pydantic','yaml') if m in "
        "sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_push_velocity_makes_every_row_brake_from_that_much_more_speed():
    """A spec with push_velocity k: the barrier at speed v is the one without it at v + k along each row's normal
    (latency 0, no lag: the barrier is read on the observed state). Round trip keeps it; absent, nothing changes."""
    from shield.cbf import CbfShield

    plain = planar_double_integrator()
    kicked = dict(plain, push_velocity=[0.3, 0.0])
    assert ShieldSpec.from_dict(kicked).to_dict()["push_velocity"] == [0.3, 0.0]
    assert "push_velocity" not in ShieldSpec.from_dict(plain).to_dict()
    toward_wall = np.float32([1.2, -1.5, 0.8, 0.0])  # moving at +x toward the fence's x = 2 wall
    _, with_kick = CbfShield(ShieldSpec.from_dict(kicked)).filter(toward_wall, np.zeros(2, np.float32))
    _, faster = CbfShield(ShieldSpec.from_dict(plain)).filter(
        toward_wall + np.float32([0, 0, 0.3, 0]), np.zeros(2, np.float32)
    )
    _, same = CbfShield(ShieldSpec.from_dict(plain)).filter(toward_wall, np.zeros(2, np.float32))
    wall = 1  # info["h"] per constraint: the diagonal wall x + y <= 3, closed on along x
    assert with_kick["h"][wall] == pytest.approx(faster["h"][wall], abs=1e-6)  # (obs are float32)
    assert with_kick["h"][wall] < same["h"][wall] - 0.05


def test_a_measured_gain_range_is_the_gain_cases_and_round_trips():
    """`input_gain_range` (what synthesis measured, low and high): its two ends are the CBF's gain cases, not
    1 +- input_gain_error; a spec without it reads as before."""
    from shield.cbf import CbfShield

    d = dict(planar_double_integrator(input_gain_error=0.4), input_gain_range=[0.6, 1.1])
    spec = ShieldSpec.from_dict(d)
    assert spec.gain_scales() == [0.6, 1.1] and spec.to_dict()["input_gain_range"] == [0.6, 1.1]
    assert ShieldSpec.from_dict(spec.to_dict()).to_dict() == spec.to_dict()
    assert ShieldSpec.from_dict(planar_double_integrator(input_gain_error=0.4)).gain_scales() == [0.6, 1.4]
    assert "input_gain_range" not in ShieldSpec.from_dict(planar_double_integrator()).to_dict()
    assert CbfShield(d)._rows._scales.ravel().tolist() == [0.6, 1.1]
