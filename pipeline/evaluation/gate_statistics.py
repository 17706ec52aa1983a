"""The gate's statistics: paired bounds on return differences and exact bounds on rates, valid under optional stopping.

Returns. Candidate, legacy and production run on the same seeds and domains
(common random numbers), so the gate bounds the mean of the *paired*
per-episode difference d_i = R_candidate,i - R_reference,i: the plant's
domain, start and pushes cancel out of d_i. The bounds are one-sided
*bootstrap-t* (studentized bootstrap) bounds on mean(d):
mean(d) - q sd(d) / sqrt(n), q the 1 - a quantile of the resampled
studentized mean, rather than Student's t quantile. Paired returns are skewed
(an episode where the candidate loses the pole costs far more than a good one
gains), and a plain t bound then promotes an equal candidate more often than
it claims; the bootstrap-t corrects for the skew the sample shows (the gate's
false-promotion rate on skewed samples: tests/pipeline/evaluation/test_gate_statistics.py). Below
`gate.min_episodes` paired episodes the gate never passes, because a skew the sample has not yet shown cannot be
corrected. What stays outside any bound on tens of episodes is a rare large
loss that no episode of the sample showed (a pole dropped on one episode in
thirty): the gate therefore also bounds that event itself, exactly, as the
rate of episodes the candidate lost minus the rate the reference lost, on
the same episodes (`lost_rate_bounds`), and a pass needs that bound under
its tolerance.
The resampling uses a fixed seed, so a report is reproducible.

Sequential looks. The gate adds episodes, doubling the sample from one look
to the next (`look_sizes`), and looks after each batch; every look at a
bound is another chance to be fooled by luck. The confidence is therefore split over the K looks the budget plans
(Bonferroni: each look uses a = (1 - confidence) / K), so the chance that
*any* look promotes a candidate that is in truth worse than its threshold
stays <= 1 - confidence, wherever the gate stops (stopping early, on a
decision or on the time budget, only leaves alpha unspent).

Rates. A count k of n (violating episodes, shield interventions) gets exact
Clopper-Pearson bounds: 0 of n is bounded by 1 - a**(1/n) (about 3/n at 95 %),
never reported as 0. Episodes are independent trials; the steps of one
episode are not: a shield that intervenes in bursts makes the steps' binomial
bound far too narrow (it covered a bursty plant's true rate about half the
time at a stated 95 %). The intervention rate is therefore also bounded with
the episode as the unit (`episode_rate_bounds`: the ratio sum(k)/sum(n), with the
steps discounted by its design effect, not the returns' bootstrap-t, which goes to
[0, 1] when most episodes have no intervention), and
the gate takes the wider of the two. On a rate carried by rare, large bursts
no bound on tens of episodes is exact (20 episodes that happen to hold no
burst show none); the episode bound is what makes a burst that did show count.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

BOUND_METHOD = "paired bootstrap-t, Bonferroni over planned looks"
BOOTSTRAP_SEED = 0
MIN_RESAMPLES = 4000
TAIL_RESAMPLES = 50  # resamples beyond the quantile, at least, so a small alpha is not read off a handful
RATE_METHOD = "Clopper-Pearson (exact binomial)"
EPISODE_RATE_METHOD = "Clopper-Pearson over episodes (design effect)"


def look_sizes(budget_episodes: int, first_episodes: int) -> list[int]:
    """Paired episodes at each look: `first_episodes`, then doubling, the last at the budget (10, 20, 40, .., 320).

    Doubling, not equal batches: each look spends its share of alpha, and a rare event (a lost episode) is only
    bounded tightly after hundreds of episodes, so equal batches of ten would split alpha 32 ways over a budget of
    320 where doubling splits it 6 ways, and a budget that can decide would cost more episodes than it saves."""
    first, budget = max(1, first_episodes), max(1, budget_episodes)
    sizes = [min(first, budget)]
    while sizes[-1] < budget:
        sizes.append(min(2 * sizes[-1], budget))
    return sizes


def planned_looks(budget_episodes: int, first_episodes: int) -> int:
    """Looks the gate may take (`look_sizes`)."""
    return len(look_sizes(budget_episodes, first_episodes))


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

    def as_dict(self) -> dict:
        """{"mean", "lower", "upper", "n"}: what reports and benches record of it."""
        return {"mean": self.mean, "lower": self.lower, "upper": self.upper, "n": self.n}

    def __str__(self) -> str:
        return f"{self.mean:+.2f} [{self.lower:+.2f}, {self.upper:+.2f}] (n={self.n})"

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
    """Bootstrap-t bounds at level 1 - alpha each side on mean(candidate - reference) (episode-aligned arrays)."""
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
    sd = float(d.std(ddof=1))
    if sd == 0.0:  # every pair differs by the same amount: no spread to resample
        return PairedBound(n, mean, mean, mean, alpha)
    low_q, high_q = studentized_quantiles(d, alpha)
    se = sd / math.sqrt(n)
    return PairedBound(n, mean, mean - high_q * se, mean - low_q * se, alpha)


def studentized_quantiles(d: np.ndarray, alpha: float) -> tuple[float, float]:
    """The alpha and 1 - alpha quantiles of the bootstrap distribution of (mean* - mean) / (sd* / sqrt(n))."""
    n = d.size
    resamples = max(MIN_RESAMPLES, math.ceil(TAIL_RESAMPLES / alpha))
    counts = _resample_counts(n, resamples)  # how often each episode appears in each resample
    x = d - d.mean()  # centred: the statistic does not move with a shift, and the sums below stay exact
    m = counts @ x / n
    var = np.maximum(counts @ (x * x) / n - m * m, 0.0) * n / (n - 1)
    s = np.sqrt(var)
    # A resample of one repeated value has no spread: its studentized mean is 0 if it sits on the mean,
    # else as far out as it can be.
    tiny = 1e-12 * float(np.abs(x).max())
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(s > tiny, m / (s / math.sqrt(n)), np.where(np.abs(m) > tiny, np.sign(m) * np.inf, 0.0))
    # No interpolation: an infinite resample must not turn a quantile into inf - inf; each side rounds outward.
    return float(np.quantile(t, alpha, method="lower")), float(np.quantile(t, 1.0 - alpha, method="higher"))


@functools.lru_cache(maxsize=64)
def _resample_counts(n: int, resamples: int) -> np.ndarray:
    """Multiplicities [resamples, n] of the bootstrap's resamples of n episodes: a fixed seed, drawn once per n."""
    idx = np.random.default_rng((BOOTSTRAP_SEED, n)).integers(0, n, size=(resamples, n))
    counts = np.zeros((resamples, n))
    np.add.at(counts, (np.repeat(np.arange(resamples), n), idx.ravel()), 1.0)
    return counts


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


