"""The one definition of a safety constraint: its geometry, its value h, its violation test and its barrier rows.

Every consumer reads constraints through this module, so they cannot drift:
the env's ``info["cost"]`` (`envs.safety`), the shield spec's validation
(`shield.spec`), the barrier rows the CBF shield builds (`shield.barrier`) and
the adversarial policy's target (`pipeline.evaluation.adversary`). A constraint
is a mapping (the `shield.json` / task schema) turned into an object once by
`parse_constraint`:

- ``halfspace``: ``a . obs <= b`` (``a`` over the whole observation),
- ``box``: ``low[i] <= obs[index[i]] <= high[i]`` (either end may be infinite),
- ``cylinder`` / ``sphere``: keep out of the disc / ball ``|obs[index] - center| < radius``
  (2 / 3 indices).

``value(obs)`` is the signed distance to the boundary in the constrained
quantity's units, positive inside the safe set, and ``violated(obs)`` is
exactly ``value(obs) < 0`` (boundaries are safe). Stdlib + numpy only: the
edge box and `envs` import it (and nothing else of `shield`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn


class ConstraintError(ValueError):
    """A constraint mapping is malformed; the message names the key (e.g. ``constraints[2].radius``)."""


def _fail(key: str, msg: str) -> NoReturn:
    raise ConstraintError(f"{key}: {msg}")


def _number(v: Any, key: str, finite: bool = True) -> float:
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or math.isnan(float(v))
        or (finite and not math.isfinite(float(v)))
    ):
        _fail(key, f"must be a {'finite ' if finite else ''}number, got {v!r}")
    return float(v)


def _numbers(v: Any, key: str, length: int | None, finite: bool = True) -> list[float]:
    if not isinstance(v, (list, tuple)):
        _fail(key, f"must be a list of numbers, got {type(v).__name__}")
    out = [_number(x, f"{key}[{i}]", finite) for i, x in enumerate(v)]
    if length is not None and len(out) != length:
        _fail(key, f"must have {length} entries, got {len(out)}")
    return out


def indices(v: Any, key: str, obs_dim: int) -> list[int]:
    """Distinct integer observation indices in [0, obs_dim); ConstraintError names the key otherwise."""
    if not isinstance(v, (list, tuple)):
        _fail(key, f"must be a list of indices, got {type(v).__name__}")
    out = []
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < obs_dim:
            _fail(f"{key}[{i}]", f"must be an integer index in [0, {obs_dim}), got {x!r}")
        out.append(x)
    if len(set(out)) != len(out):
        _fail(key, "indices must be distinct")
    return out


@dataclass(frozen=True)
class LinearRow:
    """One affine barrier row: distance ``d(obs) = sum_i weights[i] obs[i] + offset`` (unit-norm weights)."""

    weights: dict[int, float]
    offset: float


@dataclass(frozen=True)
class KeepoutRow:
    """A keep-out zone's row: re-linearized at the current position (distance ``|obs[index] - center| - radius``)."""

    index: tuple[int, ...]
    center: tuple[float, ...]
    radius: float


class Constraint:
    """Base: a named constraint over observation indices with a class-K gain."""

    kind = ""
    keys: frozenset = frozenset()

    def __init__(self, name: str, gain: float, used: list[int]):
        self.name, self.gain, self.used = name, gain, list(used)

    def value(self, obs: Sequence[float]) -> float:
        """Signed distance to the boundary (units of the constrained quantity), >= 0 inside the safe set."""
        raise NotImplementedError

    def violated(self, obs: Sequence[float]) -> bool:
        """True exactly when ``value(obs) < 0``; a NaN observation counts as violated."""
        v = self.value(obs)
        return not v >= 0.0

    @classmethod
    def parse(cls, con: dict, key: str, obs_dim: int) -> Constraint:
        """The constraint of one spec entry (`con` at `key`), checked; ConstraintError naming the key."""
        raise NotImplementedError

    def rows(self) -> list[LinearRow | KeepoutRow]:
        """The barrier rows, each a distance that is >= 0 on the safe side (the constraint holds when all do)."""
        raise NotImplementedError

    def nearest(self, obs: Sequence[float]) -> tuple[float, dict[int, float]]:
        """(distance, unit direction toward violation as {obs index: component}) of the nearest row."""
        best, direction = math.inf, {}
        for row in self.rows():
            d, n = _row_distance(row, obs)
            if d < best:
                best, direction = d, n
        return best, direction


