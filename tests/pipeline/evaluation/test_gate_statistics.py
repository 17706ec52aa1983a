"""The gate's statistics on synthetic paired samples: exact rate bounds match their closed form, and the sequential
gate (the real `decide`, look after look) never promotes an equal candidate more often than its confidence allows."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy.stats import binom

from pipeline.config import GateConfig
from pipeline.evaluation.gate import decide
from pipeline.evaluation.gate_statistics import (
    clopper_pearson_lower,
    clopper_pearson_upper,
    episode_rate_bounds,
    look_sizes,
    lossless_episodes,
    lost_rate_bounds,
    paired_bound,
    planned_looks,
)

LEGACY_MEAN = 400.0  # return units: the size of a cart-pole episode's return


@given(n=st.integers(1, 5000), confidence=st.sampled_from([0.9, 0.95, 0.99]))
def test_zero_of_n_is_bounded_by_the_closed_form(n, confidence):
    alpha = 1.0 - confidence
    upper = clopper_pearson_upper(0, n, alpha)
    assert upper == pytest.approx(1.0 - alpha ** (1.0 / n), rel=1e-12)
    assert upper > 0.0  # never "0 of n, so 0"
    if n >= 30 and confidence == 0.95:  # the rule of three: about 3/n
        assert upper == pytest.approx(3.0 / n, rel=0.1)


@given(n=st.integers(2, 3000), data=st.data(), confidence=st.sampled_from([0.9, 0.95, 0.99]))
def test_exact_bounds_solve_the_binomial_tail(n, data, confidence):
    k = data.draw(st.integers(1, n - 1))
    alpha = 1.0 - confidence
    upper, lower = clopper_pearson_upper(k, n, alpha), clopper_pearson_lower(k, n, alpha)
    assert lower < k / n < upper
    # Clopper-Pearson: the rate at which seeing <= k (>= k) events has probability exactly alpha.
    assert binom.cdf(k, n, upper) == pytest.approx(alpha, rel=1e-6)
    assert binom.sf(k - 1, n, lower) == pytest.approx(alpha, rel=1e-6)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(5, 40), shift=st.floats(-1e3, 1e3), scale=st.floats(0.01, 100.0), seed=st.integers(0, 2**16))
def test_paired_bound_moves_with_the_data(n, shift, scale, seed):
    """The bounds bracket the mean, and shift and scale with the returns (units in, units out); same data, same
    bounds (a report is reproducible)."""
    rng = np.random.default_rng(seed)
    legacy = rng.normal(LEGACY_MEAN, 50.0, n)
    d = rng.normal(0.0, 1.0, n)
    base = paired_bound(legacy + d, legacy, 0.05)
    moved = paired_bound(legacy + scale * d + shift, legacy, 0.05)
    assert base.lower <= base.mean <= base.upper
    tol = 1e-6 * (abs(shift) + scale * (abs(base.lower) + abs(base.upper)) + 1.0)
    assert moved.lower == pytest.approx(scale * base.lower + shift, abs=tol)
    assert moved.upper == pytest.approx(scale * base.upper + shift, abs=tol)
    assert paired_bound(legacy + d, legacy, 0.05) == base


def test_paired_bound_edge_cases():
    legacy = np.array([400.0, 380.0, 420.0, 410.0])
    # An identical candidate is not better than its reference: every difference 0 is "undecided" at threshold 0.
    assert paired_bound(legacy, legacy, 0.05).versus(0.0) == "undecided"
    one = paired_bound(legacy[:1] + 5.0, legacy[:1], 0.05)  # one pair says nothing about the spread
    assert (one.lower, one.upper) == (-math.inf, math.inf) and one.versus(0.0) == "undecided"
    with pytest.raises(ValueError, match="not the same seeds"):
        paired_bound(legacy[:3], legacy, 0.05)


# ----------------------------------------------------------------------------- the sequential gate, simulated


def _metrics(legacy: np.ndarray, cand: np.ndarray, look: int, looks: int) -> dict:
    """What the shadow run hands the gate at one look; every safety check passes, so returns decide."""
    return {
        "legacy_returns": legacy.tolist(),
        "candidate_returns": cand.tolist(),
        "looks": look,
        "planned_looks": looks,
        "candidate_violations": 0,
        "candidate_violation_episodes": 0,
        "candidate_interventions": 0,
        "candidate_steps": 500 * len(cand),
        "latency_p99_us": 100.0,
        "counterfactual_latency_p99_us": 100.0,
        "control_period_s": 0.02,
        "failures_vs_legacy": {"candidate_only": 0, "legacy_only": 0, "episodes": len(cand)},
        "episodes_can_end_early": False,  # returns alone decide here; lost episodes have tests of their own
    }


def simulate_gate(gate: GateConfig, batch: int, difference, spread: float, runs: int, seed: int):
    """Run the sequential gate `runs` times on synthetic paired returns: legacy's vary a lot from domain to domain
    (common to both policies), the paired difference is `difference(rng, n)`. Returns (decisions, episodes used)."""
    rng = np.random.default_rng(seed)
    sizes = look_sizes(gate.max_episodes, batch)
    decisions, used = [], []
    for _ in range(runs):
        legacy, cand = np.empty(0), np.empty(0)
        for look, upto in enumerate(sizes, 1):
            n = upto - legacy.size
            domain = rng.normal(LEGACY_MEAN, 80.0, n)  # the plant, start and pushes: cancel out of the pair
            legacy = np.concatenate([legacy, domain])
            cand = np.concatenate([cand, domain + spread * difference(rng, n)])
            decision = decide(_metrics(legacy, cand, look, len(sizes)), gate)
            if decision.settled:
                break
        decisions.append(decision.decision)
        used.append(legacy.size)
    return decisions, used


def _normal(rng, n):
    return rng.normal(0.0, 1.0, n)


def _skewed(rng, n):
    # Mean 0, a long tail of bad episodes on one side (a dropped pole now and then).
    return 1.0 - rng.exponential(1.0, n)


def _binary(rng, n):
    # Mean 0: now better, now worse by the same amount.
    return rng.choice([-1.0, 1.0], n)


def _uniform(rng, n):
    return rng.uniform(-1.0, 1.0, n)


@settings(max_examples=3, deadline=None)
@given(
    batch=st.sampled_from([5, 10]),
    budget=st.sampled_from([30, 40]),
    noise=st.sampled_from([_normal, _skewed, _binary, _uniform]),
    spread=st.sampled_from([1.0, 25.0]),
)
@example(batch=10, budget=40, noise=_skewed, spread=25.0)  # the shipped batch and budget, on skewed returns
def test_an_equal_candidate_is_never_promoted_more_often_than_the_confidence_allows(batch, budget, noise, spread):
    gate = GateConfig(max_episodes=budget)  # defaults: no worse than legacy at 95 %
    runs = 400
    decisions, _ = simulate_gate(gate, batch, noise, spread, runs, seed=batch * 1000 + budget)
    promoted = decisions.count("pass") / runs
    # The limit is 1 - confidence; the slack covers the simulation's own noise (3 standard errors).
    assert promoted <= (1 - gate.confidence) + 3 * math.sqrt(0.05 * 0.95 / runs), (promoted, decisions.count("fail"))
    assert set(decisions) <= {"pass", "fail", "inconclusive"}


def test_a_better_candidate_passes_before_the_budget_and_a_worse_one_is_refused_with_its_interval():
    gate = GateConfig(max_episodes=40)
    better, used = simulate_gate(gate, 10, lambda rng, n: 1.0 + rng.normal(0, 1.0, n), 10.0, 100, seed=5)
    assert better.count("pass") / 100 >= 0.9
    assert np.mean(used) < gate.max_episodes * 0.75 and min(used) >= gate.min_episodes

    rng = np.random.default_rng(9)
    domain = rng.normal(LEGACY_MEAN, 80.0, 10)
    worse = domain - 20.0 + rng.normal(0, 5.0, 10)  # 20 return units worse per episode, known
    decision = decide(_metrics(domain, worse, 1, planned_looks(40, 10)), gate)  # refused at the first look
    assert decision.decision == "fail" and decision.failing == ["gate.min_return_ratio"]
    check = decision.checks[0]
    lower, upper = check.interval
    assert lower < -20.0 < upper < 0.0
    assert f"bounds [{lower:+.3f}, {upper:+.3f}]" in decision.reasons[0]


def test_the_episode_rate_bound_covers_a_bursty_rate_that_the_steps_bound_misses():
    """A shield that intervenes in bursts: each episode's share of intervened steps is drawn from a skewed
    Beta(0.5, 9.5) (true rate 0.05), over 20-40 episodes of 200-500 steps. The steps' binomial bound treats every
    step as an independent trial and covers the true rate about half the time at a stated 95 %; the wider of it
    and the episode bound, which the gate uses, covers it close to the stated level."""
    rng = np.random.default_rng(7)
    covered_steps = covered_gate = 0
    trials = 300
    for i in range(trials):
        m = 20 if i % 2 else 40
        lengths = rng.integers(200, 501, m)
        counts = rng.binomial(lengths, rng.beta(0.5, 9.5, m))
        steps_upper = clopper_pearson_upper(int(counts.sum()), int(lengths.sum()), 0.05)
        episode = episode_rate_bounds(counts, lengths, 0.05)
        assert episode is not None and 0.0 <= episode[0] <= counts.sum() / lengths.sum() <= episode[1] <= 1.0
        covered_steps += steps_upper >= 0.05
        covered_gate += max(steps_upper, episode[1]) >= 0.05
    assert covered_steps / trials < 0.75
    assert covered_gate / trials >= 0.89


def test_the_episode_rate_bound_edge_cases():
    assert episode_rate_bounds([3], [100], 0.05) is None  # one episode: no spread to see
    # No more spread than independent steps give: the steps' exact bounds, nothing discounted.
    even = episode_rate_bounds([5, 5, 5], [100, 100, 100], 0.05)
    assert even == (clopper_pearson_lower(15, 300, 0.05), clopper_pearson_upper(15, 300, 0.05))
    assert episode_rate_bounds([0, 0, 0], [100, 100, 100], 0.05)[1] == clopper_pearson_upper(0, 300, 0.05)
    low, high = episode_rate_bounds([0, 0, 50, 0], [100, 100, 100, 100], 0.05)
    assert 0.0 <= low < 0.125 < high <= 1.0 and high > clopper_pearson_upper(50, 400, 0.05)


def test_a_single_burst_in_forty_episodes_is_bounded_not_left_at_one():
    """A candidate the shield touched in one episode of forty (7 of 500 steps): the episode bound is wider than the
    steps' (the burst counts as fewer trials) yet decides against a 10 % limit. The studentized bootstrap gave
    [0, 1] here: a share of its resamples hold no intervention at all and have no spread, so no number of
    episodes could ever pass such a candidate."""
    counts, lengths = [7] + [0] * 39, [500] * 40
    low, high = episode_rate_bounds(counts, lengths, 0.0125)
    assert clopper_pearson_upper(7, 20_000, 0.0125) < high < 0.01
    assert 0.0 <= low <= 7 / 20_000


# ----------------------------------------------------------------------------- lost episodes


def test_looks_double_from_the_first_batch_to_the_budget():
    assert look_sizes(320, 10) == [10, 20, 40, 80, 160, 320]
    assert look_sizes(40, 10) == [10, 20, 40]
    assert look_sizes(300, 10) == [10, 20, 40, 80, 160, 300]  # the last look is the budget itself
    assert look_sizes(10, 10) == [10] and look_sizes(5, 10) == [5]
    assert planned_looks(320, 10) == 6


def _paired_loss_probabilities(n: int, p_cand: float, p_ref: float) -> np.ndarray:
    """P(b, c): b episodes only the candidate lost, c only the reference, of n (a trinomial), on the full grid."""
    from scipy.special import gammaln

    b, c = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    rest = n - b - c
    ok = rest >= 0
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = (
            gammaln(n + 1)
            - gammaln(b + 1)
            - gammaln(c + 1)
            - gammaln(np.where(ok, rest, 0) + 1)
            + b * np.log(p_cand)
            + c * (np.log(p_ref) if p_ref > 0 else np.where(c == 0, 0.0, -np.inf))
            + np.where(ok, rest, 0) * np.log1p(-p_cand - p_ref)
        )
    return np.where(ok, np.exp(logp), 0.0)


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(20, 400),
    tolerance=st.sampled_from([0.01, 0.02, 0.05]),
    alpha=st.sampled_from([0.05, 0.05 / 6]),
    reference_rate=st.sampled_from([0.0, 0.01, 0.03]),
)
def test_a_candidate_at_the_tolerance_passes_and_one_within_it_fails_at_most_alpha_of_the_time(
    n, tolerance, alpha, reference_rate
):
    """Exact, not simulated: episodes only the candidate loses come at the reference-only rate plus the tolerance,
    the worst difference the check must refuse. Summing the trinomial over every pair of counts the check passes
    gives its chance of passing, which must stay <= alpha whatever the reference itself loses; the same for
    failing a candidate exactly at the tolerance."""
    # Each bound is one rate's bound less the other's: the grid from its two margins (n + 1 calls each, not
    # (n + 1)^2), checked against the function on a few pairs.
    along_b = np.array([lost_rate_bounds(b, 0, n, alpha) for b in range(n + 1)])
    along_c = np.array([lost_rate_bounds(0, c, n, alpha) for c in range(n + 1)])
    bounds = along_b[:, None, :] + along_c[None, :, :] - along_b[0]
    for b, c in np.random.default_rng(n).integers(0, n + 1, size=(5, 2)):
        assert bounds[b, c] == pytest.approx(lost_rate_bounds(int(b), int(c), n, alpha))
    prob = _paired_loss_probabilities(n, reference_rate + tolerance, reference_rate)
    assert prob.sum() == pytest.approx(1.0)
    assert float(prob[bounds[..., 1] <= tolerance].sum()) <= alpha * (1 + 1e-9)
    assert float(prob[bounds[..., 0] > tolerance].sum()) <= alpha * (1 + 1e-9)


@given(rate=st.sampled_from([0.005, 0.01, 0.02, 0.05]), alpha=st.sampled_from([0.05, 0.05 / 6, 0.001]))
def test_the_episodes_a_lossless_candidate_needs_solve_the_closed_form(rate, alpha):
    n = lossless_episodes(rate, alpha)
    assert lost_rate_bounds(0, 0, n, alpha)[1] <= rate < lost_rate_bounds(0, 0, n - 1, alpha)[1]


def simulate_lost(gate: GateConfig, batch: int, lost_rate: float, bulk_gain: float, runs: int, seed: int):
    """The sequential gate on cart-pole-like episodes: the candidate gains `bulk_gain` on the episodes it keeps,
    and loses the pole (and ~370 of its return) on a share `lost_rate` of them; legacy loses none."""
    rng = np.random.default_rng(seed)
    sizes = look_sizes(gate.max_episodes, batch)
    decisions = []
    for _ in range(runs):
        legacy, cand, lost = np.empty(0), np.empty(0), np.empty(0, bool)
        for look, upto in enumerate(sizes, 1):
            n = upto - legacy.size
            domain = rng.normal(LEGACY_MEAN, 30.0, n)
            drop = rng.random(n) < lost_rate
            legacy = np.concatenate([legacy, domain])
            cand = np.concatenate([cand, domain + bulk_gain + rng.normal(0, 3.0, n) - 370.0 * drop])
            lost = np.concatenate([lost, drop])
            metrics = _metrics(legacy, cand, look, len(sizes))
            metrics.update(
                failures_vs_legacy={"candidate_only": int(lost.sum()), "legacy_only": 0, "episodes": len(cand)},
                episodes_can_end_early=True,
            )
            decision = decide(metrics, gate)
            if decision.settled:
                break
        decisions.append(decision.decision)
    return decisions


def test_a_candidate_that_drops_the_pole_now_and_then_is_not_promoted_on_the_episodes_that_did_not_show_it():
    """The cart-pole's candidates as measured on 200 fresh episodes: +9 on the episodes they keep, a pole dropped
    on 3 % of them, so the mean is about -2 against a legacy that drops none. The return bounds alone promote it
    whenever the first 20 episodes hold no drop (about half the nights); with the lost-episode bound they do not."""
    runs = 200
    shipped = GateConfig(max_episodes=320)
    returns_only = GateConfig(max_episodes=320, max_lost_rate_increase=1.0)
    blind = simulate_lost(returns_only, 10, 0.03, 9.0, runs, seed=1)
    assert blind.count("pass") / runs > 0.3  # the flaw the lost-episode bound mends
    decisions = simulate_lost(shipped, 10, 0.03, 9.0, runs, seed=1)
    assert decisions.count("pass") / runs <= 0.05
    # A candidate that keeps every episode and gains the same passes within the budget.
    keeper = simulate_lost(shipped, 10, 0.0, 9.0, 50, seed=2)
    assert keeper.count("pass") == 50
