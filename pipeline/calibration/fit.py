"""Multi-step (simulation-error) fit of the twin's physical scales and latency to a field log.

Windows of H control steps are cut from the log; each starts from its own
initial state (an unknown: the logged obs[k] is only a noisy measurement of it)
and replays the logged actions, delayed by L whole steps, through the twin.
scipy's `least_squares` (trust-region reflective, soft-L1 loss so a push inside
a window does not drag the fit) minimises the predicted-vs-logged error over
all windows, in log-scale coordinates. Each residual is divided by the spread
expected at its step and channel (obs noise at the window's start, growing with
the process noise the logged actions do not show), so every step weighs what it
knows.

The global stage (`global_search`) fits every latency candidate from several
starts spread over the config's ranges on a third of the windows; the local
stage refines the best on every window. Latency is discrete: its confidence
comes from a paired comparison of the per-window errors of the best and the
runner-up latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares
from scipy.stats import norm, qmc

from pipeline.calibration.logs import CalibrationError, FieldLog
from pipeline.calibration.twin import Twin

BOUND_WIDEN = 2.0  # fit bounds: the configured hull widened by this factor each way (scales)


@dataclass
class Windows:
    """Prediction windows cut from a log: start rows, initial states, targets."""

    starts: np.ndarray  # row of each window's initial state
    states: np.ndarray  # (n, nstate) full physics state from obs[start]
    first: np.ndarray  # (n, n_state_obs) logged obs[start] (state observations)
    target: np.ndarray  # (n, H, n_state_obs) logged obs[start + 1 .. start + H]
    action: np.ndarray  # (N, act_dim) the whole log's applied actions
    horizon: int
    dropped_late: int = 0  # windows left out because a late row falls in them

    def controls(self, latency: int) -> np.ndarray:
        """(n, H, act_dim): the action each window's plant got, `latency` steps after it was sent."""
        rows = self.starts[:, None] + np.arange(self.horizon)[None, :] - latency
        return self.action[rows]

    def subset(self, mask: np.ndarray) -> "Windows":
        """The windows where mask is True."""
        return Windows(self.starts[mask], self.states[mask], self.first[mask], self.target[mask], self.action,
                       self.horizon, self.dropped_late)


def cut_windows(twin: Twin, log: FieldLog, horizon: int, stride: int, max_latency: int) -> Windows:
    """Every `stride`-th window of `horizon` steps inside a run, leaving room for `max_latency` old actions.

    A window whose rows (its delayed actions included) hold a late sample is left out.
    """
    starts = [np.arange(a + max_latency, b - horizon, stride) for a, b in log.runs]
    starts = np.concatenate(starts) if starts else np.zeros(0, int)
    dropped = 0
    if log.late and len(starts):
        late = np.asarray(log.late)
        lo, hi = starts - max_latency, starts + horizon
        hit = ((late[None, :] > lo[:, None]) & (late[None, :] <= hi[:, None])).any(axis=1)
        dropped = int(hit.sum())
        starts = starts[~hit]
    if len(starts) < 20:
        raise CalibrationError(f"--from-log {log.source}: only {len(starts)} prediction windows of {horizon} steps "
                               f"fit in the log's runs; record longer episodes")
    idx = starts[:, None] + 1 + np.arange(horizon)[None, :]
    target = log.obs[idx][:, :, twin.state_obs]
    first = log.obs[starts][:, twin.state_obs]
    return Windows(starts, twin.initial_states(log.obs[starts]), first, target, log.action, horizon, dropped)


