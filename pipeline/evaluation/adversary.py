"""Reference policies that try to break the shield: uniform random, and an adversary aimed at a constraint.

The adversary's target is read from the same constraint objects the env's cost
and the shield's barrier use (`shield.constraints`), so it attacks exactly what
is checked. Its knobs (`AdversaryParams`) are what `sim2real falsify` searches
over: which constraint, from which step, how hard, how far past the boundary it
aims, and whether it flips direction every few steps (to fight the latency
prediction).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from shield.spec import ShieldSpec

REFERENCE_POLICIES = ("legacy", "random", "bang_bang", "adversarial")


@dataclass(frozen=True)
class AdversaryParams:
    """How the adversary attacks: the defaults drive at the nearest constraint at full action from step 0."""

    target: int = -1  # constraint index to attack; -1: whichever is nearest at each step
    start_step: int = 0  # steps of calm (the spec's resting action: zero, or the trim that holds a load) first
    strength: float = 1.0  # share of the way from calm to the full action, in (0, 1]
    overshoot: float = 0.6  # how far past the boundary a steered adversary aims (constraint units)
    flip_every: int = 0  # > 0: reverse the push every this many steps (a latency-timed back-and-forth)

    def to_dict(self) -> dict:
        return asdict(self)


class _BoxPolicy:
    """Actions drawn in the action box; run by the evaluation, each episode draws from its own seed
    (`seed_episode`), so `eval --seed S --episodes 1` replays episode S of a longer run."""

    def __init__(self, low: np.ndarray, high: np.ndarray, seed: int = 0):
        self.low, self.high = np.asarray(low, np.float32), np.asarray(high, np.float32)
        self.rng = np.random.default_rng(seed)

    def seed_episode(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)


class RandomPolicy(_BoxPolicy):
    """Uniform random actions in the action box (batch policy interface)."""

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        return self.rng.uniform(self.low, self.high, (len(obs), len(self.low))).astype(np.float32)


class BangBangPolicy(_BoxPolicy):
    """Every action at one of its bounds, each dimension flipping between them with its own half-period, drawn anew
    each episode (from the episode's seed where the evaluation gives one, `seed_episode`): set-points that swing
    faster than a plant's inner loop settles. It found the quadrotor's tilt overshoot that neither the random policy
    (its mean is zero) nor the adversary (one direction) did."""

    MAX_HALF_PERIOD = 30  # steps

    def __init__(self, low: np.ndarray, high: np.ndarray, seed: int = 0):
        super().__init__(low, high, seed)
        self.reset()

    def reset(self) -> None:
        """A new pattern: per dimension the bound it starts at and its half-period (steps)."""
        self._start_high = self.rng.random(len(self.low)) < 0.5
        self._half = self.rng.integers(1, self.MAX_HALF_PERIOD + 1, len(self.low))
        self._step = 0

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        step, self._step = self._step, self._step + 1
        high = self._start_high ^ ((step // self._half) % 2).astype(bool)
        return np.repeat(np.where(high, self.high, self.low)[None], len(obs), axis=0)


class AdversarialPolicy:
    """Drives toward a constraint at full action (or, where the task would fall, steers its legacy controller there)."""

    def __init__(
        self, spec: ShieldSpec, steer: tuple[Callable, int] | None = None, params: AdversaryParams = AdversaryParams()
    ):
        self.spec, self.params = spec, params
        model = spec.linear_model()
        cols = {o: j for j, o in enumerate(spec.state_index)}
        # Velocity change of each position per unit action over one period.
        self._dv = np.array([model.B[cols[v]] for v in spec.velocity_index]).reshape(
            len(spec.position_index), spec.act_dim
        )
        self._pos = list(spec.position_index)
        self._where = {o_i: k for k, o_i in enumerate(self._pos)}
        self._constraints = spec.constraint_objects()
        self._low, self._high = np.asarray(spec.action_low), np.asarray(spec.action_high)
        # Calm is the action that leaves the plant where it is: zero, or the trim a gravity-loaded plant holds
        # its load with (zero there would drop it, an attack the calm steps are not meant to be).
        rest = spec.fallback_action if spec.fallback_action is not None else [0.0] * spec.act_dim
        self._rest = np.asarray(rest, np.float32)
        self._steer = steer
        self._step = 0

    def reset(self) -> None:
        """Clear the steered controller's state and the step count."""
        self._step = 0
        if self._steer is not None and hasattr(self._steer[0], "reset"):
            self._steer[0].reset()

    def _nearest(self, o: list[float]) -> tuple[float, np.ndarray]:
        """(distance, unit direction over the positions toward violation) of the targeted positional constraint."""
        best_d, best_n = math.inf, np.zeros(len(self._pos))
        t = self.params.target
        for k, con in enumerate(self._constraints):
            if t >= 0 and k != t % len(self._constraints):
                continue
            d, direction = con.nearest(o)
            if not direction or not all(i in self._where for i in direction) or not math.isfinite(d):
                continue
            if d < best_d:
                n = np.zeros(len(self._pos))
                for i, v in direction.items():
                    n[self._where[i]] = v
                best_d, best_n = d, n / max(float(np.linalg.norm(n)), 1e-12)
        return best_d, best_n

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        obs = np.asarray(obs, np.float64)
        out = np.repeat(self._rest[None], len(obs), axis=0)
        p = self.params
        step, self._step = self._step, self._step + 1
        sign = -1.0 if p.flip_every > 0 and (step // p.flip_every) % 2 else 1.0
        for k, o in enumerate(obs):
            d, n = self._nearest(o.tolist())
            if self._steer is not None:
                controller, setpoint = self._steer
                steered = o.astype(np.float32).copy()
                if step >= p.start_step:  # one steered position (the set-point's): aim past the boundary
                    steered[setpoint] = o[self._pos[0]] + sign * (d + p.overshoot) * n[0]
                out[k] = controller(steered[None])[0]
            elif step >= p.start_step:
                push = sign * (n @ self._dv)  # closing acceleration per unit of each action
                full = np.where(push > 0, self._high, np.where(push < 0, self._low, self._rest))
                out[k] = self._rest + p.strength * (full - self._rest)  # strength: the share of the way to full
        return out


def reference_policy(name: str, cfg, spec: ShieldSpec, seed: int = 0, params: AdversaryParams | None = None):
    """The `--policy` choices (`REFERENCE_POLICIES`): legacy (the task's controller), random, bang_bang, adversarial
    (with `params`)."""
    import envs

    task = envs.task(cfg.task.env_id)
    if name == "legacy":
        return task.make_legacy()
    if name == "random":
        return RandomPolicy(spec.action_low, spec.action_high, seed)
    if name == "bang_bang":
        return BangBangPolicy(spec.action_low, spec.action_high, seed)
    if name == "adversarial":
        # A plant that would fall over under a plain full-action push (the cart-pole) declares a
        # set-point through which the adversary steers its legacy controller at the boundary instead.
        steer = None if task.steerable_setpoint is None else (task.make_legacy(), task.steerable_setpoint)
        return AdversarialPolicy(spec, steer, params or AdversaryParams())
    raise ValueError(f"unknown reference policy {name!r}; choose one of {', '.join(REFERENCE_POLICIES)}")
