"""A two-mass spring (a motor cart driving a load cart through a spring), declared by an outside user from the docs
(configs/two_mass_spring.yaml): limits on combinations of states (the load's position x_m + s; in world coordinates
the stretch x_l - x_m), and in world coordinates a load the drive reaches only through the spring."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HERE = Path(__file__).parent


def test_synthesis_samples_only_states_inside_the_halfspace_limits():
    """The state box is drawn per coordinate; a limit on a combination (the load at x_m + s within +-0.5 m) must
    hold too, else braking and model error are measured at states the plant is never in (a load 1 m out)."""
    from pipeline.config import load_config
    from pipeline.safety.sampling import EnvelopeSampler

    cfg = load_config("configs/two_mass_spring.yaml")
    env = EnvelopeSampler(cfg, np.random.default_rng(0), draws=2)
    env.reach_box()
    W, b, _ = env.halfspaces
    assert len(b) == 2
    states = np.array([env.draw_state() for _ in range(2000)])
    assert np.all(states @ W.T <= b + 1e-9)
    # and the draws still reach the limit: the pull-in stops at the boundary, it does not empty the corners
    assert np.max(states @ W.T - b) > -0.01


def test_a_load_reached_only_through_the_spring_gives_no_input_gain():
    """In world coordinates the drive moves the load only through the spring within a control period (a
    second-order sliver of the motor cart's response): its response says nothing about the drive's gain, and a
    ratio of slivers (once -0.31x) must not refuse the plant as a drive too weak for any shield."""
    from pipeline.config import load_config
    from pipeline.safety import synthesis
    from pipeline.safety.sampling import EnvelopeSampler

    cfg = load_config(HERE / "plants" / "two_mass_spring_abs.yaml")
    env = EnvelopeSampler(cfg, np.random.default_rng(0), draws=2)
    env.reach_box()
    assert env.driven_positions() == [0]  # the motor cart, not the load
    meas = synthesis.measure(cfg, samples=2000)
    (lo_m, hi_m), (lo_l, hi_l) = meas.gain_range
    assert 0.8 < lo_m <= 1.0 <= hi_m < 1.25  # the drive's 0.9-1.1 over the motor cart's mass
    assert (lo_l, hi_l) == (1.0, 1.0) and synthesis.gain_problems(meas) == []


def test_in_world_coordinates_the_spring_is_kept_by_a_tube_that_grows_with_the_state_and_the_actions():
    """Declared in world coordinates, the legacy LQR weighs the load and the spring rings under it: one tube for
    every state left the stretch no room even at rest (slack -0.012), and a tube growing with the state alone
    still did, so the plant was refused. The tube that also grows with the actions in flight, tightest where the
    legacy controller runs, holds it: the spec is built with no number set by hand and keeps the adversary and
    the legacy controller inside every limit on `reality`, where the bare adversary leaves them."""
    from pipeline.config import load_config
    from pipeline.safety.certificate import certificate
    from pipeline.safety.predictive import holding_problem
    from pipeline.safety.shield_spec import build_shield_spec
    from tests.helpers.shield_specs import assert_kept_on_reality

    cfg = load_config(HERE / "plants" / "two_mass_spring_abs.yaml")
    spec = build_shield_spec(cfg)
    record = certificate(cfg, None, spec, None, None)
    assert record["filter"]["type"] == "predictive" and record["shield_numbers"]["set_by_hand"] == []
    section = spec["predictive"]
    assert holding_problem(spec) is None
    assert np.any(np.asarray(section["tube_action_slope"]) > 0.0)
    assert_kept_on_reality(cfg, spec, seed=2)
