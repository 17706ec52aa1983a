"""CbfShield.note_sent: when the server sends something other than the shield's action, the prediction follows it."""

from __future__ import annotations

import numpy as np
import pytest

from shield.cbf import CbfShield
from tests.helpers.shield_specs import planar_double_integrator

FALLBACK = np.zeros(2, np.float32)  # the spec's fallback action


def _trajectory(rng, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Observations drifting toward the +x fence and pushes toward it (so later steps intervene)."""
    obs = np.zeros((steps, 4), np.float32)
    obs[:, 0] = np.linspace(1.2, 1.7, steps)
    obs[:, 2] = 1.5
    obs[:, 1] = rng.uniform(-0.5, 0.5, steps)
    pushes = np.tile(np.array([1.0, 0.3], np.float32), (steps, 1))
    return obs, pushes


@pytest.mark.parametrize("latency_steps,response_time_s", [(2, 0.0), (0, 0.05), (1, 0.05)])
def test_overridden_step_predicts_like_a_shield_that_sent_the_override(latency_steps, response_time_s):
    spec = planar_double_integrator(latency_steps, response_time_s, input_gain_error=0.3)
    overridden, reference, unaware = CbfShield(spec), CbfShield(spec), CbfShield(spec)
    obs, pushes = _trajectory(np.random.default_rng(0), 12)
    calm = np.array([0.0, 0.0, 0.0, 0.0], np.float32)  # at rest in the middle: the fallback passes unchanged
    # Step 0: the policy's push is shielded, but the server sends the fallback instead (a deadline overrun).
    u, _ = overridden.filter(calm, np.array([1.0, 1.0], np.float32))
    assert not np.array_equal(u, FALLBACK)
    overridden.note_sent(FALLBACK)
    unaware.filter(calm, np.array([1.0, 1.0], np.float32))
    # The reference shield really was asked for the fallback at step 0 and passed it through.
    u_ref, info = reference.filter(calm, FALLBACK)
    assert u_ref.tobytes() == FALLBACK.tobytes() and not info["intervened"]
    differs = False
    for o, a in zip(obs, pushes):
        u1, i1 = overridden.filter(o, a)
        u2, i2 = reference.filter(o, a)
        u3, i3 = unaware.filter(o, a)
        assert u1.tobytes() == u2.tobytes()
        np.testing.assert_array_equal(i1["h"], i2["h"])
        differs |= not np.array_equal(i1["h"], i3["h"])
    assert differs, "without note_sent the prediction should have gone wrong"


def test_note_sent_without_a_filter_call_or_with_bad_values_changes_nothing():
    spec = planar_double_integrator(latency_steps=1, response_time_s=0.05)
    shield, reference = CbfShield(spec), CbfShield(spec)
    shield.note_sent(np.array([1.0, -1.0], np.float32))  # nothing sent since reset: ignored
    o = np.array([1.5, 0.0, 1.0, 0.0], np.float32)
    a = np.array([0.5, 0.5], np.float32)
    for bad in (np.array([np.nan, 0.0]), np.array([np.inf, 0.0]), np.zeros(3)):
        u1, i1 = shield.filter(o, a)
        u2, i2 = reference.filter(o, a)
        shield.note_sent(bad)  # not an action the plant can have got: ignored
        assert u1.tobytes() == u2.tobytes()
        np.testing.assert_array_equal(i1["h"], i2["h"])
    u1, i1 = shield.filter(o, a)
    u2, i2 = reference.filter(o, a)
    assert u1.tobytes() == u2.tobytes()
    np.testing.assert_array_equal(i1["h"], i2["h"])


def test_a_resent_action_moves_the_prediction_of_a_plant_that_applies_it_at_once():
    """With latency cases (`latency_min_steps`), a plant with no latency applies the action it is sent during this
    period: when the server sends another one instead (`note_sent`), that case's predicted next state must follow
    it, exactly as if that action had been committed in the first place; the delayed cases are untouched."""
    from shield.prediction import LatencyPredictor

    rng = np.random.default_rng(3)
    A = np.eye(4) + np.diag([0.05, 0.05], 2)
    B = np.vstack([np.zeros((2, 2)), 0.2 * np.eye(2)])
    c = np.array([0.0, 0.0, 0.0, -0.1])
    history = [(rng.uniform(-1, 1, 4), rng.uniform(-1, 1, 2)) for _ in range(3)]  # states seen, actions sent
    sent, other = rng.uniform(-1, 1, 2), rng.uniform(-1, 1, 2)
    made = []
    for _ in range(2):
        p = LatencyPredictor(
            A, B, [c, c, c], [1.0, 1.2, 0.8], 2, 4, [np.zeros(0)] * 3, np.zeros(2), latencies=[2, 1, 0]
        )
        for x, u in history:
            p.load_observation(np.tile(x, 3))
            p.commit(u, have_state=True)
        p.load_observation(np.tile([0.3, -0.2, 0.5, 0.1], 3))
        made.append(p)
    made[0].commit(sent, have_state=True)
    before = made[0]._next.copy()
    made[0].resend(other)
    made[1].commit(other, have_state=True)
    np.testing.assert_allclose(made[0]._next, made[1]._next, rtol=0, atol=1e-12)
    assert np.array_equal(made[0].v, made[1].v)
    assert np.array_equal(made[0]._next[:8], before[:8]) and not np.allclose(made[0]._next[8:], before[8:])
