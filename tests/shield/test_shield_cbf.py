"""CbfShield on synthetic plants: QP optimality, minimality, bad input, safety under an adversary."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

from pipeline.config import load_config
from pipeline.safety.shield_spec import build_shield_spec
from shield.cbf import CbfShield, ShieldedPolicy, _project_on_row
from tests.helpers.shield_specs import planar_double_integrator

ROOT = Path(__file__).resolve().parents[2]


def _reference(conditions, u_p: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """The exact (nonlinear, convex) projection problem solved by scipy's SLSQP."""
    start = np.clip(u_p, low, high)
    # SLSQP's feasibility tolerance is absolute: scale each row by its input gradient so that
    # a row barely moved by the input (a position row, moving away) is still met to ~1e-9 in u.
    eye = np.eye(len(u_p)) * 1e-6
    grad = np.stack([(conditions(start + e) - conditions(start - e)) / 2e-6 for e in eye], axis=1)
    scale = 1.0 / np.maximum(np.linalg.norm(grad, axis=1), 1e-6)
    res = minimize(
        lambda u: float((u - u_p) @ (u - u_p)),
        start,
        jac=lambda u: 2 * (u - u_p),
        method="SLSQP",
        bounds=list(zip(low, high)),
        constraints=[{"type": "ineq", "fun": lambda u: scale * conditions(u)}],
        options={"ftol": 1e-15, "maxiter": 500},
    )
    return res.x


@pytest.mark.parametrize("latency_steps,response_time_s,gain_error", [(0, 0.0, 0.0), (1, 0.05, 0.3)])
def test_filter_matches_reference_qp_on_random_instances(latency_steps, response_time_s, gain_error):
    rng = np.random.default_rng(7 + latency_steps)
    shield = CbfShield(planar_double_integrator(latency_steps, response_time_s, input_gain_error=gain_error))
    low, high = np.array([-1.0, -1.0]), np.array([1.0, 1.0])
    compared = fallbacks = intervened = 0
    for _ in range(700):
        shield.reset()
        pos = rng.uniform(-2.05, 2.05, 2)
        obs = np.concatenate([pos, rng.uniform(-2.0, 2.0, 2)]).astype(np.float32)
        if latency_steps or response_time_s:
            # one earlier step fills the pending actions and the internal acceleration
            shield.filter(obs, rng.uniform(-1, 1, 2).astype(np.float32))
            obs = (obs + rng.normal(0, 0.01, 4)).astype(np.float32)
        u_p = rng.uniform(-1.5, 1.5, 2).astype(np.float32)
        conditions = shield.cbf_conditions(obs)
        u, info = shield.filter(obs, u_p)
        ref = _reference(conditions, u_p.astype(np.float64), low, high)
        ref_feasible = np.min(conditions(ref)) >= -1e-7
        if np.nanmin(info["h"]) < 0:
            continue  # a violated barrier: hard braking, not the projection (tests/shield/test_shield_soundness.py)
        if info["fallback"]:
            fallbacks += 1
            assert not ref_feasible, "shield fell back although the reference found a feasible action"
            continue
        assert ref_feasible
        compared += 1
        intervened += info["intervened"]
        np.testing.assert_allclose(u, ref, atol=1e-6, rtol=0)
        assert np.min(conditions(u.astype(np.float64))) >= -1e-6
        assert np.all(u >= low) and np.all(u <= high)
    assert compared >= 500 and intervened >= 100, (compared, intervened, fallbacks)


