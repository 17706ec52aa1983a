"""The predictive filter's state-dependent tube (`tube_slope`) and the hold action of its backup, on the closed-form
crane: for every state, what the filter admits keeps every constraint less the tube *at that state*, and the tube's
state-dependent part costs nothing at the operating point."""

from __future__ import annotations

import copy

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shield.cbf import CbfShield
from tests.helpers.predictive_specs import THETA_MAX, X_MAX, crane_model, crane_spec, plan_slack

A, B, C = crane_model()


def sloped_spec(per_metre: float) -> dict:
    """The crane spec with a tube that grows by `per_metre` (in every state, every step) per metre the trolley
    starts from the middle of its rail."""
    spec = copy.deepcopy(crane_spec())
    H = spec["predictive"]["horizon"]
    slope = np.zeros((H, 4, 4))
    slope[:, :, 0] = per_metre
    spec["predictive"]["tube_slope"] = slope.tolist()
    return spec


SLOPED = sloped_spec(0.2)
TUBE = np.asarray(SLOPED["predictive"]["tube"])
SLOPE = np.asarray(SLOPED["predictive"]["tube_slope"])

states = st.tuples(
    st.floats(-X_MAX, X_MAX), st.floats(-THETA_MAX, THETA_MAX), st.floats(-1.5, 1.5), st.floats(-3.0, 3.0)
)


@settings(max_examples=300, deadline=None)
@given(x=states, u_p=st.floats(-1.5, 1.5))
def test_every_admitted_action_keeps_the_tube_at_its_state_inside_every_constraint(x, u_p):
    """For every state inside the constraints and every policy action: unless the filter says it fell back, the
    whole plan of what it returns keeps every row less the tube grown by how far out the trolley starts."""
    u, info = CbfShield(SLOPED).filter(np.array(x, np.float32), np.array([u_p], np.float32))
    if not info["fallback"]:
        x64 = np.array(x, np.float32).astype(np.float64)
        tube = TUBE + SLOPE @ np.abs(x64)  # the operating point is the origin
        assert plan_slack(SLOPED, x64, float(u[0]), tube) >= -1e-6, (x, u_p, u)


def test_the_slope_tightens_only_away_from_the_operating_point():
    """At the operating point the sloped filter's rows equal the constant tube's; 0.5 m out they are tighter, by
    exactly |w| . slope_j . |x_L|, on the constraint rows (and not at all on the backup's input rows)."""
    flat, sloped = CbfShield(crane_spec()), CbfShield(SLOPED)

    def free(shield: CbfShield, x) -> np.ndarray:
        pred = shield._predictor
        pred.load_observation(np.asarray(x, np.float64)[shield._obs_src])
        pred.load_action(np.zeros(1))
        return shield._predictive.slack_free(pred.v).copy()

    assert np.array_equal(free(flat, [0.0] * 4), free(sloped, [0.0] * 4))
    gap = free(flat, [0.5, 0.0, 0.0, 0.0]) - free(sloped, [0.5, 0.0, 0.0, 0.0])
    assert np.all(gap >= -1e-12)
    # Each constraint row reads one state with weight +-1, so its tube grows by 0.2 x 0.5 m.
    assert np.isclose(gap.max(), 0.1) and np.sum(np.isclose(gap, 0.1)) >= len(TUBE)
    assert np.sum(np.isclose(gap, 0.0)) > 0  # the input-box and terminal-box rows carry no tube


def test_a_backup_that_holds_with_an_action_stops_the_plant_where_it_is():
    """A plant that rests off its operating point only under an action (a ball on a beam held by the torque
    that levels the beam): the backup's hold action keeps the hold point an equilibrium of the model, so the
    backup does not drive the plant back to the operating point."""
    from pipeline.safety.predictive import equilibrium_projection

    # A mass on a spring: it rests at x only with the force k x (A has no free rest state under zero action).
    dt, k, m = 0.02, 4.0, 1.0
    Ac = np.array([[0.0, 1.0], [-k / m, -0.5]])
    A2 = np.eye(2) + dt * Ac
    B2 = np.array([[0.0], [dt / m]])
    P2, F2 = equilibrium_projection(A2, B2)
    dx = np.array([0.3, 0.7])
    rest = P2 @ dx
    assert np.allclose(rest, [0.3, 0.0])  # at rest where it is: the velocity projected out
    assert np.allclose(A2 @ rest + B2 @ (F2 @ dx), rest)  # and held there by F
    assert np.isclose(float((F2 @ dx)[0]), k * 0.3)
    # The crane rests anywhere on its rail under zero action: no hold action, the projection as before.
    Pc, Fc = equilibrium_projection(A, B)
    assert np.allclose(Fc, 0.0) and np.allclose(Pc @ (A @ Pc - Pc), 0.0)