class Problem:
    """Residuals of one window set at one latency: every window's logged obs[k..k+H] against the twin.

    Unknowns: the log-scales theta, then each window's initial state. Residuals
    are divided by `scale` (H+1, n_state_obs), the expected spread per step and channel.
    """

    def __init__(self, twin: Twin, windows: Windows, latency: int, names: list[str], known: dict[str, float],
                 scale: np.ndarray):
        self.twin, self.windows, self.names, self.known, self.latency = twin, windows, names, known, latency
        self.controls = windows.controls(latency)
        self.scale = scale
        self.n, self.ns = len(names), len(twin.state_obs)
        self.measured = np.concatenate([windows.first[:, None], windows.target], axis=1)  # (W, H+1, ns)

    def scales(self, theta: np.ndarray) -> dict[str, float]:
        """Scales by name for log-scales theta (known parameters held at their values)."""
        return {**self.known, **{n: float(math.exp(t)) for n, t in zip(self.names, theta)}}

    def start(self, theta: np.ndarray) -> np.ndarray:
        """The unknown vector at theta with every initial state at its logged value."""
        return np.concatenate([theta, (self.windows.first / self.scale[0]).ravel()])

    def states(self, x: np.ndarray) -> np.ndarray:
        """(W, ns) initial state observations in x."""
        return x[self.n:].reshape(-1, self.ns) * self.scale[0]

    def predict(self, theta: np.ndarray, s0: np.ndarray, controls: np.ndarray | None = None) -> np.ndarray:
        """(W, H+1, ns) predicted state observations from initial states s0, step 0 included."""
        states = self.twin.set_states(self.windows.states, s0)
        pred = self.twin.predict(self.scales(theta), states, self.controls if controls is None else controls)
        return np.concatenate([s0[:, None], pred], axis=1)

    def window_residuals(self, x: np.ndarray) -> np.ndarray:
        """(W, H+1, ns) (predicted - logged) / scale."""
        return (self.predict(x[:self.n], self.states(x)) - self.measured) / self.scale

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.window_residuals(x).ravel()

    def sparsity(self):
        """Which unknowns each residual depends on (theta: all rows; a window's state: its own rows)."""
        from scipy.sparse import lil_matrix

        w, rows = len(self.windows.starts), (self.windows.horizon + 1) * self.ns
        pattern = lil_matrix((w * rows, self.n + w * self.ns), dtype=np.int8)
        pattern[:, :self.n] = 1
        for i in range(w):
            pattern[i * rows:(i + 1) * rows, self.n + i * self.ns:self.n + (i + 1) * self.ns] = 1
        return pattern.tocsr()


@dataclass
class FitResult:
    theta: np.ndarray
    x: np.ndarray  # theta and the windows' initial states
    cost: float  # mean robust cost of the residuals
    window_cost: np.ndarray  # (W,) robust cost per window
    residuals: np.ndarray  # (W, H+1, ns) at the fit
    latency: int
    f_scale: float


def robust(r: np.ndarray, f_scale: float) -> np.ndarray:
    """Soft-L1 cost of each normalized residual (what the fit minimises)."""
    return 2.0 * f_scale ** 2 * (np.sqrt(1.0 + (r / f_scale) ** 2) - 1.0)


def solve(problem: Problem, x0: np.ndarray, f_scale: float, max_nfev: int,
          bounds: tuple[np.ndarray, np.ndarray]) -> FitResult:
    """scipy least_squares (trf, soft-L1, sparse finite differences) from x0."""
    n = problem.n
    lo = np.concatenate([bounds[0], np.full(len(x0) - n, -np.inf)])
    hi = np.concatenate([bounds[1], np.full(len(x0) - n, np.inf)])
    x_scale = np.concatenate([np.full(n, 0.1), np.ones(len(x0) - n)])
    res = least_squares(problem, np.clip(x0, lo, hi), bounds=(lo, hi), x_scale=x_scale, diff_step=1e-4,
                        loss="soft_l1", f_scale=f_scale, max_nfev=max_nfev, method="trf",
                        jac_sparsity=problem.sparsity(), tr_solver="lsmr")
    r = res.fun.reshape(problem.measured.shape)
    per = robust(r, f_scale)
    return FitResult(res.x[:n], res.x, float(per.mean()), per.mean(axis=(1, 2)), r, problem.latency, f_scale)


