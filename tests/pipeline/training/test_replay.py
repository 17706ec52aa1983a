"""Prioritized replay: sampling frequencies, importance weights, sum-tree invariants, n-step returns.

Tolerance of the frequency test: each item's empirical frequency over n draws is
within 5 binomial standard deviations sqrt(P(1-P)/n) of P(i) = p_i^alpha / sum p^alpha
(stratified sampling only lowers the variance), and the total variation distance
is below 0.01.
"""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipeline.training.replay import (
    NStepBuilder,
    PrioritizedReplay,
    SumTree,
    allocate,
    combine_samples,
    importance_weights,
)

OBS_DIM, ACT_DIM = 3, 2
DRAWS = 200_000


def transitions(n: int, start: int = 0) -> dict:
    ids = np.arange(start, start + n, dtype=np.float32)
    return dict(
        obs=np.repeat(ids[:, None], OBS_DIM, 1),
        action=np.zeros((n, ACT_DIM), np.float32),
        reward=ids,
        next_obs=np.zeros((n, OBS_DIM), np.float32),
        discount=np.ones(n, np.float32),
    )


def filled(priorities: np.ndarray, alpha: float, capacity: int | None = None, seed: int = 0) -> PrioritizedReplay:
    replay = PrioritizedReplay(capacity or len(priorities), OBS_DIM, ACT_DIM, alpha=alpha, seed=seed)
    replay.add(transitions(len(priorities)))
    sample = replay.sample(len(priorities))  # any sample: then set every priority explicitly
    replay.update_priorities(np.arange(len(priorities)), replay.generation[: len(priorities)].copy(), priorities)
    assert len(sample["reward"]) == len(priorities)
    return replay


def expected_probabilities(priorities, alpha):
    mass = (np.asarray(priorities) + 1e-6) ** alpha
    return mass / mass.sum()


def assert_frequencies_match(counts: np.ndarray, expected: np.ndarray) -> None:
    n = counts.sum()
    assert n >= 100_000
    freq = counts / n
    sigma = np.sqrt(expected * (1 - expected) / n)
    worst = np.max(np.abs(freq - expected) / sigma)
    assert worst < 5.0, worst
    assert 0.5 * np.abs(freq - expected).sum() < 0.01


@pytest.mark.parametrize("alpha", [0.6, 1.0])
def test_sampling_frequencies_match_priorities(alpha):
    rng = np.random.default_rng(1)
    priorities = rng.exponential(1.0, size=60)
    priorities[:3] = [1e-3, 5.0, 0.0]  # a tiny, a dominant and a zero |TD| (eps keeps it sampleable)
    # capacity 100 > 60 items: the unused leaves must never be drawn.
    replay = filled(priorities, alpha, capacity=100)
    counts = np.zeros(60)
    for _ in range(DRAWS // 500):
        np.add.at(counts, replay.sample(500)["index"], 1)
    assert_frequencies_match(counts, expected_probabilities(priorities, alpha))


def test_sharded_sampling_matches_one_buffer():
    """K shards, draws allocated by shard mass: the same distribution as one buffer with all items."""
    rng = np.random.default_rng(2)
    priorities = rng.exponential(1.0, size=45)
    alpha, shards = 0.7, [filled(priorities[k::3], 0.7, seed=k) for k in range(3)]
    ids = [np.arange(45)[k::3] for k in range(3)]
    counts = np.zeros(45)
    for _ in range(DRAWS // 500):
        n_per = allocate(500, [s.tree.total for s in shards], rng)
        samples = [dict(s.sample(int(n)), shard=k) for k, (s, n) in enumerate(zip(shards, n_per))]
        batch = combine_samples(samples, beta=0.4)
        np.add.at(counts, np.concatenate([ids[k][samples[k]["index"]] for k in range(3)]), 1)
        assert len(batch["reward"]) == 500
    assert_frequencies_match(counts, expected_probabilities(priorities, alpha))


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_importance_weights_match_definition(beta):
    """w_i = (N P(i))^-beta / max_j (N P(j))^-beta, the max over the whole buffer (here over 3 shards)."""
    rng = np.random.default_rng(3)
    priorities = rng.exponential(1.0, size=30)
    alpha = 0.6
    shards = [filled(priorities[k::3], alpha, seed=k) for k in range(3)]
    ids = [np.arange(30)[k::3] for k in range(3)]
    samples = [dict(s.sample(20), shard=k) for k, s in enumerate(shards)]
    batch = combine_samples(samples, beta)
    drawn = np.concatenate([ids[k][samples[k]["index"]] for k in range(3)])

    P = expected_probabilities(priorities, alpha)
    N = len(priorities)
    definition = (N * P[drawn]) ** -beta / np.max((N * P) ** -beta)
    np.testing.assert_allclose(batch["weight"], definition, rtol=1e-5)
    assert np.all(batch["weight"] <= 1.0 + 1e-6)
    local = np.concatenate([s["index"] for s in samples])
    np.testing.assert_array_equal(batch["reward"], local.astype(np.float32))  # the data travels with the index
    assert importance_weights(np.array([2.0]), 2.0, beta)[0] == 1.0


def test_stale_priority_update_is_dropped_after_overwrite():
    replay = PrioritizedReplay(4, OBS_DIM, ACT_DIM, alpha=1.0)
    replay.add(transitions(4))
    sample = replay.sample(4)
    replay.add(transitions(2, start=10))  # overwrites slots 0 and 1
    applied = replay.update_priorities(sample["index"], sample["generation"], np.full(4, 7.0))
    stale = np.isin(sample["index"], [0, 1])
    assert applied == int((~stale).sum())
    assert np.allclose(replay.tree.leaves(np.array([0, 1])), 1.0)  # new items keep max priority (1.0)


def test_state_round_trip_keeps_contents_and_priorities():
    replay = filled(np.arange(1.0, 9.0), alpha=0.5, capacity=8)
    copy = PrioritizedReplay(8, OBS_DIM, ACT_DIM, alpha=0.5)
    copy.load_state(replay.state())
    assert copy.size == replay.size and copy.next_slot == replay.next_slot and copy.inserted == replay.inserted
    assert copy.tree.total == pytest.approx(replay.tree.total) and copy.tree.min == pytest.approx(replay.tree.min)
    np.testing.assert_array_equal(copy.data["obs"], replay.data["obs"])
    with pytest.raises(ValueError, match="replay snapshot"):
        PrioritizedReplay(8, OBS_DIM + 1, ACT_DIM).load_state(replay.state())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.floats(0.0, 100.0)), min_size=1, max_size=80), st.floats(0.0, 1.0))
