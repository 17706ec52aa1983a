"""A task's cost from its SAFETY constraints, through the one constraint definition (`shield.constraints`).

The tasks compute info["cost"] with this on their TRUE (noise-free) observation,
so the cost is exactly "some constraint in SAFETY has value h < 0", the same
objects the shield builds its barrier rows from. The values themselves travel in
info["constraint_values"] (by name), so eval can say which limit was crossed and by how much.
"""

from __future__ import annotations

from shield.constraints import parse_constraints


def constraint_values(safety: dict, obs) -> dict[str, float]:
    """Each constraint's signed distance to its boundary at `obs` (>= 0 inside; units of the constrained
    quantity), by name: what eval reports per constraint. A step's cost is 1.0 when any is not >= 0."""
    values = obs.tolist() if hasattr(obs, "tolist") else list(obs)
    return {c.name: c.value(values) for c in _parsed(safety, len(values))}


def cost_of(values: dict[str, float]) -> float:
    """info["cost"] from `constraint_values`: 1.0 when some value is < 0 (or NaN), exactly as `violated` says."""
    return 0.0 if all(v >= 0.0 for v in values.values()) else 1.0


def violated_constraints(safety: dict, obs) -> list[str]:
    """Names of the constraints in `safety` that `obs` (1-D, SI units) violates; boundaries count as safe."""
    values = obs.tolist() if hasattr(obs, "tolist") else list(obs)  # Python floats: fast scalar math
    return [c.name for c in _parsed(safety, len(values)) if c.violated(values)]


_CACHE: dict[tuple[int, int], tuple[dict, list]] = {}


def _parsed(safety: dict, obs_dim: int) -> list:
    # Parsed once per SAFETY mapping: this runs every env step.
    key = (id(safety), obs_dim)
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not safety:
        hit = _CACHE[key] = (safety, parse_constraints(safety["constraints"], obs_dim))
    return hit[1]
