"""What calibration may claim: flat directions stay flat, calibrated ranges keep what the logs cannot see.

The exact symmetry of a plant described by mass, damping and gain scales (every one of them x1.3
gives the same trajectories) is checked on the real MuJoCo twin; the reporting around it
(combinations, calibrated ranges) is checked for every such information matrix (Hypothesis).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.calibration.fit import cut_windows
from pipeline.calibration.identify import combinations, consistent_ranges, pinned
from pipeline.calibration.logs import load_field_log
from pipeline.calibration.sets import calibrated_set, recentred_training
from pipeline.calibration.simulate import simulated_log
from pipeline.calibration.twin import Twin
from pipeline.config import load_config, parse_config

ROOT = Path(__file__).resolve().parents[3]
NAMES = ["actuator_gain.cart_force", "body_mass.cart", "body_mass.pole", "joint_damping.hinge", "joint_damping.slider"]


def _arrays(model) -> dict:
    out = {"opt.gravity": model.opt.gravity.copy()}
    for name in dir(model):
        value = getattr(model, name) if not name.startswith("_") else None
        if isinstance(value, np.ndarray):
            out[name] = value.copy()
    return out


def test_the_twins_models_are_the_envs_bit_for_bit_while_its_cache_reuses_them():
    """The twin writes each point's scales over a cached model (a fit asks for thousands): every array of the
    model must be what the task's env builds for the same fixed set, whichever point the reused model held."""
    import gymnasium as gym

    from envs.randomization import sample_domain
    from pipeline.calibration.twin import fixed_set

    cfg = load_config(ROOT / "configs" / "cartpole.yaml")
    twin = Twin(cfg.task.env_id)
    twin.CACHE = 2  # reuse on every other point
    rng = np.random.default_rng(4)
    for i in range(8):
        scales = {k: v for k, v in sample_domain(cfg.randomization["train"], rng).items() if k != "latency_steps"}
        scales = {} if i == 5 else dict(list(scales.items())[:2]) if i == 3 else scales  # other key sets too
        env = gym.make(cfg.task.env_id, randomization=fixed_set(scales) if scales else None, disable_env_checker=True)
        env.reset(seed=0)
        want, got = _arrays(env.unwrapped.model), _arrays(twin.model(scales))
        env.close()
        assert [k for k in want if not np.array_equal(want[k], got[k], equal_nan=True)] == [], (i, scales)


def test_every_mass_damping_and_gain_x13_gives_the_same_trajectories_on_the_twin(tmp_path):
    cfg = load_config(ROOT / "configs" / "cartpole.yaml")
    base = {
        "body_mass.cart": 0.8,
        "body_mass.pole": 0.8,
        "joint_damping.slider": 0.8,
        "joint_damping.hinge": 1.0,
        "actuator_gain.cart_force": 0.8,
    }
    log = load_field_log(
        simulated_log(cfg, base, 0, tmp_path / "log.npz", steps=600), task="cartpole", obs_dim=5, act_dim=1, dt=0.02
    )
    twin = Twin(cfg.task.env_id)
    w = cut_windows(twin, log, horizon=15, stride=16, max_latency=0)
    a = twin.predict(base, w.states, w.controls(0))
    b = twin.predict({k: 1.3 * v for k, v in base.items()}, w.states, w.controls(0))
    assert np.max(np.abs(a - b)) < 1e-6 * np.max(np.abs(a))
    moved = twin.predict({**base, "body_mass.cart": 1.04}, w.states, w.controls(0))
    assert np.max(np.abs(a - moved)) > 1e-3 * np.max(np.abs(a))  # one scale alone is not flat


