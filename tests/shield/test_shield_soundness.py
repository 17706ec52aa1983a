"""Issue 11 point 2: sound in every finite state.

Where a barrier row is violated at the state the next action acts on (h(x_L) < 0:
outside the safe set, or too fast to stop before the boundary), the shield brakes
as hard as the model allows, whatever the speed: every input that row moves sits
at the box end that raises it fastest, so its next-state barrier value is the
largest any action in the box gives. Hypothesis over states far outside the safe
set and huge speeds, every constraint type, both tasks' specs, every latency from
0 to the maximum.
"""

from __future__ import annotations

import copy
import functools
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from shield.cbf import CbfShield
from tests.helpers.shield_specs import planar_double_integrator


@functools.cache
def _task_spec(task: str) -> dict:
    from pipeline.config import load_config
    from pipeline.safety.shield_spec import build_shield_spec

    return build_shield_spec(load_config(f"configs/{task}.yaml"))


def _sphere_spec(latency: int) -> dict:
    """A 3-D point mass with every constraint type (the planar spec has no sphere)."""
    return {
        "schema_version": 1,
        "obs_dim": 6,
        "act_dim": 3,
        "dt": 0.02,
        "action_low": [-1.0] * 3,
        "action_high": [1.0] * 3,
        "state_index": list(range(6)),
        "model": {
            "type": "double_integrator",
            "accel_per_action": np.diag([4.0] * 3).tolist(),
            "response_time_s": 0.05,
        },
        "kinematics": {"position_index": [0, 1, 2], "velocity_index": [3, 4, 5], "brake_accel": [2.0] * 3},
        "constraints": [
            {"name": "room", "type": "box", "index": [0, 1, 2], "low": [-3, -3, 0], "high": [3, 3, 3], "gain": 0.3},
            {"name": "ball", "type": "sphere", "index": [0, 1, 2], "center": [1, 1, 1.5], "radius": 0.5, "gain": 0.4},
            {"name": "post", "type": "cylinder", "index": [0, 1], "center": [-1, -1], "radius": 0.3},
            {"name": "slope", "type": "halfspace", "a": [0, 1, 1, 0, 0, 0], "b": 5.0},
        ],
        "latency_steps": latency,
        "margin": 0.05,
        "input_gain_error": 0.3,
        "disturbance_accel": [0.5, 0.5, 0.5],
    }


def _spec(name: str, latency: int) -> dict:
    if name == "planar":
        return planar_double_integrator(latency_steps=latency, response_time_s=0.05, input_gain_error=0.3)
    if name == "point3d":
        return _sphere_spec(latency)
    spec = copy.deepcopy(_task_spec(name))
    spec["latency_steps"] = latency
    return spec


# (spec, largest latency tested): the tasks' specs predict through up to 2 steps.
SPECS = [("planar", 3), ("point3d", 3), ("cartpole", 2), ("quadrotor", 2)]
big = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)
moderate = st.floats(-20, 20, allow_nan=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(which=st.sampled_from(SPECS), data=st.data())
def test_a_violated_barrier_gets_the_hardest_brake(which, data):
    name, max_latency = which
    latency = data.draw(st.integers(0, max_latency), label="latency")
    spec = _spec(name, latency)
    shield = CbfShield(spec)
    obs_dim, m = spec["obs_dim"], spec["act_dim"]
    scale = data.draw(st.sampled_from([moderate, big]), label="scale")
    obs = np.array(data.draw(st.lists(scale, min_size=obs_dim, max_size=obs_dim), label="obs"), np.float32)
    raw = np.array(data.draw(st.lists(st.floats(-1, 1), min_size=m, max_size=m), label="raw"), np.float32)
    assume(np.all(np.isfinite(obs)))
    conditions = shield.cbf_conditions(obs, steering=False)  # a violated keep-out brakes without its passing credit
    u, info = shield.filter(obs, raw)
    assert np.all(np.isfinite(u)) and np.all(u >= -1) and np.all(u <= 1)
    C = shield._cases
    violated = (shield._H[:C] < 0.0).reshape(-1)  # h(x_L) per case and row, from this call
    assume(violated.any())
    assert info["fallback"]  # braking mode is reported
    vertices = [np.array(v, np.float64) for v in itertools.product([-1.0, 1.0], repeat=m)]
    values = np.array([conditions(v) for v in vertices])[:, violated]  # next-state barrier term per vertex
    best = values.max(axis=0)
    # Only states where one vertex is best for every violated row at once (no two rows pulling opposite ways).
    assume(np.any(np.all(values >= best - 1e-9 * (1 + np.abs(best)), axis=1)))
    got = conditions(u.astype(np.float64))[violated]
    assert np.all(got >= best - 1e-6 * (1 + np.abs(best))), (got, best)


@pytest.mark.parametrize("speed", [10.0, 100.0, 1e4, 1e8])
@pytest.mark.parametrize("latency", [0, 1, 2])
def test_cartpole_outside_its_band_at_any_speed_brakes_at_full_force(speed, latency):
    # Issue 11: at 1.5 m moving outward at 100 m/s the shield returned the raw +1.
    shield = CbfShield(_spec("cartpole", latency))
    u, info = shield.filter(np.array([1.5, 0.0, speed, 0.0, 0.0], np.float32), np.array([1.0], np.float32))
    assert u[0] == -1.0 and info["intervened"]