def lost_rate_bounds(candidate_only: int, reference_only: int, n: int, alpha: float) -> tuple[float, float]:
    """Bounds at level 1 - alpha each on p_c - p_r, the rate of episodes the candidate lost minus the reference's,
    from n paired episodes: `candidate_only` the candidate lost and the reference did not, `reference_only` the
    reverse (the episodes both lost cancel). Each side is the exact Clopper-Pearson bound on one discordant rate
    less the other's opposite bound, alpha / 2 each (Bonferroni), whatever the counts, so that which bound applies
    never depends on the sample."""
    upper = clopper_pearson_upper(candidate_only, n, alpha / 2) - clopper_pearson_lower(reference_only, n, alpha / 2)
    lower = clopper_pearson_lower(candidate_only, n, alpha / 2) - clopper_pearson_upper(reference_only, n, alpha / 2)
    return lower, upper


def lossless_episodes(limit: float, alpha: float) -> int:
    """Fewest paired episodes, none lost by either policy, whose `lost_rate_bounds` upper bound at `alpha` is at most
    `limit`: (1 - limit)^n <= alpha / 2, the candidate's rate getting half of alpha there as it does in the bounds."""
    if limit >= 1.0:
        return 1
    if limit <= 0.0:
        raise ValueError("a rate bound of 0 needs infinitely many episodes")
    return math.ceil(math.log(alpha / 2) / math.log1p(-limit))


def episode_rate_bounds(counts, lengths, alpha: float) -> tuple[float, float] | None:
    """Bounds at level 1 - alpha each side on the rate sum(counts) / sum(lengths), the episode as the unit: the
    Clopper-Pearson bounds with the steps discounted by the design effect (Kish; Rao and Scott 1992, clustered
    binary data), the ratio estimator's between-episode variance over the binomial variance, at least 1. Events
    and steps are divided by it, so a burst counts as the fewer independent trials it is. None below two
    episodes.

    Not the bootstrap-t the returns use: with most episodes free of interventions, a share of its resamples
    have no spread and the bound went to 1 whatever the evidence (one episode of forty with 7 intervened steps of
    500 gave [0, 1]), so a candidate the shield touched once could never pass. On bursty Beta(0.5, 9.5) shares
    both cover the rate near the stated level (test_gate_statistics)."""
    from scipy.stats import beta

    k, n = np.asarray(counts, np.float64), np.asarray(lengths, np.float64)
    m = int(k.size)
    if m < 2 or k.shape != n.shape or n.sum() <= 0:
        return None
    total = float(n.sum())
    events = float(k.sum())
    rate = events / total
    if rate <= 0.0 or rate >= 1.0:  # nothing to discount: the steps' exact bounds
        return clopper_pearson_lower(int(events), int(total), alpha), clopper_pearson_upper(
            int(events), int(total), alpha
        )
    between = m / (m - 1) * float(np.sum((k - rate * n) ** 2)) / total**2
    deff = max(1.0, between / (rate * (1.0 - rate) / total))
    n_eff = total / deff
    k_eff = rate * n_eff
    return float(beta.ppf(alpha, k_eff, n_eff - k_eff + 1.0)), float(beta.ppf(1.0 - alpha, k_eff + 1.0, n_eff - k_eff))


def rate_summary(k: int | None, n: int | None, confidence: float) -> dict | None:
    """{k, n, rate, upper} with the exact upper bound at `confidence`; None when unknown."""
    if k is None or n is None or n <= 0:
        return None
    return {
        "k": int(k),
        "n": int(n),
        "rate": k / n,
        "upper": clopper_pearson_upper(int(k), int(n), 1.0 - confidence),
        "confidence": confidence,
    }