@pytest.mark.parametrize("latency_steps,gain_error", [(0, 0.0), (2, 0.3)])
def test_filter_matches_reference_qp_at_the_fence_corners(latency_steps, gain_error):
    """Near a corner of the fence, moving out through it: the two walls bind on separate inputs, so the shield
    combines its projections onto each (no QP); the result is still the exact projection, corner or not."""
    rng = np.random.default_rng(11)
    shield = CbfShield(planar_double_integrator(latency_steps, input_gain_error=gain_error))
    low, high = np.array([-1.0, -1.0]), np.array([1.0, 1.0])
    corners = 0
    for _ in range(300):
        shield.reset()
        out = np.array([(-1.0, -1.0), (-1.0, 1.0), (1.0, -1.0)][rng.integers(3)])  # (1, 1): the diagonal wall's
        pos = out * rng.uniform(1.75, 1.98, 2)
        obs = np.concatenate([pos, out * rng.uniform(0.0, 0.6, 2)]).astype(np.float32)
        for _ in range(latency_steps):  # fill the pending actions
            shield.filter(obs, rng.uniform(-1, 1, 2).astype(np.float32))
        u_p = (out * rng.uniform(0.3, 1.0, 2)).astype(np.float32)
        conditions = shield.cbf_conditions(obs)
        u, info = shield.filter(obs, u_p)
        if np.nanmin(info["h"]) < 0 or info["fallback"]:
            continue  # braking, not the projection
        ref = _reference(conditions, u_p.astype(np.float64), low, high)
        np.testing.assert_allclose(u, ref, atol=1e-6, rtol=0)
        assert np.min(conditions(u.astype(np.float64))) >= -1e-6
        fence = conditions(u.astype(np.float64)).reshape(-1, 8)[:, :4]  # per gain case: the fence's 4 walls
        corners += int(np.sum(np.abs(fence).min(axis=0) < 1e-6) == 2)
    assert corners >= 60, corners  # both walls binding at the answer


def test_safe_action_is_returned_bitwise():
    rng = np.random.default_rng(3)
    shield = CbfShield(planar_double_integrator(latency_steps=1, response_time_s=0.05, input_gain_error=0.3))
    checked = 0
    for _ in range(500):
        shield.reset()
        obs = np.concatenate([rng.uniform(-1.0, 1.0, 2), rng.uniform(-0.5, 0.5, 2)]).astype(np.float32)
        action = rng.uniform(-1.0, 1.0, 2).astype(np.float32)
        if np.min(shield.cbf_conditions(obs)(action.astype(np.float64))) < 0:
            continue
        u, info = shield.filter(obs, action)
        if np.min(info["h"]) < 0:
            continue  # inside a keep-out zone or its braking distance: hard braking (test_shield_soundness.py)
        assert u.tobytes() == action.tobytes() and not info["intervened"] and not info["fallback"]
        checked += 1
    assert checked >= 300


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_bad_input_falls_back_without_exception(bad):
    shield = CbfShield(planar_double_integrator(latency_steps=1))
    good = np.array([1.9, 0.0, 2.0, 0.0], np.float32)  # near the +x fence, closing fast
    # no state seen yet: the documented constant
    u, info = shield.filter(np.array([bad, 0, 0, 0], np.float32), np.zeros(2, np.float32))
    assert info["bad_input"] and info["fallback"] and np.all(np.isfinite(u))
    np.testing.assert_array_equal(u, [0.0, 0.0])
    shield.reset()
    shield.filter(good, np.zeros(2, np.float32))
    # bad observation after a good one: brake from the predicted state, not the policy's push
    u, info = shield.filter(np.array([bad, 0, 0, 0], np.float32), np.array([1.0, 0.0], np.float32))
    assert info["bad_input"] and info["fallback"] and np.all(np.isfinite(u)) and u[0] < 0
    # bad action with a good observation
    u, info = shield.filter(good, np.array([bad, 0.0], np.float32))
    assert info["bad_input"] and info["fallback"] and info["intervened"] and np.all(np.isfinite(u))
    # wrong shapes are bad input too
    u, info = shield.filter(np.zeros(3, np.float32), np.zeros(2, np.float32))
    assert info["bad_input"] and np.all(np.isfinite(u)) and u.shape == (2,)
    u, info = shield.filter(good, np.zeros(5, np.float32))
    assert info["bad_input"] and info["fallback"] and np.all(np.isfinite(u)) and u.shape == (2,)


