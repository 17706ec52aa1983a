"""A tube that grows with the state is fitted to sampled plans, and a sample covers what it saw: the filter rides the
edge of the states it admits (a policy pushing toward a limit is held there), where the plant is far from the
operating point in several states at once, and uniform draws land there too rarely. Synthesis therefore starts
half of those plans at that edge, and checks the fit on plans it has not seen before it ships it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.safety import predictive


@settings(max_examples=60, deadline=None)
@given(
    direction=st.lists(st.floats(-1.0, 1.0), min_size=3, max_size=3).filter(lambda d: np.linalg.norm(d) > 0.05),
    radius=st.floats(0.2, 3.0),
    start=st.floats(0.05, 0.95),
)
def test_the_edge_is_the_farthest_admitted_state_on_the_ray_within_the_box(direction, radius, start):
    """For an admitted set (a ball of `radius`) and a box of half-width 2: the state found is admitted, on the ray
    from the operating point through the drawn state, and within one bisection's width of the set's edge (or the
    box's, whichever comes first)."""
    x_op = np.array([0.5, -0.2, 0.1])
    d = np.asarray(direction) / np.linalg.norm(direction)
    lo, hi = x_op - 2.0, x_op + 2.0
    inside = min(radius, 2.0)  # the drawn state lies inside both
    x = x_op + start * inside * d

    def admitted(seen, queue):
        return float(np.linalg.norm(seen - x_op)) <= radius

    edge = predictive._edge(x, [], np.zeros(3), admitted, x_op, lo, hi)
    along = edge - x_op
    assert admitted(edge, [])
    assert np.allclose(along / np.linalg.norm(along), d)
    box_reach = float(np.min(np.where(d != 0, 2.0 / np.maximum(np.abs(d), 1e-12), np.inf)))
    far = min(radius, box_reach)
    scale = box_reach / (start * inside)  # the ray's length to the box in units of |x - x_op|
    width = scale * start * inside / 2**predictive.EDGE_BISECTIONS
    assert far - width - 1e-9 <= np.linalg.norm(along) <= far + 1e-9


def test_a_state_outside_the_admitted_edge_is_not_moved():
    x_op = np.zeros(2)
    x = np.array([0.5, 0.0])
    same = predictive._edge(x, [], np.zeros(2), lambda seen, q: False, x_op, x_op - 0.5, x_op + 0.5)
    assert np.array_equal(same, x)  # already at the box: nothing farther to find


def _samples(rng, plans: int, slope: float):
    """Plans whose error at each of 3 steps is `slope` x |phi_0| + 0.01 on one state, phi over [0, 1]^2."""
    phis = rng.uniform(0.0, 1.0, (plans, 2))
    acts = rng.uniform(0.0, 1.0, (plans, 1))
    errs = (slope * phis[:, :1] + 0.01)[:, None, :] * np.ones((1, 3, 1))
    return phis, np.concatenate([errs, np.zeros_like(errs)], axis=2), acts


def test_a_fit_covers_its_own_plans_and_reports_how_far_it_misses_others():
    rng = np.random.default_rng(0)
    phis, errs, acts = _samples(rng, 200, 0.3)
    base, slope, act_slope, _ = predictive.state_dependent_tube(phis, errs, acts)
    floor = np.zeros(base.shape)
    own, missed = predictive.tube_coverage(base, slope, act_slope, floor, phis, errs, acts)
    assert own <= 1.0 / predictive.INFLATION + 1e-6 and missed == 0
    # Plans where the error grows twice as fast with the state: missed, by a stated ratio over 1.
    far, worse, far_acts = _samples(rng, 50, 0.6)
    far[:, 0] = 1.0
    worse = (0.6 * far[:, :1] + 0.01)[:, None, :] * np.ones((1, 3, 1))
    worse = np.concatenate([worse, np.zeros_like(worse)], axis=2)
    assert predictive.tube_coverage(base, slope, act_slope, floor, far, worse, far_acts)[0] == pytest.approx(
        0.61 / (0.31 * predictive.INFLATION), rel=0.05
    )
    # Per plan: every one of those is missed; of them and the fitted ones together, still those 50.
    both = [np.concatenate(pair) for pair in ((phis, far), (errs, worse), (acts, far_acts))]
    assert predictive.tube_coverage(base, slope, act_slope, floor, far, worse, far_acts)[1] == 50
    assert predictive.tube_coverage(base, slope, act_slope, floor, *both)[1] == 50
    # Error on a state the tube is 0 at: no ratio covers it.
    worse[:, :, 1] = 0.01
    assert predictive.tube_coverage(base, slope, act_slope, floor, far, worse, far_acts)[0] == np.inf


@settings(max_examples=60, deadline=None)
@given(plans=st.integers(1, 20_000), data=st.data())
def test_the_stated_miss_rate_is_the_exact_one_sided_bound(plans, data):
    """The share of fresh plans the shipped tube misses is stated as the rate at which seeing this few misses (or
    fewer) is only 5 % likely: above the share seen, and about 3 / plans where none was missed."""
    from scipy.stats import binom

    missed = data.draw(st.integers(0, plans - 1))
    bound = predictive.miss_rate_bound(missed, plans)
    assert missed / plans < bound < 1.0
    assert binom.cdf(missed, plans, bound) == pytest.approx(1.0 - predictive.CONFIDENCE, rel=1e-6)
    if missed == 0:
        assert bound == pytest.approx(1.0 - (1.0 - predictive.CONFIDENCE) ** (1.0 / plans), rel=1e-9)
        assert bound <= 3.0 / plans
    assert predictive.miss_rate_bound(plans, plans) == 1.0 and predictive.miss_rate_bound(0, 0) == 1.0


def test_a_free_states_slope_is_zero_and_the_fit_still_covers_every_plan():
    """A free state (a wheel's angle no limit reads) is measured at distance 0 in every plan, so no plan bounds the
    fit's slope on it; at the edge that distance is the angle after any number of turns. Its slope is held at 0 in
    the fit itself: here the plans' error even grows with it, and the fit covers them without it."""
    rng = np.random.default_rng(1)
    phis, errs, acts = _samples(rng, 200, 0.3)
    errs = errs + (0.2 * phis[:, 1:2])[:, None, :] * np.array([1.0, 0.0])[None, None, :]
    unbound = predictive.state_dependent_tube(phis, errs, acts)[1]
    assert unbound[:, 0, 1].min() > 0.1  # the fit would lean on state 1
    base, slope, act_slope, _ = predictive.state_dependent_tube(phis, errs, acts, free=[1])
    assert np.all(slope[:, :, 1] == 0.0)
    assert slope[:, 0, 0].max() > 0.0  # the state the error grows with keeps its slope
    own, missed = predictive.tube_coverage(base, slope, act_slope, np.zeros(base.shape), phis, errs, acts)
    assert own <= 1.0 / predictive.INFLATION + 1e-6 and missed == 0
    # A wheel 40 turns on: the same tube as where the plans started.
    turned = phis.copy()
    turned[:, 1] = 80 * np.pi
    assert np.array_equal(
        predictive.tube_at(base, slope, act_slope, None, turned, acts),
        predictive.tube_at(base, slope, act_slope, None, phis, acts),
    )