def step_spread(residuals: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """(H+1, ns) robust spread of residuals (in `scale` units) per step and channel, back in physical units."""
    spread = 1.4826 * np.median(np.abs(residuals - np.median(residuals, axis=0)), axis=0) * scale
    return np.maximum(spread, scale[:1])  # never below the start's: obs noise is in every step


def global_search(make_problem, latencies: list[int], lo: np.ndarray, hi: np.ndarray, bounds, f_scale: float,
                  starts: int, max_nfev: int, seed: int = 0) -> list[FitResult]:
    """The best fit per latency, each from `starts` points spread over [lo, hi] (log scales) plus the centre.

    A scrambled Sobol design keeps starts apart in every parameter, so a fit
    trapped in one basin (or at a bound) is outvoted by one started elsewhere.
    """
    n = len(lo)
    points = [0.5 * (lo + hi)]
    if n and starts > 0:
        unit = qmc.Sobol(n, scramble=True, seed=seed).random(max(starts, 1))[:starts]
        points += list(lo + unit * (hi - lo))
    best = []
    for lat in latencies:
        problem = make_problem(lat)
        fits = [solve(problem, problem.start(p), f_scale, max_nfev, bounds) for p in points]
        best.append(min(fits, key=lambda f: f.cost))
    return best


def latency_confidence(best: FitResult, other: FitResult) -> float:
    """Probability that `best`'s latency beats `other`'s: a paired test over the same windows' errors."""
    d = other.window_cost - best.window_cost
    se = float(np.std(d, ddof=1)) / math.sqrt(len(d)) if len(d) > 1 else 0.0
    if se <= 0:
        return 1.0 if d.mean() > 0 else 0.5
    return float(norm.cdf(d.mean() / se))


def state_jacobian(problem: Problem, x: np.ndarray) -> np.ndarray:
    """(W, (H+1) ns, ns) d residuals / d initial state of each window (finite differences)."""
    theta, s0 = x[:problem.n], problem.states(x)
    base = problem.predict(theta, s0)
    cols = []
    for c in range(problem.ns):
        h = 1e-4 * problem.scale[0, c]
        s = s0.copy()
        s[:, c] += h
        cols.append(((problem.predict(theta, s) - base) / problem.scale / h * problem.scale[0, c]).reshape(len(s0), -1))
    return np.stack(cols, axis=2)


def theta_jacobian(problem: Problem, x: np.ndarray, step: float = 1e-4) -> np.ndarray:
    """(W, (H+1) ns, n) d residuals / d log-scale, central differences."""
    cols = []
    for i in range(problem.n):
        xp, xm = x.copy(), x.copy()
        xp[i] += step
        xm[i] -= step
        cols.append(((problem(xp) - problem(xm)) / (2 * step)).reshape(len(problem.windows.starts), -1))
    return np.stack(cols, axis=2) if cols else np.zeros((len(problem.windows.starts), 0, 0))


def project_out(block: np.ndarray, js: np.ndarray) -> np.ndarray:
    """Per window, the part of `block` (W, rows, k) the window's own initial state cannot explain."""
    gram = np.einsum("wri,wrj->wij", js, js) + 1e-12 * np.eye(js.shape[2])
    return block - js @ np.linalg.solve(gram, np.einsum("wri,wrk->wik", js, block))


def sandwich(problem: Problem, fit: FitResult, cluster: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) of the cluster-robust sandwich covariance A^-1 B A^-1 of the log-scales.

    A: Gauss-Newton information (initial states marginalised, soft-L1 weights);
    B: the spread of the per-cluster scores. Residuals in a window, and in
    neighbouring windows, share process noise (action noise, pushes) that the
    plain J^T J / sigma^2 would count as independent evidence; clusters of
    `cluster` consecutive windows carry it.
    """
    x = fit.x
    jt = theta_jacobian(problem, x)
    js = state_jacobian(problem, x)
    r = fit.residuals.reshape(len(x[problem.n:]) // problem.ns, -1)
    weight = (1.0 + (r / fit.f_scale) ** 2) ** -0.25  # sqrt of soft-L1's rho'
    jt_w, js_w, r_w = jt * weight[..., None], js * weight[..., None], r * weight
    jt_free = project_out(jt_w, js_w)
    a = np.einsum("wri,wrj->ij", jt_free, jt_free)
    score = np.einsum("wri,wr->wi", jt_free, r_w)
    groups = np.arange(len(score)) // cluster
    g = np.stack([score[groups == k].sum(axis=0) for k in np.unique(groups)])
    b = g.T @ g * len(g) / max(len(g) - 1, 1)
    return a, b
