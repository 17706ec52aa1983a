"""CbfShield.note_sent: when the server sends something other than the shield's action, the prediction follows it."""

from __future__ import annotations

import numpy as np
import pytest

from shield.cbf import CbfShield
from tests.shield_specs import planar_double_integrator

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
