"""Prioritized experience replay (proportional, Schaul et al. 2016) as Ray actor shards, Ape-X style.

`SumTree` keeps p_i^alpha in the leaves of a complete binary tree stored as a
flat array (node k has children 2k and 2k+1, leaves at capacity..2*capacity-1),
so the total is tree[1], a prefix-sum search is one descent and a batch of
updates is one vectorized pass per level. A second tree keeps the minimum,
which the importance weights need.

Sampling is stratified: the total mass is cut into `n` equal segments and one
uniform draw is taken in each, so P(i) = p_i^alpha / sum_j p_j^alpha for every
draw in expectation. Importance weights are

    w_i = (N * P(i))^-beta / max_j (N * P(j))^-beta = (p_min^alpha / p_i^alpha)^beta,

normalized by the largest weight over the whole buffer (not the batch), so they
depend only on each item's priority and the buffer's smallest one; that makes
them exact across K shards too (`combine_samples`).

`NStepBuilder` turns an actor's per-env step stream into n-step transitions
(obs, action, R = sum_k gamma^k r_k, next_obs, discount = gamma^n or 0 at a
terminal step), which is what the actors insert.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from pipeline.training.actor_pool import Lives, ray_restarted

# Added to |TD error| so no transition's priority is ever exactly zero.
PRIORITY_EPS = 1e-6
TRANSITION_KEYS = ("obs", "action", "reward", "next_obs", "discount")
# A shard that does not answer a stats poll within this long counts as down for now (s).
SHARD_POLL_TIMEOUT_S = 2.0


class SumTree:
    """Sum and min of `capacity` non-negative leaf values; vectorized update and prefix search."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"replay capacity must be >= 1, got {capacity}")
        self.capacity = 1 << max(0, int(capacity - 1).bit_length())  # leaves: the next power of two
        self.depth = self.capacity.bit_length() - 1
        self.sums = np.zeros(2 * self.capacity, np.float64)
        self.mins = np.full(2 * self.capacity, np.inf, np.float64)

    @property
    def total(self) -> float:
        return float(self.sums[1])

    @property
    def min(self) -> float:
        return float(self.mins[1])

    def leaves(self, idx: np.ndarray) -> np.ndarray:
        return self.sums[np.asarray(idx) + self.capacity]

    def update(self, idx: np.ndarray, values: np.ndarray) -> None:
        """Set leaves `idx` to `values` (the last one wins for a repeated index), then repair the parents."""
        nodes = np.asarray(idx, np.int64) + self.capacity
        self.sums[nodes] = values
        self.mins[nodes] = values
        for _ in range(self.depth):
            nodes = np.unique(nodes >> 1)
            self.sums[nodes] = self.sums[2 * nodes] + self.sums[2 * nodes + 1]
            self.mins[nodes] = np.minimum(self.mins[2 * nodes], self.mins[2 * nodes + 1])

    def find(self, mass: np.ndarray) -> np.ndarray:
        """Leaf index i per value m in [0, total): the first i with cumulative sum up to i > m.

        Never a leaf of zero priority while the total is positive: a branch whose sum is zero is
        never taken, even where rounding leaves m at or past the total (tiny or subnormal sums).
        """
        mass = np.array(mass, np.float64)
        nodes = np.ones(mass.shape, np.int64)
        for _ in range(self.depth):
            left = 2 * nodes
            left_sum = self.sums[left]
            go_right = (mass >= left_sum) & (self.sums[left + 1] > 0.0)
            mass = np.where(go_right, mass - left_sum, mass)
            nodes = np.where(go_right, left + 1, left)
        return nodes - self.capacity