def _row_distance(row: LinearRow | KeepoutRow, obs: Sequence[float]) -> tuple[float, dict[int, float]]:
    if isinstance(row, LinearRow):
        d = row.offset + sum([w * obs[i] for i, w in row.weights.items()])
        return d, {i: -w for i, w in row.weights.items()}  # d falls along -weights
    diff = [obs[i] - c for i, c in zip(row.index, row.center)]
    dist = math.sqrt(sum([x * x for x in diff]))
    unit = [x / dist for x in diff] if dist > 1e-12 else [1.0] + [0.0] * (len(diff) - 1)
    return dist - row.radius, {i: -u for i, u in zip(row.index, unit)}  # toward the centre


class Halfspace(Constraint):
    """``a . obs <= b``; value ``(b - a . obs) / |a|``."""

    kind = "halfspace"
    keys = frozenset({"a", "b"})

    def __init__(self, name: str, gain: float, a: list[float], b: float):
        self.a, self.b = a, b
        self._nz = [(i, v) for i, v in enumerate(a) if v != 0.0]
        self._norm = math.sqrt(sum([v * v for v in a]))
        super().__init__(name, gain, [i for i, _ in self._nz])

    @classmethod
    def parse(cls, con: dict, key: str, obs_dim: int) -> Halfspace:
        a = _numbers(_need(con, "a", key), f"{key}.a", obs_dim)
        if not any(a):
            _fail(f"{key}.a", "must not be all zeros")
        return cls(con["name"], con.get("gain", 0.5), a, _number(_need(con, "b", key), f"{key}.b"))

    def value(self, obs):
        return (self.b - sum([v * obs[i] for i, v in self._nz])) / self._norm

    def rows(self):
        return [LinearRow({i: -v / self._norm for i, v in self._nz}, self.b / self._norm)]


class Box(Constraint):
    """``low <= obs[index] <= high`` per entry; value: the smallest distance to a finite end."""

    kind = "box"
    keys = frozenset({"index", "low", "high"})

    def __init__(self, name: str, gain: float, index: list[int], low: list[float], high: list[float]):
        self.index, self.low, self.high = index, low, high
        self._ends = list(zip(index, low, high))
        super().__init__(name, gain, index)

    @classmethod
    def parse(cls, con: dict, key: str, obs_dim: int) -> Box:
        index = indices(_need(con, "index", key), f"{key}.index", obs_dim)
        low = _numbers(_need(con, "low", key), f"{key}.low", len(index), finite=False)
        high = _numbers(_need(con, "high", key), f"{key}.high", len(index), finite=False)
        for i, (lo, hi) in enumerate(zip(low, high)):
            if not lo < hi:
                _fail(f"{key}.low[{i}]", f"{lo} must be below high[{i}] = {hi}")
        if not any(math.isfinite(v) for v in low + high):
            _fail(key, "needs at least one finite bound")
        return cls(con["name"], con.get("gain", 0.5), index, low, high)

    def value(self, obs):
        return min([min(hi - obs[i], obs[i] - lo) for i, lo, hi in self._ends])

    def rows(self):
        out = []
        for i, lo, hi in self._ends:
            if math.isfinite(hi):
                out.append(LinearRow({i: -1.0}, hi))
            if math.isfinite(lo):
                out.append(LinearRow({i: 1.0}, -lo))
        return out


