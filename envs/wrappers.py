"""Sim-to-real gap wrappers (latency, noise, pushes) and `randomize`, which stacks them as a set says.

Stacking order, outermost first (what the policy's action meets first):

    DomainRandomization -> ObservationNoise -> ActionLatency -> ActionNoise -> Pushes -> env

Each wrapper owns a numpy Generator, re-seeded from the reset seed (with its
own stream tag) whenever reset gets a seed, so a seed fixes the whole episode.
"""

from __future__ import annotations

from collections import deque

import gymnasium as gym
import numpy as np

from envs.domain import DomainRandomizer, element_id
from envs.randomization import AXIS_INDEX, SCALE_GROUPS, RandomizationSet, parse_randomization, sample_domain


def _reseed(rng: np.random.Generator | None, seed: int | None, stream: int) -> np.random.Generator:
    if seed is not None:
        return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(stream,)))
    return rng if rng is not None else np.random.default_rng()


def _std_vector(std: list[float], dim: int, what: str) -> np.ndarray:
    if len(std) == 1:
        return np.full(dim, std[0])
    if len(std) != dim:
        raise ValueError(f"{what} has {len(std)} values but the space has {dim} elements")
    return np.asarray(std, dtype=np.float64)


class _GaussianStream:
    """Gaussian noise (std per element) drawn from a Generator in blocks: numpy's per-call cost, not the
    arithmetic, dominates small draws. The values are the same for a seed whatever the block size."""

    BLOCK = 512

    def __init__(self, std: np.ndarray):
        self.std = std
        self._block = np.empty((0, std.shape[0]))
        self._next = 0

    def restart(self, rng: np.random.Generator) -> None:
        """Forget buffered noise; the next draw starts from `rng`."""
        self._rng, self._next = rng, 0
        self._block = np.empty((0, self.std.shape[0]))

    def draw(self) -> np.ndarray:
        """One noise vector."""
        if self._next >= len(self._block):
            self._block = self._rng.standard_normal((self.BLOCK, self.std.shape[0])) * self.std
            self._next = 0
        self._next += 1
        return self._block[self._next - 1]


class ActionLatency(gym.Wrapper):
    """Delays actions by exactly `delay_steps` control steps (FIFO).

    Until `delay_steps` actions have been commanded after a reset, the env
    receives the zero action (clipped into the action bounds): the plant's
    actuators are idle when an episode starts.
    """

    def __init__(self, env: gym.Env, delay_steps: int = 0):
        super().__init__(env)
        self.delay_steps = int(delay_steps)
        space = env.action_space
        self._idle = np.clip(np.zeros(space.shape), space.low, space.high).astype(space.dtype)
        self._queue: deque = deque()

    def reset(self, **kwargs):
        self._queue = deque([self._idle.copy() for _ in range(self.delay_steps)])
        return self.env.reset(**kwargs)

    def step(self, action):
        if not self.delay_steps:
            return self.env.step(action)
        self._queue.append(np.array(action, dtype=self._idle.dtype, copy=True))
        return self.env.step(self._queue.popleft())


class ActionNoise(gym.Wrapper):
    """Adds Gaussian noise (std per unit of the action's half-range) and clips to the action bounds."""

    def __init__(self, env: gym.Env, std):
        super().__init__(env)
        space = env.action_space
        half = 0.5 * (space.high - space.low)
        self._noise = _GaussianStream(_std_vector(list(np.atleast_1d(std)), space.shape[0], "action_noise_std") * half)
        self._low, self._high = space.low.astype(np.float64), space.high.astype(np.float64)
        self._dtype = space.dtype
        self._rng: np.random.Generator | None = None

    def reset(self, *, seed=None, options=None):
        rng = _reseed(self._rng, seed, stream=2)
        if rng is not self._rng:
            self._rng = rng
            self._noise.restart(rng)
        return self.env.reset(seed=seed, options=options)

    def step(self, action):
        noisy = np.add(action, self._noise.draw())
        np.maximum(noisy, self._low, out=noisy)
        np.minimum(noisy, self._high, out=noisy)
        return self.env.step(noisy.astype(self._dtype))


class ObservationNoise(gym.Wrapper):
    """Adds Gaussian noise to observations (the env's true state, and so info["cost"], are untouched)."""

    def __init__(self, env: gym.Env, std):
        super().__init__(env)
        space = env.observation_space
        self._noise = _GaussianStream(_std_vector(list(np.atleast_1d(std)), space.shape[0], "obs_noise_std"))
        self._rng: np.random.Generator | None = None

    def _noisy(self, obs):
        obs = np.array(obs, copy=True)  # never write into an array the env may keep
        np.add(obs, self._noise.draw(), out=obs, casting="unsafe")
        return obs

    def reset(self, *, seed=None, options=None):
        rng = _reseed(self._rng, seed, stream=3)
        if rng is not self._rng:
            self._rng = rng
            self._noise.restart(rng)
        obs, info = self.env.reset(seed=seed, options=options)
        return self._noisy(obs), info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return self._noisy(obs), reward, terminated, truncated, info


