"""One constraint definition (issue 14 point 2): the env's cost and the shield's barrier come from the same objects.

On every constraint type, for any state: h < 0 exactly when the cost is 1 on the
true state, where the cost is what `envs.safety` reports and h both the
constraint's value and the barrier value the CbfShield computes (at rest, no
margin, no latency: the barrier is then exactly the distance).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from envs.safety import violated_constraints
from shield.cbf import CbfShield
from shield.constraints import CONSTRAINT_TYPES, ConstraintError, parse_constraint

OBS_DIM = 6  # [p0, p1, p2, v0, v1, v2]
coord = st.floats(-5.0, 5.0, allow_nan=False)
positions = st.lists(coord, min_size=3, max_size=3)


@st.composite
def constraints(draw, kind=None):
    kind = kind or draw(st.sampled_from(CONSTRAINT_TYPES))
    if kind == "halfspace":
        a = draw(st.lists(st.floats(-2, 2), min_size=3, max_size=3).filter(lambda v: math.hypot(*v) > 0.1))
        return {"name": "c", "type": kind, "a": a + [0.0] * 3, "b": draw(coord)}
    if kind == "box":
        idx = draw(st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True))
        lo = [draw(st.floats(-4, 0)) for _ in idx]
        hi = [lo_i + draw(st.floats(0.1, 6)) for lo_i in lo]
        return {"name": "c", "type": kind, "index": idx, "low": lo, "high": hi}
    dim = 2 if kind == "cylinder" else 3
    return {
        "name": "c",
        "type": kind,
        "index": list(range(dim)),
        "center": [draw(coord) for _ in range(dim)],
        "radius": draw(st.floats(0.1, 3)),
    }


def _geometric(con: dict, p: list[float]) -> bool:
    """The textbook definition of a violation, written independently of shield.constraints."""
    if con["type"] == "halfspace":
        return sum(a * x for a, x in zip(con["a"], p)) > con["b"]
    if con["type"] == "box":
        return any(p[i] < lo or p[i] > hi for i, lo, hi in zip(con["index"], con["low"], con["high"]))
    return math.dist([p[i] for i in con["index"]], con["center"]) < con["radius"]


def _spec(con: dict) -> dict:
    return {
        "schema_version": 1,
        "obs_dim": OBS_DIM,
        "act_dim": 3,
        "dt": 0.05,
        "action_low": [-1.0] * 3,
        "action_high": [1.0] * 3,
        "state_index": list(range(OBS_DIM)),
        "model": {"type": "double_integrator", "accel_per_action": np.diag([4.0] * 3).tolist()},
        "kinematics": {"position_index": [0, 1, 2], "velocity_index": [3, 4, 5], "brake_accel": [2.0] * 3},
        "constraints": [dict(con, gain=0.5)],
        "latency_steps": 0,
        "margin": 0.0,
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(con=constraints(), p=positions)
def test_cost_and_barrier_agree_with_the_geometry_on_every_type(con, p):
    obs32 = np.asarray(p + [0.0, 0.0, 0.0], np.float32)  # at rest: the barrier is the distance itself
    obs = obs32.tolist()  # the true state as the env holds it
    c = parse_constraint(con, "c", OBS_DIM)
    h = c.value(obs)
    assert c.violated(obs) == (h < 0) == _geometric(con, obs)
    cost = 1.0 if violated_constraints({"constraints": [con]}, obs32) else 0.0
    assert (cost == 1.0) == (h < 0)
    assume(abs(h) > 1e-9)  # the barrier's matrix arithmetic may round differently exactly on the boundary
    _, info = CbfShield(_spec(con)).filter(obs32, np.zeros(3, np.float32))
    h_shield = float(info["h"][0])
    assert (h_shield < 0) == (cost == 1.0)
    assert h_shield == pytest.approx(h, abs=1e-5)


@pytest.mark.parametrize("kind", CONSTRAINT_TYPES)
def test_rows_and_nearest_point_toward_violation(kind):
    con = {
        "halfspace": {"name": "c", "type": kind, "a": [1, 0, 0, 0, 0, 0], "b": 1.0},
        "box": {"name": "c", "type": kind, "index": [0], "low": [-1.0], "high": [1.0]},
        "cylinder": {"name": "c", "type": kind, "index": [0, 1], "center": [2.0, 0.0], "radius": 0.5},
        "sphere": {"name": "c", "type": kind, "index": [0, 1, 2], "center": [2.0, 0.0, 0.0], "radius": 0.5},
    }[kind]
    c = parse_constraint(con, "c", OBS_DIM)
    d, direction = c.nearest([0.5, 0, 0, 0, 0, 0])
    assert d == pytest.approx(c.value([0.5, 0, 0, 0, 0, 0])) and direction[0] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "con,key",
    [
        ({"name": "c", "type": "donut"}, "c.type"),
        ({"name": "c", "type": "box", "index": [0], "low": [1.0], "high": [0.0]}, "c.low[0]"),
        ({"name": "c", "type": "box", "index": [0], "low": [-math.inf], "high": [math.inf]}, "finite bound"),
        ({"name": "c", "type": "sphere", "index": [0, 1], "center": [0, 0], "radius": 1}, "c.index"),
        ({"name": "c", "type": "cylinder", "index": [0, 1], "center": [0, 0], "radius": 0}, "c.radius"),
        ({"name": "c", "type": "halfspace", "a": [0] * 6, "b": 1}, "c.a"),
        ({"name": "c", "type": "halfspace", "a": [1] + [0] * 5, "b": 1, "extra": 2}, "c.extra"),
    ],
)
def test_a_bad_constraint_names_its_key(con, key):
    with pytest.raises(ConstraintError, match=key.replace("[", r"\[").replace("]", r"\]")):
        parse_constraint(con, "c", OBS_DIM)
