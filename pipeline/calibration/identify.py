"""What the logs pin down: identifiable combinations with intervals, flat directions, and the calibrated ranges.

The fit works in log-scales theta. Its information matrix A (Gauss-Newton,
initial states marginalised) says which combinations w . theta the logs see:
its eigenvectors with enough information relative to the config's ranges are
`identified` and get a 90 % interval from the cluster-robust sandwich
covariance A^-1 B A^-1, a stated systematic floor, and how far the fit moves when its own
assumptions change (fit.assumption_shifts); the others are `flat` (scaling every mass, damping and
gain together leaves every trajectory unchanged, so kinematic logs never pin
that common scale). A single parameter is pinned only when it lies inside the
identified subspace.

Calibrated ranges are the projections, parameter by parameter, of the set of
plants that are both in the config's ranges and inside every identified
combination's interval: along a flat direction that set spans the config's
whole range, so the calibrated set keeps it; it narrows only what the logs saw.
If no plant in the config's ranges fits, the plant is outside them.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import linprog
from scipy.stats import norm

INTERVAL = 0.90  # the stated intervals' coverage
IDENTIFIED_SHRINK = 0.3  # identified when its interval's std is below this share of the config range's (uniform) std
PINNED_LEAK = 0.1  # a parameter is pinned alone when its axis leaks less than this into the flat subspace
MIN_HALF_WIDTH = 0.02  # log-scale: a calibrated band is never narrower than +-2 % (the twin is not the plant)
# Log-scale std added (in quadrature) to every combination's sandwich std: the twin's estimator keeps a
# few per cent of bias on realistic logs (finite windows, pushes caught only in part by the robust loss)
# that no sampling spread shows; bench/bench_calibration.py measures the coverage this gives.
SYSTEMATIC_STD = 0.025
OUTSIDE_INTERVAL = 0.99  # a plant is called outside only if not even the 99 % band meets the ranges


def combinations(
    a: np.ndarray,
    b: np.ndarray,
    theta: np.ndarray,
    names: list[str],
    box_lo: np.ndarray,
    box_hi: np.ndarray,
    shifts: np.ndarray | None = None,
) -> list[dict]:
    """Eigen-combinations of the information, strongest first: weights, estimate, std, interval, identified.

    box_lo/box_hi: the config's ranges (log scales): their uniform std along a
    direction is what a combination must beat to count as identified.
    shifts: (k, n) moves of theta under the fit's varied assumptions; their RMS
    along a combination is added to its std (a systematic error, not sampling).
    """
    n = len(names)
    if n == 0:
        return []
    eigval, eigvec = np.linalg.eigh(0.5 * (a + a.T))
    order = np.argsort(eigval)[::-1]
    z = norm.ppf(0.5 + INTERVAL / 2)
    prior_std = (box_hi - box_lo) / math.sqrt(12.0)
    out = []
    top = max(float(eigval[order[0]]), 1e-300)
    for k in order:
        v = eigvec[:, k]
        v = v / np.abs(v).max()
        v = v if v[np.argmax(np.abs(v))] > 0 else -v
        lam = float(eigval[k]) / float(np.sum(v**2))
        assumed = math.sqrt(float(np.mean((shifts @ v) ** 2))) if shifts is not None and len(shifts) else 0.0
        if lam > 1e-9 * top / float(np.sum(v**2)):
            sampling = math.sqrt(max(float(v @ b @ v), 0.0)) / (lam * float(np.sum(v**2)))
            std = math.sqrt(sampling**2 + SYSTEMATIC_STD**2 + assumed**2)
        else:
            sampling, std = math.inf, math.inf
        along = math.sqrt(float(np.sum(v**2 * prior_std**2)))
        est = float(v @ theta)
        out.append(
            {
                "weights": {nm: float(w) for nm, w in zip(names, v)},
                "log_estimate": est,
                "log_std": std,
                "log_std_sampling": sampling,  # the sandwich's part; the rest is systematic
                "log_std_assumptions": assumed,
                "range_log_std": along,  # the config's ranges' own spread along it: what the logs must beat
                "estimate": _exp(est),
                "interval": [_exp(est - z * std), _exp(est + z * std)] if math.isfinite(std) else None,
                "identified": bool(std < IDENTIFIED_SHRINK * along),
            }
        )
    return out


def covariance(
    a: np.ndarray, b: np.ndarray, combos: list[dict], names: list[str], systematic: bool = True
) -> np.ndarray:
    """Covariance of theta restricted to the identified combinations (zero along flat ones).

    The sandwich, plus (unless `systematic` is False: the sampling part alone) each
    combination's systematic part (the floor and the assumption shifts) along its
    own direction, as its stated std carries them.
    """
    n = len(names)
    ident = [c for c in combos if c["identified"]]
    v = np.array([[c["weights"][nm] for nm in names] for c in ident]).reshape(-1, n)
    if not len(v):
        return np.zeros((n, n))
    ainv = np.linalg.pinv(v @ a @ v.T)  # information in the identified coordinates
    proj = v.T @ ainv @ v  # A^+ on the identified subspace
    cov = proj @ b @ proj
    for c, w in zip(ident, v if systematic else []):
        var = SYSTEMATIC_STD**2 + c.get("log_std_assumptions", 0.0) ** 2  # this combination's systematic part
        cov += np.outer(w, w) * var / float(w @ w) ** 2
    return cov


def pinned(combos: list[dict], names: list[str]) -> list[bool]:
    """Per parameter: does its axis lie (almost) inside the identified subspace?"""
    n = len(names)
    v = np.array([[c["weights"][nm] for nm in names] for c in combos if c["identified"]]).reshape(-1, n)
    if not len(v):
        return [False] * n
    q, _ = np.linalg.qr(v.T)
    leak = 1.0 - np.sum(q**2, axis=1)  # squared distance of each unit axis from the subspace
    return [bool(math.sqrt(max(x, 0.0)) < PINNED_LEAK) for x in leak]


def _bands(combos: list[dict], names: list[str], coverage: float):
    """(rows, lo, hi): the identified combinations' intervals as linear constraints on theta."""
    z = norm.ppf(0.5 + coverage / 2)
    # A band's floor is the stated interval's; a narrower coverage (the central part of a band) narrows it alike,
    # down to the estimate itself at coverage 0.
    floor = MIN_HALF_WIDTH * min(1.0, z / norm.ppf(0.5 + INTERVAL / 2))
    rows, lo, hi = [], [], []
    for c in combos:
        if c["identified"]:
            w = np.array([c["weights"][nm] for nm in names])
            half = max(z * c["log_std"], floor * float(np.abs(w).sum()))
            rows.append(w)
            lo.append(c["log_estimate"] - half)
            hi.append(c["log_estimate"] + half)
    return np.array(rows).reshape(-1, len(names)), np.array(lo), np.array(hi)


def consistent_ranges(
    combos: list[dict], names: list[str], box_lo: np.ndarray, box_hi: np.ndarray, coverage: float = INTERVAL
) -> np.ndarray | None:
    """(n, 2) log-scale range of each parameter over {theta in box, inside every band}; None if that set is empty."""
    n = len(names)
    rows, lo, hi = _bands(combos, names, coverage)
    a_ub = np.vstack([rows, -rows]) if len(rows) else None
    b_ub = np.concatenate([hi, -lo]) if len(rows) else None
    bounds = list(zip(box_lo, box_hi))
    out = np.empty((n, 2))
    for i in range(n):
        for j, sign in enumerate((1.0, -1.0)):
            c = np.zeros(n)
            c[i] = sign
            res = linprog(c, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
            if res.status == 2:
                return None
            if not res.success:
                raise RuntimeError(f"linprog: {res.message}")
            out[i, j] = res.x[i]
    return out


def _exp(x: float) -> float:
    """exp, saturating at the largest float instead of raising: a log in other units can push a fit that far."""
    return math.exp(min(x, 709.0))
