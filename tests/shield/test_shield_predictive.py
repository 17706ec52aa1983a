"""The predictive safety filter (`shield.predictive`) on a closed-form crane: what it admits keeps its tube inside
every constraint, a safe action passes bitwise, and the plant it filters stays inside at every latency it admits."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shield.cbf import CbfShield
from shield.spec import ShieldSpec, ShieldSpecError
from tests.helpers.predictive_specs import THETA_MAX, X_MAX, crane_model, crane_spec, plan_slack

SPEC = crane_spec()
A, B, C = crane_model()
LIMIT = np.array([X_MAX, THETA_MAX])

states = st.tuples(
    st.floats(-X_MAX, X_MAX), st.floats(-THETA_MAX, THETA_MAX), st.floats(-1.5, 1.5), st.floats(-3.0, 3.0)
)

# Near rest, where most actions are safe: the states a calm policy lives in.
calm = st.tuples(st.floats(-0.6, 0.6), st.floats(-0.1, 0.1), st.floats(-0.3, 0.3), st.floats(-0.5, 0.5))


@settings(max_examples=300, deadline=None)
@given(x=states, u_p=st.floats(-1.5, 1.5))
def test_every_admitted_action_keeps_its_tube_inside_every_constraint(x, u_p):
    """For every state inside the constraints and every policy action: whatever the filter returns (unless it
    says it fell back to the backup), its whole plan, tightened by the tube, keeps every row."""
    shield = CbfShield(SPEC)
    u, info = shield.filter(np.array(x, np.float32), np.array([u_p], np.float32))
    assert -1.0 <= float(u[0]) <= 1.0
    if not info["fallback"]:
        x64 = np.array(x, np.float32).astype(np.float64)
        assert plan_slack(SPEC, x64, float(u[0])) >= -1e-6, (x, u_p, u)


@settings(max_examples=300, deadline=None)
@given(x=calm, u_p=st.floats(-0.3, 0.3))
def test_a_safe_action_passes_bitwise_unchanged(x, u_p):
    obs, action = np.array(x, np.float32), np.array([u_p], np.float32)
    assume(plan_slack(SPEC, obs.astype(np.float64), float(action[0])) > 1e-9)
    u, info = CbfShield(SPEC).filter(obs, action)
    assert u.tobytes() == action.tobytes() and not info["intervened"] and min(info["h"]) >= 0.0


@pytest.mark.parametrize("latency", [0, 1, 2])
def test_the_plant_stays_inside_under_a_bang_bang_attack_at_every_latency_the_spec_admits(latency):
    """The nominal plant itself (the model exact, so any tube holds), with 0, 1 or 2 steps of latency, driven by a
    policy that pushes full action toward the rail's end and flips to excite the swing: the filter keeps both
    constraints, and it does so by intervening."""
    shield = CbfShield(crane_spec(latency_steps=2, latency_min_steps=0))
    rng = np.random.default_rng(latency)
    worst, intervened = 0.0, 0
    for episode in range(3):
        shield.reset()
        x = np.array([rng.uniform(-0.2, 0.2), rng.uniform(-0.05, 0.05), 0.0, 0.0])
        queue = [np.zeros(1)] * latency
        for t in range(400):
            attack = np.array([1.0 if (t // (25 + 10 * episode)) % 2 == 0 else -1.0], np.float32)
            u, info = shield.filter(x.astype(np.float32), attack)
            intervened += info["intervened"]
            queue.append(u.astype(np.float64))
            x = A @ x + B @ queue.pop(0) + C
            worst = max(worst, float((np.abs(x[:2]) / LIMIT).max()))
    assert worst <= 1.0, worst
    assert intervened > 0


def test_old_specs_load_unchanged_and_the_section_round_trips():
    old = copy.deepcopy(SPEC)
    del old["predictive"]
    spec = ShieldSpec.from_dict(old)
    assert spec.predictive is None and "predictive" not in spec.to_dict()
    again = ShieldSpec.from_dict(ShieldSpec.from_dict(SPEC).to_dict())
    assert again.predictive == SPEC["predictive"]


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("tube", [[0.0] * 4], "predictive.tube"),
        ("horizon", 0, "predictive.horizon"),
        ("terminal_box", [-1.0, 0.0, 0.0, 0.0], "predictive.terminal_box"),
        ("backup_gains", [[0.0] * 4], "predictive.backup_gains: unknown key"),
    ],
)
def test_a_bad_predictive_section_is_refused_naming_the_key(key, value, needle):
    bad = copy.deepcopy(SPEC)
    bad["predictive"][key] = value
    with pytest.raises(ShieldSpecError, match=needle.replace(".", r"\.")):
        ShieldSpec.from_dict(bad)


def test_blind_steps_tighten_every_plan_by_the_dead_reckonings_error():
    """Observations lost: the filter plans from the dead-reckoned state, whose error grows every blind step with
    the model error the spec declares. Two shields fed the same steps, one declaring a model error and one none:
    seen, their rows agree; blind, the one with an error tightens its rows, by more each blind step."""
    lossy = copy.deepcopy(SPEC)
    lossy["disturbance_accel"] = [2.0, 2.0]
    exact, erring = CbfShield(SPEC), CbfShield(lossy)
    x = np.array([0.3, 0.05, 0.2, -0.1], np.float32)
    u = np.array([0.05], np.float32)
    seen = [s.filter(x, u)[1]["h"] for s in (exact, erring)]
    assert np.array_equal(seen[0], seen[1])
    lost = np.full(4, np.nan, np.float32)
    gaps = []
    for _ in range(4):
        h_exact, h_erring = (s.filter(lost, u)[1]["h"] for s in (exact, erring))
        assert np.all(h_erring <= h_exact) and np.any(h_erring < h_exact)
        gaps.append(float(np.max(h_exact - h_erring)))
    assert all(b > a for a, b in zip(gaps, gaps[1:])), gaps


def crane_under_kicks(shield: CbfShield, attack, steps: int = 600, seed: int = 0, kick: float = 0.1):
    """The nominal crane at 1 step of latency under `attack` (step -> action), with random velocity kicks (5 % of
    steps: `kick` m/s on the trolley, 3x that in rad/s on the swing) that no tube here was measured on, so an
    accepted plan sometimes has no successor in the box: the states fed to the shield and its infos, per step."""
    rng = np.random.default_rng(seed)
    x, queue, trace = np.zeros(4), [np.zeros(1)], []
    for t in range(steps):
        obs = x.astype(np.float32)
        u, info = shield.filter(obs, np.asarray(attack(t), np.float32))
        trace.append((obs, info))
        queue.append(u.astype(np.float64))
        x = A @ x + B @ queue.pop(0) + C
        if rng.random() < 0.05:
            x[2:] += kick * np.array([1.0, 3.0]) * rng.choice([-1.0, 1.0], size=2)
    return trace


def test_the_backup_continuing_an_accepted_plan_is_reported_as_backup_and_never_as_fallback():
    """Where no action in the box has a plan that holds, the filter's backup continues the plan it accepted last:
    its designed hand-over near a limit, which that plan's tube certifies. It says `backup`, not `fallback` (the
    protocol's alarm), and the crane stays inside. A fresh shield with no plan accepted behind it, asked at a state
    where none holds, says `fallback`: nothing certifies that action."""
    shield = CbfShield(crane_spec(latency_steps=1, latency_min_steps=0))
    trace = crane_under_kicks(shield, lambda t: [1.0 if (t // 40) % 2 == 0 else -1.0])
    infos = [info for _, info in trace]
    assert sum(i["backup"] for i in infos) > 0 and not any(i["fallback"] for i in infos)
    assert all(i["intervened"] for i in infos if i["backup"])
    worst = max(float((np.abs(obs[:2]) / LIMIT).max()) for obs, _ in trace)
    assert worst <= 1.0, worst
    rushing = np.array([0.97 * X_MAX, 0.0, 1.5, 0.0], np.float32)  # at the rail's end, still going
    _, info = CbfShield(crane_spec()).filter(rushing, np.ones(1, np.float32))
    assert info["fallback"] and not info["backup"], info
    # A plant observed past a limit left every accepted plan's tube: its backup is no longer certified by one.
    for past in (np.array([1.05 * X_MAX, 0.0, 0.5, 0.0]), np.array([0.0, 1.2 * THETA_MAX, 0.0, 0.0])):
        kept = CbfShield(crane_spec(latency_steps=1, latency_min_steps=0))
        for _ in range(5):
            _, info = kept.filter(np.zeros(4, np.float32), np.zeros(1, np.float32))  # plans accepted at rest
        _, info = kept.filter(past.astype(np.float32), np.ones(1, np.float32))
        assert info["fallback"] and not info["backup"], (past, info)


@settings(max_examples=300, deadline=None)
@given(
    x=st.tuples(st.floats(-1.2, 1.2), st.floats(-0.6, 0.6), st.floats(-3.0, 3.0), st.floats(-5.0, 5.0)),
    u_p=st.floats(-1.5, 1.5),
)
def test_with_nothing_certified_the_action_sent_is_the_one_whose_plan_misses_least(x, u_p):
    """For every state where no plan holds and no accepted plan certifies the backup (a fresh shield; the plant
    past a limit): of the backup's action and the policy's (in the box), the one whose plan's worst slack is larger
    is sent. The backup alone held helper-56's heavy arm below its band while the legacy LQR's torque, its plan no
    worse, would have lifted it out."""
    shield = CbfShield(SPEC)
    out, info = shield.filter(np.array(x, np.float32), np.array([u_p], np.float32))
    assume(info["fallback"])  # no plan held and nothing certified the backup
    twin = CbfShield(SPEC)  # the state the step saw, rebuilt
    twin._predictor.load_observation(np.array(x, np.float32).astype(np.float64)[twin._obs_src])
    free = twin._predictive.slack_free(twin._predictor.v)
    policy = np.clip(np.array([u_p], np.float32), -1.0, 1.0).astype(np.float64)
    backup = twin._predictive.backup(twin._predictor.v, None)

    def worst(u):
        return float(twin._predictive.evaluate(free, np.asarray(u, np.float64))[1].min())

    h_policy, h_backup = worst(policy), worst(backup)
    assume(abs(h_backup) > 1e-6 and abs(h_policy - h_backup) > 1e-6)  # no tie for float32 rounding to decide
    expected = policy if h_backup < 0.0 and h_policy > h_backup else backup
    np.testing.assert_array_equal(out, expected.astype(np.float32))


@settings(max_examples=300, deadline=None)
@given(x=st.tuples(st.floats(-3.0, 3.0), st.floats(-1.0, 1.0), st.floats(-3.0, 3.0), st.floats(-5.0, 5.0)))
def test_with_no_plan_accepted_the_backup_stops_the_plant_only_where_a_plan_may_stop(x):
    """For every state, however far out: the stop of a backup with no accepted plan meets the rows a plan's stop
    must meet (the constraints less the tube and the tail's reach): the equilibrium nearest the state wherever that
    one does, else the operating point."""
    pf = CbfShield(SPEC)._predictive
    nearest = pf._P @ (np.array(x) - pf._x_op)

    def rows(hold):  # the hold rows' slack at `hold`
        return pf._hold_W @ (hold - pf._x_op) + pf._hold_slack_op

    assert rows(pf._x_op).min() >= 0.0
    hold = pf._admitted_hold(nearest)
    assert rows(hold).min() >= 0.0
    expected = pf._x_op + nearest if rows(pf._x_op + nearest).min() >= 0.0 else pf._x_op
    np.testing.assert_array_equal(hold, expected)


def test_a_plant_held_by_a_steady_action_is_kept_by_a_backup_that_holds_with_it():
    """The crane on a slope: a steady pull toward -x that only the drive at 0.3 of its range cancels (the model's
    drift c = -B 0.3; `hold_trim` [0.3], the fallback action too). At rest the filter passes the holding action
    unchanged and its backup answers with it; under a bang-bang attack at every latency the plant stays inside."""
    trim = 0.3
    drift = -(B @ [trim])

    def sloped(**kw) -> dict:
        spec = crane_spec(**kw)
        spec["model"]["c"] = drift.tolist()
        spec["predictive"]["hold_trim"] = spec["fallback_action"] = [trim]
        return spec

    shield = CbfShield(sloped())
    rest = np.zeros(4, np.float32)
    u, info = shield.filter(rest, np.array([trim], np.float32))
    assert float(u[0]) == np.float32(trim) and not info["intervened"]
    shield.reset()
    pred = shield._predictor
    pred.load_observation(rest.astype(np.float64)[shield._obs_src])
    pred.load_action(np.zeros(1))
    np.testing.assert_allclose(shield._predictive.backup(pred.v, None), [trim], atol=1e-9)
    shield = CbfShield(sloped(latency_steps=2, latency_min_steps=0))
    for latency in (0, 1, 2):
        shield.reset()
        x, queue, worst = np.zeros(4), [np.zeros(1) + trim] * latency, 0.0
        for t in range(400):
            u, _ = shield.filter(x.astype(np.float32), np.array([1.0 if (t // 30) % 2 else -1.0], np.float32))
            queue.append(u.astype(np.float64))
            x = A @ x + B @ queue.pop(0) + drift
            worst = max(worst, float((np.abs(x[:2]) / LIMIT).max()))
        assert worst <= 1.0, (latency, worst)


def test_a_tube_with_no_room_at_rest_is_refused_with_what_it_takes_and_what_there_was():
    """A tube wider than the crane's limits: the refusal says how much the model error takes off the worst
    constraint and how much room that constraint had at rest with none, figures that add up to its slack."""
    import re

    from pipeline.safety.predictive import holding_problem

    assert holding_problem(crane_spec()) is None
    said = holding_problem(crane_spec(tube_per_step=2000.0))
    got = re.search(
        r"takes ([\d.e+-]+) off constraint '(\w+)', which has ([\d.e+-]+) of room there \(slack ([\d.e+-]+); room: ",
        said,
    )
    assert got, said
    took, name, room, slack = float(got[1]), got[2], float(got[3]), float(got[4])
    limit = {"rail": X_MAX, "swing": THETA_MAX}[name]
    assert 0.8 * limit <= room <= limit  # the plan at rest, less only what its terminal set keeps back
    assert room - took == pytest.approx(slack, rel=1e-2, abs=1e-3) and slack < 0
