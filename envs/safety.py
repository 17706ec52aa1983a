"""A task's cost from its SAFETY constraints, through the one constraint definition (`shield.constraints`).

The tasks compute info["cost"] with this on their TRUE (noise-free) observation,
so the cost is exactly "some constraint in SAFETY has value h < 0", the same
objects the shield builds its barrier rows from.
"""

from __future__ import annotations

from shield.constraints import parse_constraints


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