class Pushes(gym.Wrapper):
    """Random pushes: a world-frame force (N) on one body, started with a probability each control step."""

    def __init__(
        self,
        env: gym.Env,
        body: str,
        max_force: float,
        probability: float,
        duration_steps: int = 1,
        axes=("x", "y", "z"),
    ):
        super().__init__(env)
        self._data = env.unwrapped.data
        label = env.spec.id if env.spec is not None else type(env.unwrapped).__name__
        self._body = element_id(env.unwrapped.model, "body_mass", body, label, key="push.body")
        self._mask = np.zeros(3)
        self._mask[[AXIS_INDEX[a] for a in axes]] = 1.0
        self.max_force, self.probability, self.duration_steps = max_force, probability, duration_steps
        self._left = 0
        self._rng: np.random.Generator | None = None

    def reset(self, *, seed=None, options=None):
        self._rng = _reseed(self._rng, seed, stream=4)
        self._left = 0
        out = self.env.reset(seed=seed, options=options)
        self._data.xfrc_applied[self._body, :3] = 0.0
        return out

    def step(self, action):
        if self._left == 0 and self._rng.random() < self.probability:
            force = self._rng.uniform(-self.max_force, self.max_force, 3) * self._mask
            self._data.xfrc_applied[self._body, :3] = force
            self._left = self.duration_steps
        out = self.env.step(action)
        if self._left:
            self._left -= 1
            if self._left == 0:
                self._data.xfrc_applied[self._body, :3] = 0.0
        return out


class DomainRandomization(gym.Wrapper):
    """Samples a domain at every reset, applies it to the live model, and reports it in info["domain"]."""

    def __init__(self, env: gym.Env, rset: RandomizationSet, latency: ActionLatency | None = None):
        super().__init__(env)
        self.rset = rset
        label = env.spec.id if env.spec is not None else type(env.unwrapped).__name__
        self.randomizer = DomainRandomizer(env.unwrapped.model, rset, label)
        self._latency = latency
        self._rng: np.random.Generator | None = None
        self.domain: dict[str, float] = {}

    def reset(self, *, seed=None, options=None):
        self._rng = _reseed(self._rng, seed, stream=1)
        self.domain = sample_domain(self.rset, self._rng)
        self.randomizer.apply(self.domain)
        if self._latency is not None:
            self._latency.delay_steps = int(self.domain["latency_steps"])
        obs, info = self.env.reset(seed=seed, options=options)
        info = dict(info)
        info["domain"] = dict(self.domain)
        return obs, info


def randomize(env: gym.Env, rset) -> gym.Env:
    """Wrap any gymnasium MuJoCo env with a RandomizationSet (or dict); element names are checked now."""
    if not isinstance(rset, RandomizationSet):
        rset = parse_randomization(rset)
    if not hasattr(env.unwrapped, "model") or not hasattr(env.unwrapped, "data"):
        raise TypeError(f"randomize needs a MuJoCo env (with .model and .data), got {type(env.unwrapped).__name__}")
    inner = env
    if rset.push is not None:
        p = rset.push
        inner = Pushes(inner, p.body, p.max_force, p.probability, p.duration_steps, p.axes)
    if any(rset.action_noise_std):
        inner = ActionNoise(inner, rset.action_noise_std)
    latency = None
    if rset.latency_steps is not None:
        inner = latency = ActionLatency(inner)
    if any(rset.obs_noise_std):
        inner = ObservationNoise(inner, rset.obs_noise_std)
    return DomainRandomization(inner, rset, latency)


def domain_encoding(rset) -> list[tuple[str, float, float, bool]]:
    """(name, low, high, log scale) of every parameter `sample_domain` draws from `rset`, in its order."""
    if not isinstance(rset, RandomizationSet):
        rset = parse_randomization(rset)
    ranges = []
    for group in SCALE_GROUPS:
        for element, r in getattr(rset, group).items():
            ranges.append((f"{group}.{element}", r.low, r.high, r.dist == "loguniform"))
    if rset.gravity_scale is not None:
        g = rset.gravity_scale
        ranges.append(("gravity_scale", g.low, g.high, g.dist == "loguniform"))
    if rset.latency_steps is not None:
        ranges.append(("latency_steps", float(rset.latency_steps.low), float(rset.latency_steps.high), False))
    return ranges


def encode_domain(domain: dict[str, float], ranges: list[tuple[str, float, float, bool]]) -> np.ndarray:
    """float32[P]: each sampled parameter mapped linearly (log-linearly for loguniform) from its range to [-1, 1].

    A parameter a domain lacks counts as nominal (1.0, or 0 latency steps); a range of zero width maps to 0.
    """
    out = np.zeros(len(ranges), np.float32)
    for k, (name, low, high, log) in enumerate(ranges):
        value = domain.get(name, 0.0 if name == "latency_steps" else 1.0)
        if high > low:
            if log:
                value, low, high = np.log(value), np.log(low), np.log(high)
            out[k] = 2.0 * (value - low) / (high - low) - 1.0
    return out


class PrivilegedObservation(gym.ObservationWrapper):
    """Appends the episode's sampled domain parameters (`encode_domain` over `rset`'s ranges) to the observation.

    Sim-only: a teacher policy that knows the plant. The ranges are fixed when the wrapper is built, so the
    same plant encodes the same whatever set the episodes are drawn from (train, validation).
    """

    def __init__(self, env: gym.Env, rset):
        super().__init__(env)
        self.ranges = domain_encoding(rset)
        self.encoded = np.zeros(len(self.ranges), np.float32)
        space = env.observation_space
        extra = np.full(len(self.ranges), np.inf, np.float32)
        self.observation_space = gym.spaces.Box(
            np.concatenate([space.low.astype(np.float32), -extra]),
            np.concatenate([space.high.astype(np.float32), extra]),
            dtype=np.float32,
        )

    def reset(self, *, seed=None, options=None):
        obs, info = self.env.reset(seed=seed, options=options)
        self.encoded = encode_domain(info.get("domain") or self.env.get_wrapper_attr("domain"), self.ranges)
        return self.observation(obs), info

    def observation(self, observation):
        return np.concatenate([np.asarray(observation, np.float32), self.encoded])
