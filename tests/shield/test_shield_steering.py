"""Keep-out zones credit passing (`kinematics.keepout_steering`, shield/barrier.py).

A plant moving sideways past a cylinder or sphere need not stop before it. The
keep-out row is then ``h = (r - R) - s^2 / (2 a) + (r^2 / R^2 - 1) q^2 / (2 a)``
(r: distance to the centre, s: closing speed, q: sideways speed, R: radius plus
margin). These tests show the closed form is exact for the motion it assumes,
that the shield no longer brakes a plant whose straight path clears the zone
while it still brakes one heading in, and that adversaries aiming at the zone,
skimming it or spiralling into it never get in.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.cli import main
from pipeline.config import load_config
from pipeline.safety.shield_spec import EnvelopeError, build_shield_spec
from shield.cbf import CbfShield
from shield.spec import ShieldSpec, ShieldSpecError
from tests.helpers.shield_specs import planar_double_integrator
from tests.pipeline.safety.test_envelope_check import ROOT, _variant
from tests.shield.test_shield_cbf import _rollout

PILLAR, RADIUS = np.array([0.5, -0.5]), 0.3


def _closest_approach(r0: float, s: float, q: float, a: float) -> float:
    """Closest distance to the centre of a point at r0 closing at s, sideways at q, braking radially at a (RK4)."""
    p, v = np.array([r0, 0.0]), np.array([-s, q])
    dt, closest = 1e-3 / max(1.0, abs(s) + abs(q)), r0

    def acc(p):
        return a * p / np.linalg.norm(p)

    for _ in range(200000):
        k1p, k1v = v, acc(p)
        k2p, k2v = v + 0.5 * dt * k1v, acc(p + 0.5 * dt * k1p)
        k3p, k3v = v + 0.5 * dt * k2v, acc(p + 0.5 * dt * k2p)
        k4p, k4v = v + dt * k3v, acc(p + dt * k3p)
        p = p + dt / 6 * (k1p + 2 * k2p + 2 * k3p + k4p)
        v = v + dt / 6 * (k1v + 2 * k2v + 2 * k3v + k4v)
        r = float(np.linalg.norm(p))
        closest = min(closest, r)
        if float(p @ v) > 0:  # moving away again: that was the closest approach
            break
    return closest


@settings(max_examples=40, deadline=None)
@given(r0=st.floats(1.05, 4.0), s=st.floats(0.05, 4.0), q=st.floats(0.0, 4.0))
def test_the_barrier_is_exact_for_radial_braking(r0, s, q):
    # R = 1, a = 1: h >= 0 exactly when the radially braked point stays outside R.
    a, R = 1.0, 1.0
    h = (r0 - R) - s * s / (2 * a) + (r0 * r0 / (R * R) - 1) * q * q / (2 * a)
    closest = _closest_approach(r0, s, q, a)
    if h > 1e-3:
        assert closest > R - 1e-4, (h, closest)
    elif h < -1e-3:
        assert closest < R + 1e-4, (h, closest)


@settings(max_examples=60, deadline=None)
@given(r=st.floats(0.35, 3.0), angle=st.floats(0, 6.28), s=st.floats(-3.0, 3.0), q=st.floats(-3.0, 3.0))
def test_the_shield_row_is_that_closed_form_at_the_state(r, angle, s, q):
    # No latency, lag or disturbance: the row at the observed state is exactly the formula (credit 0 inside R).
    # Hypothesis finds the far and near sides, and the edge between.
    n, t = np.array([np.cos(angle), np.sin(angle)]), np.array([-np.sin(angle), np.cos(angle)])
    obs = np.array([*(PILLAR + r * n), *(-s * n + q * t)], np.float32)
    o = obs.astype(np.float64)
    r, s, q = float(np.hypot(*(o[:2] - PILLAR))), -float((o[:2] - PILLAR) @ o[2:]) / r, 0.0
    q = float(np.linalg.norm(o[2:] + s * (o[:2] - PILLAR) / r))
    R, a = RADIUS + 0.02, 2.5
    # Far from the zone (stopping from the full speed takes under half the gap) the row skips the credit.
    far = (s * s + q * q) / (2 * a) <= 0.5 * (r - R)
    credit = 0.0 if far else max(r * r / (R * R) - 1, 0.0) * q * q / (2 * a)
    expected = (r - R) - max(s, 0.0) ** 2 / (2 * a) + credit
    shield = CbfShield(_spec(True))
    assert shield.barrier_values(obs)[0] == pytest.approx(expected, abs=1e-6)
    # Without the credit (what a violated row brakes on): the braking-distance form.
    uncredited = (r - R) - max(s, 0.0) ** 2 / (2 * a)
    assert shield.barrier_values(obs, steering=False)[0] == pytest.approx(uncredited, abs=1e-6)
    _, info = shield.filter(obs, np.zeros(2, np.float32))
    # What `filter` reports: that, or (on a step only the row without the credit accepts) the uncredited value.
    if info["h"][0] != pytest.approx(expected, abs=1e-6):
        assert info["h"][0] == pytest.approx(uncredited, abs=1e-6) and uncredited >= 0 and not info["intervened"]


def _spec(steering: bool, latency: int = 0, tau: float = 0.0, gain_error: float = 0.0) -> dict:
    spec = planar_double_integrator(latency, tau, margin=0.02, input_gain_error=gain_error, keepout_steering=steering)
    spec["constraints"] = [c for c in spec["constraints"] if c["name"] == "pillar"]  # the keep-out alone
    return spec


def test_a_path_that_clears_the_zone_is_not_braked_one_heading_in_is():
    # 0.45 m beside the pillar's centre moving along x at 2 m/s: the straight path clears R = 0.32.
    passing = np.array([*(PILLAR + [-0.8, 0.45]), 2.0, 0.0], np.float32)
    coast = np.zeros(2, np.float32)
    u_brake, info_brake = CbfShield(_spec(False)).filter(passing, coast)
    u_steer, info_steer = CbfShield(_spec(True)).filter(passing, coast)
    assert info_brake["intervened"] and u_brake[0] < 0  # the braking-distance row: stop before the pillar
    assert not info_steer["intervened"] and u_steer.tobytes() == coast.tobytes()
    # Heading straight in (no sideways speed) the rows are the same: bitwise the same brake.
    heading_in = np.array([*(PILLAR + [-0.8, 0.0]), 2.0, 0.0], np.float32)
    for action in ([0.0, 0.0], [1.0, 0.3], [-0.2, 1.0]):
        a = np.array(action, np.float32)
        u0, _ = CbfShield(_spec(False)).filter(heading_in, a)
        u1, _ = CbfShield(_spec(True)).filter(heading_in, a)
        assert u0.tobytes() == u1.tobytes()


def _closed_loop(spec: dict, start: np.ndarray, policy, steps: int, rng, latency: int) -> float:
    """Least clearance to the pillar (m) of the planar plant flown by `policy(obs)` through the shield;
    None where the start is outside the shield's safe set already (too fast to clear the zone: no guarantee)."""
    shield = CbfShield(spec)
    if np.min(CbfShield(spec).filter(start.astype(np.float32), np.zeros(2, np.float32))[1]["h"]) < 0:
        return None
    A, B, c = shield._A, shield._B * rng.uniform(1 - spec["input_gain_error"], 1 + spec["input_gain_error"]), shield._c
    x = np.concatenate([start, ShieldSpec.from_dict(spec).linear_model().initial_internal(1.0)])
    pending = [np.zeros(2)] * latency
    worst = np.inf
    for _ in range(steps):
        obs = (x[:4] + rng.normal(0, 0.002, 4)).astype(np.float32)
        u, _ = shield.filter(obs, np.asarray(policy(obs), np.float32))
        pending.append(u.astype(np.float64))
        x = A @ x + B @ pending.pop(0) + c
        x[2:4] += rng.uniform(-0.5, 0.5, 2) * spec["dt"]  # an unmodelled push each step
        worst = min(worst, float(np.hypot(*(x[:2] - PILLAR))) - RADIUS)
    return worst