def action_sloped_spec(per_unit: float, inputs: int = 1) -> dict:
    """The crane spec with a tube that grows by `per_unit` (in every state, every step) per unit of |u| of the
    candidate; with two inputs, a second drive on the trolley at half the first's force."""
    spec = copy.deepcopy(crane_spec())
    H = spec["predictive"]["horizon"]
    if inputs == 2:
        B1 = np.asarray(spec["model"]["B"])
        spec["model"]["B"] = np.hstack([B1, 0.5 * B1]).tolist()
        spec.update(act_dim=2, action_low=[-1.0, -1.0], action_high=[1.0, 1.0], fallback_action=[0.0, 0.0])
        K1 = np.asarray(spec["predictive"]["backup_gain"])
        spec["predictive"]["backup_gain"] = np.vstack([K1, np.zeros_like(K1)]).tolist()
    spec["predictive"]["tube_action_slope"] = np.full((H, 4, inputs), per_unit).tolist()
    return spec


ACTION_SLOPED = action_sloped_spec(0.02)
ASLOPE = np.asarray(ACTION_SLOPED["predictive"]["tube_action_slope"])


@settings(max_examples=300, deadline=None)
@given(x=states, u_p=st.floats(-1.5, 1.5))
def test_every_admitted_action_keeps_the_tube_its_own_size_sets_and_is_the_nearest_that_does(x, u_p):
    """A tube that grows with |u|: what the filter returns (unless it fell back) keeps every row less the tube its
    own |u| sets, and it is the nearest such action to the policy's: a step back toward the policy's action
    breaks a row (the |u| rows, split by the sign of u, give the exact interval, not a conservative one)."""
    x64 = np.array(x, np.float32).astype(np.float64)
    u, info = CbfShield(ACTION_SLOPED).filter(np.array(x, np.float32), np.array([u_p], np.float32))
    if info["fallback"]:
        return

    def slack(a: float) -> float:
        return plan_slack(ACTION_SLOPED, x64, a, TUBE + ASLOPE[:, :, 0] * abs(a))

    got = float(u[0])
    assert slack(got) >= -1e-6, (x, u_p, got)
    target = float(np.float32(u_p))
    if info["intervened"] and -1.0 < target < 1.0 and abs(target - got) > 1e-3:
        assert slack(got + 1e-3 * np.sign(target - got)) < 0.0, (x, u_p, got)


@settings(max_examples=12, deadline=None)
@given(x=states, u_p=st.tuples(st.floats(-1.0, 1.0), st.floats(-1.0, 1.0)))
def test_with_two_inputs_the_filter_returns_the_nearest_action_its_rows_admit(x, u_p):
    """Two inputs, a tube growing with each |u_k|: `solve` returns an action `evaluate` admits, and no action on
    a fine grid of the box that the rows (less cand . |u|) admit is nearer the policy's by more than the grid."""
    shield = CbfShield(action_sloped_spec(0.02, inputs=2))
    pf, pred = shield._predictive, shield._predictor
    pred.load_observation(np.array(x, np.float64)[shield._obs_src])
    pred.load_action(np.zeros(2))
    free = pf.slack_free(pred.v).copy()
    target = np.array(u_p)
    u = pf.solve(free, target)
    grid = np.stack(np.meshgrid(np.linspace(-1, 1, 81), np.linspace(-1, 1, 81)), -1).reshape(-1, 2)

    def rows(a: np.ndarray) -> np.ndarray:  # per action (rows of a), its least row less cand . |a|
        return (a @ pf._G.T + free - np.abs(a) @ pf._cand.T).min(axis=1)

    admitted = grid[rows(grid) >= 0.0]
    if u is None:
        assert len(admitted) == 0
        return
    assert float(rows(u[None])[0]) >= -1e-9
    if len(admitted):
        assert np.linalg.norm(u - target) <= np.linalg.norm(admitted - target, axis=1).min() + 0.025


def test_a_malformed_action_slope_is_refused_naming_its_key():
    """The spec names `predictive.tube_action_slope` for a wrong shape (one column per action in flight) and for a
    negative entry (a tube never shrinks with the action)."""
    import pytest

    from shield.spec import ShieldSpec

    ShieldSpec.from_dict(ACTION_SLOPED)  # well formed
    bad = copy.deepcopy(ACTION_SLOPED)
    bad["predictive"]["tube_action_slope"] = np.zeros((len(TUBE), 4, 2)).tolist()  # latency 0: one action
    with pytest.raises(ValueError, match=r"predictive\.tube_action_slope\[0\]"):
        ShieldSpec.from_dict(bad)
    bad["predictive"]["tube_action_slope"] = (-ASLOPE).tolist()
    with pytest.raises(ValueError, match=r"predictive\.tube_action_slope"):
        ShieldSpec.from_dict(bad)


# A floor above the constant tube near rest (the error a push makes from rest, which the growing part, fitted over
# the whole envelope, does not see there): 5 cm on the trolley and 0.03 rad on the swing, at every step. 0.5 m
# out the growing part (0.2 per metre) is above it.
FLOOR = TUBE + np.array([0.05, 0.03, 0.0, 0.0])
FLOORED = copy.deepcopy(SLOPED)
FLOORED["predictive"]["tube_floor"] = FLOOR.tolist()