def _rollout(
    shield: CbfShield,
    start: np.ndarray,
    push: np.ndarray,
    steps: int,
    rng,
    accel_error: float,
    noise: float,
    latency: int,
) -> tuple[float, int]:
    """Simulate the planar plant (with its own latency, lag and acceleration error); return min distance, fallbacks."""
    A, B, c = shield._A, shield._B, shield._c  # the true plant = nominal model, another gain, a disturbance
    B = B * rng.uniform(0.75, 1.25)
    x = np.concatenate([start, shield.spec.linear_model().initial_internal(1.0)])
    pending = deque([np.zeros(2)] * latency)
    worst, fallbacks = np.inf, 0
    for _ in range(steps):
        obs = (x[:4] + rng.normal(0, noise, 4)).astype(np.float32)
        u, info = shield.filter(obs, push)
        fallbacks += info["fallback"]
        pending.append(u.astype(np.float64))
        applied = pending.popleft()
        x = A @ x + B @ applied + c
        x[2:4] += rng.uniform(-accel_error, accel_error, 2) * shield.spec.dt
        px, py = x[0], x[1]
        worst = min(worst, 2 - abs(px), 2 - abs(py), 3 - px - py, np.hypot(px - 0.5, py + 0.5) - 0.3)
    return worst, fallbacks


_BOX_SHIELD = {}


@settings(max_examples=300, deadline=None)
@given(
    obs=st.lists(
        st.floats(-5.0, 5.0, width=32) | st.sampled_from([np.nan, np.inf, -np.inf, 3e38]), min_size=4, max_size=4
    ),
    action=st.lists(
        st.floats(width=32, allow_nan=True, allow_infinity=True) | st.sampled_from([0.3, -0.7, 0.7]),
        min_size=2,
        max_size=2,
    ),
)
def test_every_action_is_inside_the_declared_box_even_where_a_bound_has_no_float32(obs, action):
    """Bounds like 0.3 and 0.7 have no float32; the double clipped to them used to round to a float32 1e-8
    outside (0.30000001), which a plant checking its limits in double refuses. Every action the shield returns,
    passed through, projected, braked or the fallback, lies inside the box as declared."""
    if "shield" not in _BOX_SHIELD:
        d = planar_double_integrator(latency_steps=1)
        d["action_low"], d["action_high"] = [-0.3, -0.7], [0.3, 0.7]
        d["kinematics"]["brake_accel"] = [1.0, 2.0]
        _BOX_SHIELD["shield"] = CbfShield(d)
    shield = _BOX_SHIELD["shield"]
    u, _ = shield.filter(np.array(obs, np.float32), np.array(action, np.float32))
    assert u.dtype == np.float32 and np.isfinite(u).all()
    assert (u.astype(np.float64) >= [-0.3, -0.7]).all() and (u.astype(np.float64) <= [0.3, 0.7]).all(), u.tolist()


_CARTPOLE = {}


def _cartpole_specs() -> tuple[dict, dict]:
    """The cart-pole's spec (its pole angle declared an angle) and the same spec without `angles`."""
    if not _CARTPOLE:
        spec = build_shield_spec(load_config("configs/cartpole.yaml"))
        _CARTPOLE["specs"] = spec, {k: v for k, v in spec.items() if k != "angles"}
    return _CARTPOLE["specs"]


