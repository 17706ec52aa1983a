"""Evaluates the SAFETY constraints (CONTRACTS.md schema, over observation indices) on an observation.

The tasks compute info["cost"] with this on their TRUE (noise-free) observation,
so the cost is exactly "some constraint in SAFETY is violated".
"""

from __future__ import annotations

import math

import numpy as np


def constraint_violated(constraint: dict, obs) -> bool:
    """True when `obs` (a 1-D observation, SI units) violates one constraint; boundaries count as safe."""
    kind = constraint["type"]
    if kind == "halfspace":
        return sum(a * o for a, o in zip(constraint["a"], obs) if a) > constraint["b"]
    if kind == "box":
        for i, lo, hi in zip(constraint["index"], constraint["low"], constraint["high"]):
            if obs[i] < lo or obs[i] > hi:
                return True
        return False
    if kind in ("cylinder", "sphere"):
        d2 = sum((obs[i] - c) ** 2 for i, c in zip(constraint["index"], constraint["center"]))
        return math.sqrt(d2) < constraint["radius"]
    raise ValueError(f"constraint {constraint.get('name')!r} has unknown type {kind!r}")


def violated_constraints(safety: dict, obs) -> list[str]:
    """Names of the constraints in `safety` that `obs` violates."""
    values = obs.tolist() if isinstance(obs, np.ndarray) else list(obs)  # Python floats: fast scalar math
    return [c["name"] for c in safety["constraints"] if constraint_violated(c, values)]