class Keepout(Constraint):
    """Stay out of ``|obs[index] - center| < radius`` (a cylinder: 2 indices, a sphere: 3)."""

    keys = frozenset({"index", "center", "radius"})
    dim = 0

    def __init__(self, name: str, gain: float, index: list[int], center: list[float], radius: float):
        self.index, self.center, self.radius = index, center, radius
        super().__init__(name, gain, index)

    @classmethod
    def parse(cls, con: dict, key: str, obs_dim: int) -> Keepout:
        index = indices(_need(con, "index", key), f"{key}.index", obs_dim)
        if len(index) != cls.dim:
            _fail(f"{key}.index", f"a {cls.kind} takes {cls.dim} indices, got {len(index)}")
        center = _numbers(_need(con, "center", key), f"{key}.center", cls.dim)
        radius = _number(_need(con, "radius", key), f"{key}.radius")
        if radius <= 0:
            _fail(f"{key}.radius", f"must be > 0, got {radius}")
        return cls(con["name"], con.get("gain", 0.5), index, center, radius)

    def value(self, obs):
        return math.sqrt(sum([(obs[i] - c) ** 2 for i, c in zip(self.index, self.center)])) - self.radius

    def rows(self):
        return [KeepoutRow(tuple(self.index), tuple(self.center), self.radius)]


class Cylinder(Keepout):
    """A vertical keep-out cylinder (2 position indices)."""

    kind, dim = "cylinder", 2


class Sphere(Keepout):
    """A keep-out ball (3 position indices)."""

    kind, dim = "sphere", 3


CONSTRAINT_CLASSES: dict[str, type[Constraint]] = {c.kind: c for c in (Halfspace, Box, Cylinder, Sphere)}
CONSTRAINT_TYPES = tuple(CONSTRAINT_CLASSES)


def _need(d: Any, key: str, where: str) -> Any:
    if not isinstance(d, dict):
        _fail(where, f"must be a mapping, got {type(d).__name__}")
    if key not in d:
        _fail(f"{where}.{key}", "missing")
    return d[key]


def parse_constraint(con: Any, key: str, obs_dim: int) -> Constraint:
    """Validate one constraint mapping (name, type, gain in (0, 1], the type's keys) and build its object."""
    name = _need(con, "name", key)
    if not isinstance(name, str) or not name:
        _fail(f"{key}.name", "must be a non-empty string")
    ctype = _need(con, "type", key)
    cls = CONSTRAINT_CLASSES.get(ctype) if isinstance(ctype, str) else None
    if cls is None:
        _fail(f"{key}.type", f"must be one of {CONSTRAINT_TYPES}, got {ctype!r}")
    gain = _number(con.get("gain", 0.5), f"{key}.gain")
    if not 0.0 < gain <= 1.0:
        _fail(f"{key}.gain", f"must be in (0, 1], got {gain}")
    for k in con:
        if k not in cls.keys | {"name", "type", "gain"}:
            _fail(f"{key}.{k}", "unknown key")
    return cls.parse(con, key, obs_dim)


def parse_constraints(constraints: Any, obs_dim: int, where: str = "constraints") -> list[Constraint]:
    """Every constraint of a list, with distinct names."""
    if not isinstance(constraints, list):
        _fail(where, "must be a list")
    out, names = [], set()
    for i, con in enumerate(constraints):
        c = parse_constraint(con, f"{where}[{i}]", obs_dim)
        if c.name in names:
            _fail(f"{where}[{i}].name", f"duplicate name {c.name!r}")
        names.add(c.name)
        out.append(c)
    return out


def cost_function(constraints: list[dict], obs_dim: int) -> Callable[[Sequence[float]], float]:
    """obs -> 1.0 when any constraint is violated, else 0.0 (the env's info["cost"] on its true state)."""
    parsed = parse_constraints(constraints, obs_dim)

    def cost(obs) -> float:
        values = obs.tolist() if hasattr(obs, "tolist") else list(obs)  # Python floats: fast scalar math
        return 1.0 if any(c.violated(values) for c in parsed) else 0.0

    return cost


def wrap_angle(a: float, center: float) -> float:
    """`a` wrapped into (center - pi, center + pi]: an angle of a hinge that turns without limit, as the shield and
    the violation count read it. An angle already in range is returned as it is, bitwise."""
    if center - math.pi < a <= center + math.pi:
        return a
    r = math.remainder(a - center, 2.0 * math.pi)  # in [-pi, pi]
    return center + (r if r > -math.pi else math.pi)