def free_rows(spec: dict, x) -> np.ndarray:
    """The filter's rows less the candidate's part at state `x` (latency 0, the fallback loaded)."""
    shield = CbfShield(spec)
    pred = shield._predictor
    pred.load_observation(np.asarray(x, np.float64)[shield._obs_src])
    pred.load_action(np.zeros(1))
    return shield._predictive.slack_free(pred.v).copy()


@settings(max_examples=300, deadline=None)
@given(x=states, u_p=st.floats(-1.5, 1.5))
def test_every_admitted_action_keeps_the_tube_never_below_its_floor(x, u_p):
    """For every state and policy action: unless the filter fell back, the plan of what it returns keeps every row
    less the larger, per step and state, of the floor and the tube grown by how far out the trolley starts."""
    u, info = CbfShield(FLOORED).filter(np.array(x, np.float32), np.array([u_p], np.float32))
    if not info["fallback"]:
        x64 = np.array(x, np.float32).astype(np.float64)
        tube = np.maximum(FLOOR, TUBE + SLOPE @ np.abs(x64))
        assert plan_slack(FLOORED, x64, float(u[0]), tube) >= -1e-6, (x, u_p, u)


def test_the_floor_holds_at_rest_and_the_growing_tube_away_from_it():
    """At rest the floored rows are those of a constant tube equal to the floor (also where the tube grows only
    with the candidate's |u|); 0.5 m out, where the growing part is above the floor everywhere, they are the sloped
    tube's. Without a growing part, the floor is simply the tube where it is larger."""
    flat_floor = copy.deepcopy(crane_spec())
    flat_floor["predictive"]["tube"] = FLOOR.tolist()
    assert np.allclose(free_rows(FLOORED, [0.0] * 4), free_rows(flat_floor, [0.0] * 4), atol=1e-12)
    assert np.array_equal(free_rows(FLOORED, [0.5, 0.0, 0.0, 0.0]), free_rows(SLOPED, [0.5, 0.0, 0.0, 0.0]))
    # A tube that grows only with the candidate's |u| keeps its floor too (the candidate's part comes on top).
    candidate_only = copy.deepcopy(ACTION_SLOPED)
    candidate_only["predictive"]["tube_floor"] = FLOOR.tolist()
    assert np.allclose(free_rows(candidate_only, [0.0] * 4), free_rows(flat_floor, [0.0] * 4), atol=1e-12)
    constant = copy.deepcopy(crane_spec())
    constant["predictive"]["tube_floor"] = FLOOR.tolist()
    assert np.allclose(free_rows(constant, [0.2, 0.0, 0.0, 0.0]), free_rows(flat_floor, [0.2, 0.0, 0.0, 0.0]))


def test_a_row_over_several_states_takes_the_floor_on_top_of_the_growing_part():
    """The per-state maximum of floor and growing tube, summed along a row over two states, is at most floor plus
    growing part, which is what such a row takes (one product per call, never less than the per-state bound):
    a halfspace x + theta <= 0.6 is tightened by the whole of |w| . (floor - tube) beyond the sloped tube."""
    extra = {"name": "lean", "type": "halfspace", "a": [1.0, 1.0, 0.0, 0.0], "b": 0.6}
    sloped, floored = copy.deepcopy(SLOPED), copy.deepcopy(FLOORED)
    for spec in (sloped, floored):
        spec["constraints"].append(extra)
        spec["predictive"]["terminal_reach"] = spec["predictive"]["terminal_reach"] + [0.0]
    x = [0.5, 0.0, 0.0, 0.0]
    gap = free_rows(sloped, x) - free_rows(floored, x)
    per_step = (0.05 + 0.03) / np.sqrt(2.0)  # |w| . (floor - tube) on the normalized row
    # The box rows are the sloped tube's (it is above the floor 0.5 m out); the halfspace's carry the excess on top.
    assert np.isclose(gap.max(), per_step) and np.all(np.isclose(gap, 0.0) | np.isclose(gap, per_step))
    assert np.sum(np.isclose(gap, per_step)) == len(TUBE) + 1  # every step's row and the settled equilibrium's


def test_a_malformed_floor_is_refused_naming_its_key():
    import pytest

    from shield.spec import ShieldSpec

    bare = copy.deepcopy(FLOORED)  # well formed without constraints too: only the backup's own rows to keep
    bare["constraints"], bare["predictive"]["terminal_reach"] = [], []
    assert not CbfShield(bare).filter(np.zeros(4, np.float32), np.zeros(1, np.float32))[1]["fallback"]
    bad = copy.deepcopy(FLOORED)
    bad["predictive"]["tube_floor"] = FLOOR[:-1].tolist()
    with pytest.raises(ValueError, match=r"predictive\.tube_floor"):
        ShieldSpec.from_dict(bad)
    bad["predictive"]["tube_floor"] = (-FLOOR).tolist()
    with pytest.raises(ValueError, match=r"predictive\.tube_floor"):
        ShieldSpec.from_dict(bad)