def _toward(obs, sideways: float) -> np.ndarray:
    """Full action at the pillar's centre, turned by `sideways` of a right angle (skimming and spiralling)."""
    d = PILLAR - obs[:2]
    d = d / max(np.linalg.norm(d), 1e-9)
    t = np.array([-d[1], d[0]])
    u = (1 - abs(sideways)) * d + sideways * t
    return u / np.max(np.abs(u))


@pytest.mark.parametrize("latency,tau,gain_error", [(0, 0.0, 0.0), (2, 0.05, 0.3)])
def test_adversaries_aiming_at_skimming_or_spiralling_into_the_zone_never_get_in(latency, tau, gain_error):
    rng = np.random.default_rng(5 + latency)
    spec = _spec(True, latency, tau, gain_error)
    worst, flown = np.inf, 0
    for k in range(40):
        angle = rng.uniform(0, 2 * np.pi)
        position = PILLAR + rng.uniform(0.8, 1.6) * np.array([np.cos(angle), np.sin(angle)])
        # Already flying at 1.5-3 m/s on a line that grazes the zone: it misses the centre by 0-0.35 m.
        aim = PILLAR + rng.uniform(-0.35, 0.35) * np.array([-np.sin(angle), np.cos(angle)]) - position
        start = np.concatenate([position, rng.uniform(1.5, 3.0) * aim / np.linalg.norm(aim)])
        sideways = [0.0, 0.3, 0.6, -0.8][k % 4]
        clearance = _closed_loop(spec, start, lambda o, s=sideways: _toward(o, s), 120, rng, latency)
        if clearance is not None:
            worst, flown = min(worst, clearance), flown + 1
    assert flown >= 15 and worst > 0.0, (flown, worst)