class PrioritizedReplay:
    """A ring buffer of n-step transitions with proportional prioritization; one shard's contents."""

    def __init__(self, capacity: int, obs_dim: int, act_dim: int, alpha: float = 0.6, seed: int = 0):
        self.capacity, self.alpha = int(capacity), float(alpha)
        self.tree = SumTree(self.capacity)
        self.data = {
            "obs": np.zeros((self.capacity, obs_dim), np.float32),
            "action": np.zeros((self.capacity, act_dim), np.float32),
            "reward": np.zeros(self.capacity, np.float32),
            "next_obs": np.zeros((self.capacity, obs_dim), np.float32),
            "discount": np.zeros(self.capacity, np.float32),
        }
        # Bumped when a slot is overwritten: a priority update for its previous content is dropped.
        self.generation = np.zeros(self.capacity, np.int64)
        self.size, self.next_slot, self.max_priority = 0, 0, 1.0
        self.inserted, self.sampled = 0, 0
        self.rng = np.random.default_rng(seed)

    def add(self, batch: dict, priorities: np.ndarray | None = None) -> int:
        """Insert transitions (arrays with a leading batch axis); new ones get the largest priority seen."""
        n = len(batch["reward"])
        if n == 0:
            return 0
        if n > self.capacity:  # only the newest `capacity` would survive anyway
            batch = {k: batch[k][-self.capacity :] for k in TRANSITION_KEYS}
            priorities = None if priorities is None else priorities[-self.capacity :]
            n = self.capacity
        slots = (self.next_slot + np.arange(n)) % self.capacity
        for key in TRANSITION_KEYS:
            self.data[key][slots] = batch[key]
        self.generation[slots] += 1
        p = np.full(n, self.max_priority) if priorities is None else np.asarray(priorities, np.float64) + PRIORITY_EPS
        self.max_priority = max(self.max_priority, float(p.max()))
        self.tree.update(slots, p**self.alpha)
        self.next_slot = int((self.next_slot + n) % self.capacity)
        self.size = min(self.size + n, self.capacity)
        self.inserted += n
        return n

    def sample(self, n: int) -> dict:
        """`n` transitions drawn with P(i) = p_i^alpha / sum p^alpha (stratified), with the values
        the learner needs for exact importance weights: `prob_mass` (p_i^alpha of each draw),
        `min_mass` (smallest p^alpha in the buffer), `total_mass`, `size`, `index`, `generation`."""
        if self.size == 0 or n <= 0:
            return empty_sample(self.data, self.tree.min, 0.0, self.size)
        total = self.tree.total
        bounds = np.linspace(0.0, total, n + 1)
        mass = self.rng.uniform(bounds[:-1], bounds[1:])
        idx = np.minimum(self.tree.find(np.minimum(mass, np.nextafter(total, 0))), self.size - 1)
        self.sampled += n
        out = {k: v[idx] for k, v in self.data.items()}
        out.update(
            index=idx,
            generation=self.generation[idx].copy(),
            prob_mass=self.tree.leaves(idx),
            min_mass=self.tree.min,
            total_mass=total,
            size=self.size,
        )
        return out

    def update_priorities(self, index: np.ndarray, generation: np.ndarray, priorities: np.ndarray) -> int:
        """New priorities (|TD error|) for sampled slots still holding what was sampled; returns how many."""
        index, priorities = np.asarray(index, np.int64), np.asarray(priorities, np.float64) + PRIORITY_EPS
        current = self.generation[index] == np.asarray(generation)
        if current.any():
            self.tree.update(index[current], priorities[current] ** self.alpha)
            self.max_priority = max(self.max_priority, float(priorities[current].max()))
        return int(current.sum())

    def state(self) -> dict[str, np.ndarray]:
        """Everything in the shard as flat numpy arrays (np.savez-able, loads without pickle)."""
        used = np.arange(self.capacity)
        return {
            **{f"data_{k}": v for k, v in self.data.items()},
            "priority_mass": self.tree.leaves(used),
            "generation": self.generation,
            "scalars": np.array(
                [self.size, self.next_slot, self.max_priority, self.inserted, self.sampled], np.float64
            ),
        }

    def load_state(self, state: dict) -> None:
        if state["data_obs"].shape != self.data["obs"].shape or state["data_action"].shape != self.data["action"].shape:
            raise ValueError(
                f"replay snapshot holds {state['data_obs'].shape} observations / {state['data_action'].shape} "
                f"actions; this shard has {self.data['obs'].shape} / {self.data['action'].shape}"
            )
        for key in TRANSITION_KEYS:
            self.data[key][:] = state[f"data_{key}"]
        self.generation[:] = state["generation"]
        used = np.arange(self.capacity)
        mass = np.asarray(state["priority_mass"], np.float64)
        self.tree.update(used[mass > 0], mass[mass > 0])
        size, next_slot, max_priority, inserted, sampled = state["scalars"].tolist()
        self.size, self.next_slot, self.max_priority = int(size), int(next_slot), float(max_priority)
        self.inserted, self.sampled = int(inserted), int(sampled)


def empty_sample(data: dict, min_mass: float, total: float, size: int) -> dict:
    out = {k: v[:0] for k, v in data.items()}
    out.update(
        index=np.zeros(0, np.int64),
        generation=np.zeros(0, np.int64),
        prob_mass=np.zeros(0),
        min_mass=min_mass,
        total_mass=total,
        size=size,
    )
    return out


def importance_weights(prob_mass: np.ndarray, min_mass: float, beta: float) -> np.ndarray:
    """w_i = (N P(i))^-beta / max_j (N P(j))^-beta = (min_mass / prob_mass_i)^beta, in (0, 1]."""
    return (min_mass / np.asarray(prob_mass, np.float64)) ** beta