def _symmetric_information(seed: int, noise: float):
    """An information matrix whose only flat direction is 'every log-scale +t', and a sandwich meat."""
    rng = np.random.default_rng(seed)
    ones = np.ones(5) / math.sqrt(5)
    j = rng.normal(size=(40, 5))
    j -= np.outer(j @ ones, ones)  # no row sees the common scale
    a = j.T @ j * 1e4
    b = a * noise**2  # the meat of a well-specified fit: A sigma^2
    return a, b


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), noise=st.floats(0.01, 1.0), shift=st.floats(-0.3, 0.3))
def test_the_common_scale_is_reported_flat_and_calibrated_ranges_span_the_configured_box_along_it(seed, noise, shift):
    a, b = _symmetric_information(seed, noise)
    lo, hi = np.log([0.75, 0.75, 0.75, 0.5, 0.7]), np.log([1.1, 1.4, 1.5, 4.0, 1.5])
    theta = 0.5 * (lo + hi) + np.array([0.0, 0.05, -0.05, 0.1, 0.0])
    combos = combinations(a, b, theta + shift, NAMES, lo, hi)  # the fit may stop anywhere on the flat line
    flat = [np.array([c["weights"][n] for n in NAMES]) for c in combos if not c["identified"]]
    assert flat, combos
    ones = np.ones(5) / math.sqrt(5)
    assert any(abs(f @ ones) / np.linalg.norm(f) > 0.999 for f in flat)
    for c in combos:  # every identified combination is blind to the common scale
        if c["identified"]:
            w = np.array([c["weights"][n] for n in NAMES])
            assert abs(w @ ones) < 1e-6 * np.linalg.norm(w)
            assert c["interval"][0] <= math.exp(w @ theta) <= c["interval"][1]
    assert not any(pinned(combos, NAMES))  # no single parameter is claimed
    ranges = consistent_ranges(combos, NAMES, lo, hi)
    # Every plant on the flat line through the truth that the config allows is kept.
    for t in np.linspace(-1.0, 1.0, 41):
        p = theta + t
        if np.all(p >= lo) and np.all(p <= hi):
            assert np.all(ranges[:, 0] <= p + 1e-9) and np.all(p - 1e-9 <= ranges[:, 1])


def test_a_parameter_alone_is_pinned_only_when_the_logs_see_it_alone():
    a = np.diag([1e4, 1e4, 1e-12, 1e4, 1e4])  # the pole's mass is invisible, the rest seen apiece
    lo, hi = np.log([0.75, 0.75, 0.75, 0.5, 0.7]), np.log([1.1, 1.4, 1.5, 4.0, 1.5])
    combos = combinations(a, a * 0.01, np.zeros(5), NAMES, lo, hi)
    assert pinned(combos, NAMES) == [True, True, False, True, True]
    ranges = consistent_ranges(combos, NAMES, lo, hi)
    assert np.allclose(ranges[2], [lo[2], hi[2]])  # the unseen one keeps its configured range


def test_calibrated_ranges_keep_each_configured_distribution():
    cfg = load_config(ROOT / "configs" / "cartpole.yaml")
    params = {n: {"identified": 1.0, "identified_ok": n != "joint_damping.hinge", "range": [0.9, 1.2]} for n in NAMES}
    params["joint_damping.hinge"]["range"] = [0.6, 3.5]
    result = {
        "parameters": params,
        "latency_steps": {"identified": 1},
        "obs_noise_std": [0.003, 0.006, 0.015, 0.03, 0.0],
    }
    result["calibrated"] = calibrated_set(result, cfg.randomization["reality"], cfg)
    assert result["calibrated"]["joint_damping"]["hinge"]["dist"] == "loguniform"
    assert result["calibrated"]["body_mass"]["cart"]["dist"] == "uniform"
    derived = parse_config(recentred_training(cfg, result), "derived")
    assert derived.randomization["calibrated"].joint_damping["hinge"].dist == "loguniform"
    assert derived.randomization["train"].joint_damping["hinge"].dist == "loguniform"


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), moved=st.integers(0, 4), shift=st.floats(0.2, 1.5))
def test_a_combination_the_fits_assumptions_move_is_not_claimed(seed, moved, shift):
    """The joint fit's optimum along a barely seen direction is set by its assumptions, not the logs.

    The information matrix can still look sharp there; a direction that moves by `shift` (log scale)
    when the process spread or the loss's knee change must not be identified, and every identified
    combination's interval carries its own (small) shift.
    """
    a = np.diag([1e4, 1e4, 1e4, 1e4, 1e4])  # every parameter seen sharply by the curvature alone
    lo, hi = np.log([0.75, 0.75, 0.75, 0.5, 0.7]), np.log([1.1, 1.4, 1.5, 4.0, 1.5])
    rng = np.random.default_rng(seed)
    shifts = rng.normal(scale=0.004, size=(4, 5))
    shifts[:, moved] += shift * np.array([1.0, -1.0, 0.5, -0.8])
    combos = combinations(a, a * 0.01, np.zeros(5), NAMES, lo, hi, shifts)
    baseline = combinations(a, a * 0.01, np.zeros(5), NAMES, lo, hi)
    assert all(c["identified"] for c in baseline)  # without the shifts all five would be claimed
    for c in combos:
        w = np.array([c["weights"][n] for n in NAMES])
        if abs(w[moved]) > 0.5:
            assert not c["identified"], c
        else:
            assert c["identified"] and c["log_std"] >= math.sqrt(np.mean((shifts @ w) ** 2)), c
    assert not pinned(combos, NAMES)[moved]
    ranges = consistent_ranges(combos, NAMES, lo, hi)
    assert np.allclose(ranges[moved], [lo[moved], hi[moved]])  # its configured range is kept