@settings(max_examples=200, deadline=None)
@given(
    theta=st.floats(-np.pi, np.pi),
    turns=st.integers(-60, 60),
    x=st.floats(-1.2, 1.2),
    x_dot=st.floats(-4.0, 4.0),
    theta_dot=st.floats(-30.0, 30.0),
    action=st.floats(-1.0, 1.0, width=32),
)
def test_the_pole_angle_reads_the_same_after_any_number_of_turns(theta, turns, x, x_dot, theta_dot, action):
    """A pole that fell and spun round is the plant state it is: the shield's action and barrier values at
    theta + 2 pi k are those at theta (the linearization holds near upright; the cart's coupling to the pole,
    linear in the angle, grew with every turn before). Inside (-pi, pi] the reading is bitwise the unwrapped one."""
    with_angles, without = _cartpole_specs()
    obs = np.array([x, theta, x_dot, theta_dot, 0.0])
    turned = obs.copy()
    turned[1] = theta + 2.0 * np.pi * turns
    u = np.float32([action])
    out_turned, info_turned = CbfShield(with_angles).filter(turned, u)
    out, info = CbfShield(with_angles).filter(obs, u)
    if theta > -np.pi:  # in range: exactly what a shield that wraps nothing does
        plain, plain_info = CbfShield(without).filter(obs, u)
        assert out.tobytes() == plain.tobytes() and np.array_equal(info["h"], plain_info["h"])
    assume(abs(float(info["h"].min())) > 1e-6)  # not on the edge where braking starts (a jump there is right)
    assume(np.pi - abs(theta) > 1e-9)  # nor at upside down itself, where a turn's rounding picks the side
    np.testing.assert_allclose(out_turned, out, atol=1e-5)
    np.testing.assert_allclose(info_turned["h"], info["h"], rtol=1e-9, atol=1e-9)
    assert -1.0 <= float(out_turned[0]) <= 1.0


def test_adversary_never_crosses_a_constraint():
    rng = np.random.default_rng(11)
    spec = planar_double_integrator(latency_steps=2, response_time_s=0.05, margin=0.03, input_gain_error=0.3)
    shield = CbfShield(spec)
    worst = np.inf
    for _ in range(30):
        start = np.concatenate([rng.uniform(-1.0, 1.0, 2), np.zeros(2)])
        if np.hypot(start[0] - 0.5, start[1] + 0.5) < 0.6:
            continue
        push = rng.uniform(-1, 1, 2)
        push = (push / np.max(np.abs(push))).astype(np.float32)  # full action toward somewhere
        shield.reset()
        w, _ = _rollout(shield, start, push, 120, rng, accel_error=0.5, noise=0.002, latency=2)
        worst = min(worst, w)
    assert worst > 0.0


def test_shielded_policy_batches_one_shield_per_row():
    spec = planar_double_integrator()
    policy = ShieldedPolicy(lambda o: np.ones((len(o), 2), np.float32), spec)
    obs = np.array([[0, 0, 0, 0], [1.99, 0, 3.0, 0]], np.float32)
    out = policy(obs)
    assert out.shape == (2, 2) and out.dtype == np.float32
    assert not policy.last_infos[0]["intervened"] and policy.last_infos[1]["intervened"]
    np.testing.assert_array_equal(out[0], [1, 1])


@pytest.mark.parametrize("speed", [-3.0, -1.0, 0.0, 1.0, 3.0])
def test_each_bound_brakes_with_the_acceleration_of_its_own_direction(speed):
    """A vertical axis braking at 3.0 m/s^2 toward - (gravity helps stop a climb) and 0.5 toward +:
    h = distance - margin - closing^2 / (2 a), with a the braking that points away from that bound."""
    spec = {
        "schema_version": 1,
        "obs_dim": 2,
        "act_dim": 1,
        "dt": 0.02,
        "action_low": [-1.0],
        "action_high": [1.0],
        "state_index": [0, 1],
        "model": {"type": "double_integrator", "accel_per_action": [[4.0]]},
        "kinematics": {"position_index": [0], "velocity_index": [1], "brake_accel": [[3.0, 0.5]]},
        "constraints": [
            {"name": "floor_ceiling", "type": "box", "index": [0], "low": [0.0], "high": [10.0], "gain": 0.3}
        ],
        "margin": 0.1,
    }
    _, info = CbfShield(spec).filter(np.array([5.0, speed], np.float32), np.zeros(1, np.float32))
    ceiling = 5.0 - 0.1 - max(speed, 0.0) ** 2 / (2 * 3.0)  # a climb is braked toward -
    floor = 5.0 - 0.1 - max(-speed, 0.0) ** 2 / (2 * 0.5)  # a descent is braked toward +
    assert info["h"][0] == pytest.approx(min(ceiling, floor), abs=1e-9)