@pytest.mark.parametrize("steering", [False, True])
def test_random_full_pushes_never_cross_any_constraint(steering):
    # test_shield_cbf.py's adversary on the whole planar spec (fences, wall, pillar), with and without the credit.
    rng = np.random.default_rng(11)
    spec = planar_double_integrator(
        latency_steps=2, response_time_s=0.05, margin=0.03, input_gain_error=0.3, keepout_steering=steering
    )
    shield = CbfShield(spec)
    worst = np.inf
    for _ in range(30):
        start = np.concatenate([rng.uniform(-1.0, 1.0, 2), rng.uniform(-1.5, 1.5, 2)])
        if np.hypot(*(start[:2] - PILLAR)) < 0.6:
            continue
        push = rng.uniform(-1, 1, 2)
        shield.reset()
        w, _ = _rollout(
            shield,
            start,
            (push / np.max(np.abs(push))).astype(np.float32),
            120,
            rng,
            accel_error=0.5,
            noise=0.002,
            latency=2,
        )
        worst = min(worst, w)
    assert worst > 0.0


def test_the_spec_key_is_checked_and_round_trips():
    spec = _spec(True)
    assert ShieldSpec.from_dict(spec).to_dict()["kinematics"]["keepout_steering"] is True
    assert "keepout_steering" not in ShieldSpec.from_dict(_spec(False)).to_dict()["kinematics"]  # old bundles' bytes
    bad = copy.deepcopy(spec)
    bad["kinematics"]["keepout_steering"] = "yes"
    with pytest.raises(ShieldSpecError, match="kinematics.keepout_steering"):
        ShieldSpec.from_dict(bad)
    bad["kinematics"] = dict(spec["kinematics"], keepout_steer=True)
    with pytest.raises(ShieldSpecError, match="kinematics.keepout_steer: unknown key"):
        ShieldSpec.from_dict(bad)


