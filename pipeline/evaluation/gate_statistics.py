"""The gate's statistics: paired bounds on return differences and exact bounds on rates, valid under optional stopping.

Returns. Candidate, legacy and production run on the same seeds and domains
(common random numbers), so the gate bounds the mean of the *paired*
per-episode difference d_i = R_candidate,i - R_reference,i: the plant's
domain, start and pushes cancel out of d_i. The bounds are one-sided paired
t bounds, mean(d) -/+ t_{1-a, n-1} sd(d) / sqrt(n). They rest on the mean of d
being close to normal (the central limit theorem over episodes); a rare,
large loss that no episode of the sample showed is outside what any bound on
so few episodes can see.

Sequential looks. The gate adds episodes in batches and looks after each
one; every look at a bound is another chance to be fooled by luck. The
confidence is therefore split over the K looks the budget plans
(Bonferroni: each look uses a = (1 - confidence) / K), so the chance that
*any* look promotes a candidate that is in truth worse than its threshold
stays <= 1 - confidence, wherever the gate stops (stopping early, on a
decision or on the time budget, only leaves alpha unspent).

Rates. A count k of n (violating episodes, shield interventions) gets exact
Clopper-Pearson bounds: 0 of n is bounded by 1 - a**(1/n) (about 3/n at 95 %),
never reported as 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BOUND_METHOD = "paired t, Bonferroni over planned looks"
RATE_METHOD = "Clopper-Pearson (exact binomial)"


def planned_looks(budget_episodes: int, batch_episodes: int) -> int:
    """Looks the gate may take: one after each batch until the episode budget is spent."""
    return max(1, math.ceil(budget_episodes / max(1, batch_episodes)))


def look_alpha(confidence: float, looks: int) -> float:
    """Error a single look may spend so that all `looks` together spend at most 1 - confidence."""
    return (1.0 - confidence) / max(1, looks)


@dataclass(frozen=True)
class PairedBound:
    """One-sided bounds on the mean paired difference (candidate - reference), return units per episode."""

    n: int
    mean: float
    lower: float  # -inf until two pairs exist
    upper: float  # +inf until two pairs exist
    alpha: float  # spent by each bound at this look

    def versus(self, threshold: float) -> str:
        """'above' (lower bound over the threshold), 'below' (upper bound under it) or 'undecided'.

        Strict, so a candidate identical to its reference (every difference 0) is never 'above' a 0 threshold:
        equal is not better."""
        if self.lower > threshold:
            return "above"
        if self.upper < threshold:
            return "below"
        return "undecided"


def paired_bound(candidate, reference, alpha: float) -> PairedBound:
    """Paired t bounds at level 1 - alpha each side on mean(candidate - reference) (episode-aligned arrays)."""
    c, r = np.asarray(candidate, np.float64), np.asarray(reference, np.float64)
    if c.shape != r.shape:
        raise ValueError(f"paired returns differ in length: {c.shape} vs {r.shape} (not the same seeds)")
    d = c - r
    n = int(d.size)
    if n == 0:
        return PairedBound(0, math.nan, -math.inf, math.inf, alpha)
    mean = float(d.mean())
    if n < 2:
        return PairedBound(n, mean, -math.inf, math.inf, alpha)
    from scipy.stats import t

    half = float(t.ppf(1.0 - alpha, n - 1)) * float(d.std(ddof=1)) / math.sqrt(n)
    return PairedBound(n, mean, mean - half, mean + half, alpha)


def clopper_pearson_upper(k: int, n: int, alpha: float) -> float:
    """Exact upper bound at level 1 - alpha on a rate with k events in n independent trials (1.0 for n = 0)."""
    if n <= 0:
        return 1.0
    if k >= n:
        return 1.0
    if k == 0:
        return 1.0 - alpha ** (1.0 / n)  # the closed form: P(0 events | p) = (1 - p)^n = alpha
    from scipy.stats import beta

    return float(beta.ppf(1.0 - alpha, k + 1, n - k))


def clopper_pearson_lower(k: int, n: int, alpha: float) -> float:
    """Exact lower bound at level 1 - alpha on a rate with k events in n trials (0.0 for k = 0)."""
    if n <= 0 or k <= 0:
        return 0.0
    if k >= n:
        return alpha ** (1.0 / n)
    from scipy.stats import beta

    return float(beta.ppf(alpha, k, n - k + 1))


def rate_summary(k: int | None, n: int | None, confidence: float) -> dict | None:
    """{k, n, rate, upper} with the exact upper bound at `confidence`; None when unknown."""
    if k is None or n is None or n <= 0:
        return None
    return {"k": int(k), "n": int(n), "rate": k / n, "upper": clopper_pearson_upper(int(k), int(n), 1.0 - confidence),
            "confidence": confidence}