finite = st.floats(-3.0, 3.0, allow_nan=False)


@settings(max_examples=400, deadline=None)
@given(m=st.integers(1, 3), data=st.data())
def test_projection_onto_one_condition_is_the_kkt_point(m, data):
    """`_project_on_row` (the shield's exact one-condition projection): h(u) = 0 and u - u_p = lam grad h(u), lam > 0.

    h is concave, so its superlevel set is convex and those KKT conditions make u the
    projection; it must converge whenever some input meets the condition.
    """
    a = np.array(data.draw(st.lists(finite, min_size=m, max_size=m)))
    c = np.array(data.draw(st.lists(finite, min_size=m, max_size=m)))
    up = np.array(data.draw(st.lists(finite, min_size=m, max_size=m)))
    b, d = data.draw(finite), data.draw(finite)

    def h(u):
        return a @ u + b - max(0.0, c @ u + d) ** 2

    assume(h(up) < -1e-6)
    u = _project_on_row(up.tolist(), a.tolist(), b, c.tolist(), d)
    if u is None:
        # Allowed only when no input near u_p meets the row (the shield's inputs live in a box of size ~1;
        # a far projection is left to the QP): h is concave, so its maximum over a ball is found reliably.
        best = minimize(
            lambda v: -h(v),
            up,
            method="SLSQP",
            constraints=[{"type": "ineq", "fun": lambda v: 100.0 - (v - up) @ (v - up)}],
        )
        assert -best.fun < 1e-3, (best.x, -best.fun)
        return
    u = np.array(u)
    # Inputs live in a box of size ~1: a projection far away (a row nearly parallel to the closing speed's)
    # is refused by the shield's box check and left to the QP; its KKT residual is ill-conditioned.
    assume(np.abs(u - up).max() < 10.0)
    scale = 1.0 + abs(h(up))
    assert -1e-9 * scale <= h(u) <= 1e-9 * scale
    grad = a - 2.0 * max(0.0, c @ u + d) * c
    if float(grad @ grad) < 1e-12:
        # The gradient vanishes at the solution (a ~ 0, the closing speed brought to 0: a = [0, -1.2e-8, 0] was
        # one): its multiplier is ~1 / |grad| and the KKT residual is rounding; the feasible set near u is a
        # sliver. Then no exactly feasible point the reference solver finds (from u_p) may be closer to u_p.
        ref = minimize(lambda v: (v - up) @ (v - up), up, method="SLSQP", constraints=[{"type": "ineq", "fun": h}])
        if ref.success and h(ref.x) >= 0.0:
            assert np.linalg.norm(u - up) <= np.linalg.norm(ref.x - up) + 1e-6, (u, ref.x)
        return
    lam = float((u - up) @ grad) / float(grad @ grad)
    assert lam > 0.0
    np.testing.assert_allclose(u - up, lam * grad, atol=1e-7 * (1.0 + np.abs(u - up).max()))


def test_projection_onto_a_condition_whose_gradient_vanishes_at_the_solution():
    """The case CI's Hypothesis run found (the check above was ill-conditioned there, the projection right):
    h(u) = -1.2e-8 u1 - (1 - 2 u1 + u2)^2 from u_p = 0. Feasible points need u1 <= 0, so the projection is
    (0, 0, -1), up to the rounding of a gradient of 1e-8."""
    a, c = [0.0, -1.2406544734554076e-08, 0.0], [0.0, -2.0, 1.0]
    u = _project_on_row([0.0, 0.0, 0.0], a, 0.0, c, 1.0)
    assert u is not None
    np.testing.assert_allclose(u, [0.0, 0.0, -1.0], atol=1e-8)