@example([(0, 5e-324)], 1.0)  # a subnormal total: rounding put the mass at the total, past every real leaf
def test_sum_tree_matches_brute_force(updates, fraction):
    tree, leaves = SumTree(41), np.zeros(41)
    idx = np.array([i for i, _ in updates])
    values = np.array([v for _, v in updates])
    for i, v in updates:  # later writes win, as in the vectorized update
        leaves[i] = v
    tree.update(idx, values)
    assert tree.total == pytest.approx(leaves.sum())
    assert tree.min == leaves[sorted(set(idx.tolist()))].min()  # leaves never set do not count
    if leaves.sum() > 0:
        mass = fraction * leaves.sum() * (1 - 1e-12)
        expected = int(np.searchsorted(np.cumsum(leaves), mass, side="right"))
        got = int(tree.find(np.array([mass]))[0])
        assert leaves[got] > 0
        assert got == expected or np.cumsum(leaves)[got - 1] == pytest.approx(mass)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.lists(st.sampled_from(["go", "term", "trunc"]), min_size=1, max_size=30))
def test_n_step_transitions_match_definition(n, events):
    gamma = 0.9
    builder = NStepBuilder(1, n, gamma, obs_dim=1, act_dim=1)
    got = []
    rewards = np.arange(1.0, len(events) + 1)
    for t, event in enumerate(events):
        out = builder.step(
            np.array([[t]]),
            np.array([[t]]),
            rewards[t : t + 1],
            np.array([[t + 1]]),
            [event == "term"],
            [event == "trunc"],
        )
        got += list(zip(out["obs"][:, 0], out["reward"], out["next_obs"][:, 0], out["discount"]))
    # Brute force: for each start t, run until n steps pass or the episode ends.
    expected = []
    for t in range(len(events)):
        ret, k, end_kind = 0.0, 0, "go"
        while k < n and t + k < len(events):
            ret += gamma**k * rewards[t + k]
            end_kind = events[t + k]
            k += 1
            if end_kind != "go":
                break
        if end_kind == "go" and k < n:
            continue  # not finished yet: still pending in the builder
        expected.append((t, ret, t + k, 0.0 if end_kind == "term" else gamma**k))
    assert len(got) == len(expected)
    for g, e in zip(sorted(got), sorted(expected)):
        np.testing.assert_allclose(g, e, rtol=1e-5)
