"""A server's new plant gets a shield cloned from the runtime's first one (`PredictiveFilter.clone`): the spec's
matrices shared, its buffers its own. Each clone answers bit for bit as a shield built from scratch, and plants
whose shields share the matrices, stepped interleaved, answer as if each were alone."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shield.cbf import CbfShield
from shield.spec import ShieldSpec
from tests.helpers.predictive_specs import THETA_MAX, X_MAX
from tests.shield.test_predictive_state_tube import ACTION_SLOPED, SLOPED

SPECS = {"sloped": ShieldSpec.from_dict(SLOPED), "action_sloped": ShieldSpec.from_dict(ACTION_SLOPED)}

steps = st.lists(
    st.tuples(
        st.floats(-1.2 * X_MAX, 1.2 * X_MAX),
        st.floats(-1.2 * THETA_MAX, 1.2 * THETA_MAX),
        st.floats(-2.0, 2.0),
        st.floats(-3.0, 3.0),
        st.floats(-1.5, 1.5),
    ),
    min_size=1,
    max_size=12,
)


def _run(shield: CbfShield, trajectory: list) -> list:
    out = []
    for x, theta, v, omega, u in trajectory:
        obs = np.array([x, theta, v, omega], np.float32)[: shield.spec.obs_dim]
        safe, info = shield.filter(obs, np.array([u], np.float32))
        out.append((safe.tobytes(), info["intervened"], info["fallback"], np.asarray(info["h"]).tobytes()))
    return out


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(SPECS)), a=steps, b=steps)
def test_cloned_shields_answer_as_shields_built_alone_even_interleaved(name, a, b):
    spec = SPECS[name]
    template = CbfShield(spec)
    _run(template, b)  # the template's own buffers hold another plant's last step
    alone_a, alone_b = _run(CbfShield(spec), a), _run(CbfShield(spec), b)
    first, second = CbfShield(spec, template=template), CbfShield(spec, template=template)
    assert first._predictive is not template._predictive and first._predictive._MT is template._predictive._MT
    got_a, got_b = [], []
    for i in range(max(len(a), len(b))):  # one step of each plant in turn, as a server's loop takes them
        got_a += _run(first, a[i : i + 1])
        got_b += _run(second, b[i : i + 1])
    assert got_a == alone_a and got_b == alone_b