@pytest.mark.parametrize("seed", [0, 1])
def test_quadrotor_filter_matches_reference_qp_near_its_constraints(seed):
    """The quadrotor's spec (3 inputs, input-gain x latency cases, a keep-out credited for passing it): the
    filter's action is the exact projection wherever it is not braking a violated barrier: it meets the conditions
    and is as close to the policy's action as the reference solver's (the cases' rows are nearly parallel, where
    SLSQP may stop short of the optimum: the shield's point is then closer, never farther)."""
    spec = build_shield_spec(load_config(ROOT / "configs" / "quadrotor.yaml"))
    shield = CbfShield(spec)
    low, high = np.array(spec["action_low"]), np.array(spec["action_high"])
    pos, vel = shield.spec.position_index, shield.spec.velocity_index
    rng = np.random.default_rng(seed)
    compared = intervened = 0
    for _ in range(400):
        shield.reset()
        obs = np.zeros(shield.spec.obs_dim, np.float32)
        # Anywhere inside the fence, the person's cylinder included, at up to ~2 m/s per axis.
        obs[pos] = rng.uniform([-4.0, -4.0, 0.5], [4.0, 4.0, 3.5])
        obs[vel] = rng.normal(0.0, 0.7, 3)
        u_p = rng.uniform(low * 1.2, high * 1.2).astype(np.float32)
        conditions = shield.cbf_conditions(obs)
        plain = shield.cbf_conditions(obs, steering=False)  # the keep-out rows without their credit for passing
        u, info = shield.filter(obs, u_p)
        if np.nanmin(info["h"]) < 0 or info["fallback"]:
            continue  # braking, not the projection (tests/shield/test_shield_soundness.py)
        compared += 1
        if not info["intervened"]:  # passed through: accepted with the credit, or without it (either is sound)
            assert np.array_equal(u, u_p)
            assert max(conditions(u.astype(np.float64)).min(), plain(u.astype(np.float64)).min()) >= -1e-6
            continue
        ref = _reference(conditions, u_p.astype(np.float64), low, high)
        intervened += 1
        up = u_p.astype(np.float64)
        assert np.sum((u - up) ** 2) <= np.sum((ref - up) ** 2) + 1e-6  # u is float32
        assert np.min(conditions(u.astype(np.float64))) >= -1e-6
    assert compared > 100 and intervened > 30, (compared, intervened)


@settings(max_examples=300, deadline=None)
@given(m=st.integers(1, 3), rows=st.integers(1, 6), data=st.data())
def test_least_violation_brake_minimizes_the_summed_shortfalls(m, rows, data):
    """The braking fallback is the box input with the least sum of squared normalized shortfalls (a small
    weight on |u| makes it unique), with or without the rows no input in the box can violate."""
    from shield.fallback import least_violation_brake

    G = np.array(data.draw(st.lists(st.lists(finite, min_size=m, max_size=m), min_size=rows, max_size=rows)))
    lb = np.array(data.draw(st.lists(finite, min_size=rows, max_size=rows)))
    low = -np.array(data.draw(st.lists(st.floats(0.1, 2.0), min_size=m, max_size=m)))
    high = np.array(data.draw(st.lists(st.floats(0.1, 2.0), min_size=m, max_size=m)))
    norms = np.linalg.norm(G, axis=1)
    assume(np.all(norms > 1e-3))

    def cost(u):
        short = np.maximum(0.0, lb - G @ u) / norms
        return float(short @ short + 1e-6 * (u @ u))

    u = least_violation_brake(G, lb, low, high, np.zeros(m))
    assert np.all(u >= low) and np.all(u <= high)
    best = minimize(
        cost,
        np.clip(np.zeros(m), low, high),
        method="L-BFGS-B",
        bounds=list(zip(low, high)),
        options={"ftol": 1e-15, "gtol": 1e-12},
    )
    assert cost(u) <= cost(best.x) + 1e-7 * (1.0 + cost(best.x))