def test_steering_needs_the_authority_to_brake_and_hold_against_a_push_at_once(tmp_path, capsys):
    # Reality's 1.5 N horizontal push (1.579 m/s^2) beside 1.5 m/s^2 of braking needs 2.18 of the 2.2 m/s^2
    # the weakest plant has; a 1.8 N push needs more.
    def stronger_push(doc):
        doc["randomization"]["reality"]["push"]["max_force"] = 1.8

    path = _variant(tmp_path, "quadrotor", stronger_push)
    assert main(["config", "--check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "randomization.reality.push.max_force: passing the keep-out 'person_keepout'" in err, err
    assert "shield.keepout_steering: false" in err
    with pytest.raises(EnvelopeError):
        build_shield_spec(load_config(path))

    def without_steering(doc):
        stronger_push(doc)
        doc["shield"]["keepout_steering"] = False

    path = _variant(tmp_path, "quadrotor", without_steering)
    assert main(["config", "--check", str(path)]) == 0  # braking alone needs only the 1.5
    # The shipped quadrotor config credits passing the person.
    assert build_shield_spec(load_config(ROOT / "configs" / "quadrotor.yaml"))["kinematics"]["keepout_steering"] is True


@pytest.mark.parametrize("task", ["planar", "planar_two_zones_pushed", "quadrotor"])
def test_the_credit_never_costs_the_policy_an_intervention(task):
    # `filter` decides on the credited rows and, where they reject, asks the rows that got the credit again
    # without it (`BarrierRows.uncredited`). So an action passes unchanged exactly when the rows with the
    # credit, or the rows without it, accept it from a state where they hold: checked against both kinds of
    # rows evaluated in full (`cbf_conditions`, `barrier_values`) at states beside the zone, moving past it
    # at any heading, after one step whose action is still pending, for latencies 0-3 and gain errors; also
    # with two zones close together (one, both or neither credited) and pushes (`disturbance_accel`).
    rng = np.random.default_rng(7)
    only_without_credit = 0
    for latency, gain_error in [(0, 0.0), (1, 0.3), (2, 0.0), (3, 0.3)]:
        if task.startswith("planar"):
            spec = planar_double_integrator(
                latency, 0.05, margin=0.03, input_gain_error=gain_error, keepout_steering=True
            )
            if task == "planar_two_zones_pushed":
                spec["constraints"].append(
                    {
                        "name": "pillar2",
                        "type": "cylinder",
                        "index": [0, 1],
                        "center": [0.5, 0.45],
                        "radius": 0.25,
                        "gain": 0.3,
                    }
                )
                spec["disturbance_accel"] = spec["assumptions"]["max_disturbance_accel"] = [0.5, 0.3]
        else:
            spec = build_shield_spec(load_config(ROOT / "configs" / "quadrotor.yaml"))
            spec["latency_steps"], spec["input_gain_error"] = latency, gain_error
            spec["assumptions"].update(max_latency_s=latency * spec["dt"], max_input_gain_error=gain_error)
        zones = [c for c in spec["constraints"] if c["type"] in ("cylinder", "sphere")]
        shield = CbfShield(spec)
        s = shield.spec
        low, high = np.array(s.action_low), np.array(s.action_high)
        pos, vel = list(s.position_index[:2]), list(s.velocity_index[:2])
        for _ in range(3000 if task == "quadrotor" else 1500):  # the quadrotor's is rarer
            zone = zones[rng.integers(len(zones))]
            angle = rng.uniform(0, 2 * np.pi)
            n, t = np.array([np.cos(angle), np.sin(angle)]), np.array([-np.sin(angle), np.cos(angle)])
            obs = rng.normal(0.0, 0.1, s.obs_dim).astype(np.float32)
            # Up to 2 m out for the quadrotor: its inner loop's 0.15 s lag and the pushes' speed (push_velocity)
            # make its zone reach farther, and the case the second look is for lies there.
            reach = 2.0 if task == "quadrotor" else 1.0
            obs[pos] = np.asarray(zone["center"][:2]) + (zone["radius"] + rng.uniform(0.0, reach)) * n
            obs[vel] = -rng.uniform(-1.0, 3.0) * n + rng.uniform(0.0, 3.0) * t
            if len(s.position_index) > 2:  # the quadrotor: at mid height, level
                obs[s.position_index[2]], obs[s.velocity_index[2]] = 1.75, 0.0
            shield.reset()
            shield.filter(obs, rng.uniform(low, high).astype(np.float32))
            obs[pos] += 0.01 * obs[vel]
            action = rng.uniform(low, high).astype(np.float32)
            accepts = [
                min(
                    shield.cbf_conditions(obs, steering)(action.astype(np.float64)).min(),
                    shield.barrier_values(obs, steering).min(),
                )
                for steering in (True, False)
            ]
            out, info = shield.filter(obs, action)
            if max(accepts) > 1e-9:  # one kind of rows accepts, clear of rounding
                assert not info["intervened"] and out.tobytes() == action.tobytes(), (latency, accepts)
                only_without_credit += accepts[0] < -1e-9
            elif max(accepts) < -1e-9:
                assert info["intervened"], (latency, accepts)
    assert only_without_credit >= (2 if task == "quadrotor" else 10)  # the case the second look is for did occur