def allocate(n: int, total_masses: list[float], rng: np.random.Generator) -> np.ndarray:
    """How many of `n` draws each shard serves: multinomial in its share of the total mass, so a
    draw from K shards has the same distribution as a draw from one buffer holding them all."""
    mass = np.asarray(total_masses, np.float64)
    if mass.sum() <= 0:
        return np.full(len(mass), n // max(1, len(mass)))
    return rng.multinomial(n, mass / mass.sum())


def combine_samples(samples: list[dict], beta: float) -> dict:
    """Concatenate shard samples and attach `weight` (importance weights over all shards) and `shard`."""
    live = [s for s in samples if s is not None and len(s["reward"])]
    if not live:
        return {}
    min_mass = min(s["min_mass"] for s in live)
    out = {k: np.concatenate([s[k] for s in live]) for k in (*TRANSITION_KEYS, "index", "generation", "prob_mass")}
    out["shard"] = np.concatenate([np.full(len(s["reward"]), s["shard"]) for s in live])
    out["weight"] = importance_weights(out["prob_mass"], min_mass, beta).astype(np.float32)
    return out


class ReplayShard:
    """A Ray actor holding one `PrioritizedReplay`; actors `add`, the learner `sample`s and
    `update_priorities` (fire-and-forget). `life` changes when Ray restarts it (contents lost)."""

    def __init__(self, index: int, capacity: int, obs_dim: int, act_dim: int, alpha: float, seed: int):
        self.index = index
        self.replay = PrioritizedReplay(
            capacity,
            obs_dim,
            act_dim,
            alpha,
            seed=int(np.random.SeedSequence([seed, index, uuid.uuid4().int % 2**32]).generate_state(1)[0]),
        )
        self.life = uuid.uuid4().hex
        self.reconstructed = ray_restarted()  # counted even when the driver never saw the life before it
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""

    def add(self, batch: dict) -> int:
        return self.replay.add(batch)

    def sample(self, n: int) -> dict:
        out = self.replay.sample(n)
        out.update(shard=self.index, life=self.life, reconstructed=self.reconstructed)
        return out

    def update_priorities(self, index, generation, priorities) -> int:
        return self.replay.update_priorities(index, generation, priorities)

    def stats(self) -> dict:
        r = self.replay
        return dict(
            shard=self.index,
            life=self.life,
            reconstructed=self.reconstructed,
            node_id=self.node_id,
            size=r.size,
            inserted=r.inserted,
            sampled=r.sampled,
            total_mass=r.tree.total,
            min_mass=r.tree.min if r.size else 0.0,
            max_priority=r.max_priority,
            capacity=r.capacity,
        )

    def state(self) -> dict:
        return self.replay.state()

    def load_state(self, state: dict) -> None:
        self.replay.load_state(state)


class ReplayClient:
    """The learner's side of the shards: prefetched prioritized samples, batched async priority updates,
    stats polls, and the restarts and transitions lost when a shard's node dies.

    One request per shard fetches `prefetch` minibatches at once and the next request is issued as soon
    as a group arrives, so sampling overlaps learning; new priorities are sent per group (one call per
    shard), which makes them at most about two groups stale, as in Ape-X's asynchronous learner."""

    def __init__(self, shards: list, batch_size: int, prefetch: int, seed: int):
        self.shards, self.batch_size, self.prefetch = shards, batch_size, prefetch
        self.rng = np.random.default_rng(seed)
        self.mass = [0.0] * len(shards)  # each shard's total p^alpha, as last seen
        self.lives = Lives(len(shards))
        self.sizes = [0] * len(shards)
        self.transitions_lost = 0
        self._in_flight: list | None = None
        self._ready: list[dict] = []
        self._priorities: list[tuple[dict, np.ndarray]] = []

    @property
    def restarts(self) -> int:
        return self.lives.restarts

    def _note(self, k: int, report: dict) -> None:
        if self.lives.note(k, report["life"], bool(report.get("reconstructed", False))):
            self.transitions_lost += self.sizes[k]  # what it held when last seen (0 if never seen)
        self.sizes[k], self.mass[k] = int(report["size"]), float(report["total_mass"])

    def _request(self) -> None:
        self._flush_priorities()  # same caller, same actor: Ray runs them before the sample
        mass = self.mass if sum(self.mass) > 0 else [1.0] * len(self.shards)
        counts = allocate(self.batch_size * self.prefetch, mass, self.rng)
        self._in_flight = [self.shards[k].sample.remote(int(n)) if n else None for k, n in enumerate(counts)]

    def sample(self, beta: float) -> dict:
        """A prioritized batch from all shards (short while a shard is down; {} if all are down or empty)."""
        if self._ready:
            return self._ready.pop()
        if self._in_flight is None:
            self._request()
        samples = []
        for k, ref in enumerate(self._in_flight):
            if ref is None:
                continue
            try:
                s = ray.get(ref)
            except (RayActorError, ActorUnavailableError):
                self.mass[k] = 0.0  # down: asked again after the next stats poll
                continue
            self._note(k, s)
            samples.append(s)
        self._request()
        group = combine_samples(samples, beta)
        if not group:
            return {}
        order = self.rng.permutation(len(group["reward"]))
        self._ready = [
            {k: v[rows] for k, v in group.items()} for rows in np.array_split(order, self.prefetch) if len(rows)
        ]
        return self._ready.pop()

    def update_priorities(self, batch: dict, priorities: np.ndarray) -> None:
        self._priorities.append((batch, priorities))

    def _flush_priorities(self) -> None:
        if not self._priorities:
            return
        shard = np.concatenate([b["shard"] for b, _ in self._priorities])
        index = np.concatenate([b["index"] for b, _ in self._priorities])
        generation = np.concatenate([b["generation"] for b, _ in self._priorities])
        priorities = np.concatenate([p for _, p in self._priorities])
        self._priorities.clear()
        for k in np.unique(shard):
            rows = shard == k
            self.shards[int(k)].update_priorities.remote(index[rows], generation[rows], priorities[rows])

    def poll(self) -> list[dict]:
        """Stats of every shard that answers; also revives the sampling mass of restarted shards."""
        refs = [s.stats.remote() for s in self.shards]
        out = []
        for k, ref in enumerate(refs):
            try:
                st = ray.get(ref, timeout=SHARD_POLL_TIMEOUT_S)
            except (RayActorError, ActorUnavailableError, GetTimeoutError):
                self.mass[k] = 0.0
                continue
            self._note(k, st)
            out.append(st)
        return out


def save_snapshot(folder: Path, shards: list) -> None:
    """Snapshot every shard to folder/shard_<k>.npz (temp file + rename, as checkpoints).
    A shard that is down keeps its previous snapshot (older, but consistent in itself)."""
    folder.mkdir(parents=True, exist_ok=True)
    for k, ref in enumerate([s.state.remote() for s in shards]):
        try:
            state = ray.get(ref)
        except (RayActorError, ActorUnavailableError):
            continue
        tmp = folder / f"shard_{k}.tmp.npz"
        np.savez(tmp, **state)
        os.replace(tmp, folder / f"shard_{k}.npz")


def load_snapshot(folder: Path, shards: list) -> int:
    """Refill the shards from a run's snapshot; returns the transitions restored (0 when there is none)."""
    files = [folder / f"shard_{k}.npz" for k in range(len(shards))]
    if not all(f.exists() for f in files):
        return 0
    states = []
    for f in files:
        with np.load(f, allow_pickle=False) as data:
            states.append({k: data[k] for k in data.files})
    ray.get([s.load_state.remote(st) for s, st in zip(shards, states)])
    return int(sum(st["scalars"][0] for st in states))


class NStepBuilder:
    """Per-env n-step accumulation. `step()` takes one vector step and returns finished transitions.

    A transition from time t is emitted once n more steps are known, or earlier when its episode
    ends: at a terminal step with discount 0, at a time limit with discount gamma^k and the final
    observation as next_obs (a time limit is not a failure).
    """

    def __init__(self, num_envs: int, n: int, gamma: float, obs_dim: int, act_dim: int):
        self.n, self.gamma = int(n), float(gamma)
        self.shapes = {"obs": (obs_dim,), "action": (act_dim,), "reward": (), "next_obs": (obs_dim,), "discount": ()}
        self.pending: list[list[tuple[np.ndarray, np.ndarray, float]]] = [[] for _ in range(num_envs)]

    def step(self, obs, action, reward, next_obs, terminated, truncated, active=None) -> dict:
        """Arrays over envs for one step; envs with `active[i]` False (e.g. a broken env) are skipped."""
        out: dict[str, list] = {k: [] for k in TRANSITION_KEYS}
        for i, queue in enumerate(self.pending):
            if active is not None and not active[i]:
                continue
            queue.append((obs[i], action[i], float(reward[i])))
            if terminated[i] or truncated[i]:
                while queue:  # flush: every pending start gets its shortened return
                    self._emit(out, queue, next_obs[i], 0.0 if terminated[i] else 1.0)
                    queue.pop(0)
            elif len(queue) == self.n:
                self._emit(out, queue, next_obs[i], 1.0)
                queue.pop(0)
        return {k: np.asarray(v, np.float32).reshape(-1, *self.shapes[k]) for k, v in out.items()}

    def _emit(self, out, queue, next_obs, alive: float) -> None:
        ret = sum(self.gamma**k * r for k, (_, _, r) in enumerate(queue))
        out["obs"].append(queue[0][0])
        out["action"].append(queue[0][1])
        out["reward"].append(ret)
        out["next_obs"].append(next_obs)
        out["discount"].append(alive * self.gamma ** len(queue))
