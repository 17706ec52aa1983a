"""Multi-step prediction-error fit of the twin's physical scales and latency to a field log.

Windows of H control steps are cut from the log; each starts from the logged
state and replays the logged (applied) actions, delayed by L whole steps, through
the twin. scipy's `least_squares` (trust-region reflective, soft-L1 loss so a
push or a reset inside a window does not drag the fit) minimises the predicted-
vs-logged error over all windows, in log-scale coordinates with the config's
ranges (widened) as bounds and a weak prior toward their centres: the prior only
decides directions the data leave flat. Latency is discrete: every candidate L
gets its own fit and the lowest error wins.

Identifiability: the Gauss-Newton information J^T J / sigma^2 (sigma from the
residuals, inflated by H because a window's residuals share one initial-state
error) is compared with the prior's. A parameter whose posterior spread is not
much narrower than its prior spread is `unidentified` and keeps its configured
range; eigen-directions of the information weaker than the prior are reported
as `flat_directions` (e.g. scaling every mass, damping and gain together leaves
every trajectory unchanged, so kinematic logs only pin their ratios).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from pipeline.calibration.logs import CalibrationError, FieldLog
from pipeline.calibration.twin import Twin

POSTERIOR_SHRINK = 0.3  # identified when the posterior std is below this share of the prior std
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

    def controls(self, latency: int) -> np.ndarray:
        """(n, H, act_dim): the action each window's plant got, `latency` steps after it was sent."""
        rows = self.starts[:, None] + np.arange(self.horizon)[None, :] - latency
        return self.action[rows]

    def subset(self, mask: np.ndarray) -> Windows:
        """The windows where mask is True."""
        return Windows(
            self.starts[mask], self.states[mask], self.first[mask], self.target[mask], self.action, self.horizon
        )


def cut_windows(twin: Twin, log: FieldLog, horizon: int, stride: int, max_latency: int) -> Windows:
    """Every `stride`-th window of `horizon` steps inside a run, leaving room for `max_latency` old actions."""
    starts = [np.arange(a + max_latency, b - horizon, stride) for a, b in log.runs]
    starts = np.concatenate(starts) if starts else np.zeros(0, int)
    if len(starts) < 20:
        raise CalibrationError(
            f"--from-log {log.source}: only {len(starts)} prediction windows of {horizon} steps "
            f"fit in the log's runs; record longer episodes"
        )
    idx = starts[:, None] + 1 + np.arange(horizon)[None, :]
    target = log.obs[idx][:, :, twin.state_obs]
    first = log.obs[starts][:, twin.state_obs]
    return Windows(starts, twin.initial_states(log.obs[starts]), first, target, log.action, horizon)


class Problem:
    """Residuals of one window set at one latency: every window's logged obs[k..k+H] against the twin.

    Unknowns: the log-scales theta, then each window's initial state (the logged
    obs[k] is only a noisy measurement of it; taking it as exact would bias
    damping up to absorb the noise). Residuals are divided by each channel's
    noise scale; a weak prior pulls theta toward the configured centres.
    """

    def __init__(
        self,
        twin: Twin,
        windows: Windows,
        latency: int,
        names: list[str],
        known: dict[str, float],
        prior_centre: np.ndarray,
        prior_std: np.ndarray,
        scale: np.ndarray,
        prior_weight: float,
    ):
        self.twin, self.windows, self.names, self.known = twin, windows, names, known
        self.controls = windows.controls(latency)
        self.centre, self.std, self.scale, self.weight = prior_centre, prior_std, scale, prior_weight
        self.n, self.ns = len(names), len(twin.state_obs)
        self.measured = np.concatenate([windows.first[:, None], windows.target], axis=1)  # (W, H+1, ns)

    def scales(self, theta: np.ndarray) -> dict[str, float]:
        """Scales by name for log-scales theta (known parameters held at their values)."""
        return {**self.known, **{n: float(math.exp(t)) for n, t in zip(self.names, theta)}}

    def start(self, theta: np.ndarray) -> np.ndarray:
        """The unknown vector at theta with every initial state at its logged value."""
        return np.concatenate([theta, (self.windows.first / self.scale).ravel()])

    def data_residuals(self, x: np.ndarray) -> np.ndarray:
        """(predicted - logged) / channel scale over windows, steps 0..H and state channels, flattened."""
        theta, s0 = x[: self.n], x[self.n :].reshape(-1, self.ns) * self.scale
        states = self.twin.set_states(self.windows.states, s0)
        pred = self.twin.predict(self.scales(theta), states, self.controls)
        pred = np.concatenate([s0[:, None], pred], axis=1)
        return ((pred - self.measured) / self.scale).ravel()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        theta = x[: self.n]
        return np.concatenate([self.data_residuals(x), self.weight * (theta - self.centre) / self.std])

    def sparsity(self):
        """Which unknowns each residual depends on (theta: all rows; a window's state: its own rows)."""
        from scipy.sparse import lil_matrix

        w, rows = len(self.windows.starts), (self.windows.horizon + 1) * self.ns
        pattern = lil_matrix((w * rows + self.n, self.n + w * self.ns), dtype=np.int8)
        pattern[:, : self.n] = 1
        for i in range(w):
            pattern[i * rows : (i + 1) * rows, self.n + i * self.ns : self.n + (i + 1) * self.ns] = 1
        return pattern.tocsr()


@dataclass
class FitResult:
    theta: np.ndarray
    x: np.ndarray  # theta and the windows' initial states
    cost: float  # mean robust cost of the data residuals
    info: np.ndarray  # Gauss-Newton information on theta, initial states marginalised, per unit residual variance
    residuals: np.ndarray


def solve(
    problem: Problem, x0: np.ndarray, f_scale: float, max_nfev: int, bounds: tuple[np.ndarray, np.ndarray]
) -> FitResult:
    """scipy least_squares (trf, soft-L1, sparse finite differences) from x0."""
    n = problem.n
    lo = np.concatenate([bounds[0], np.full(len(x0) - n, -np.inf)])
    hi = np.concatenate([bounds[1], np.full(len(x0) - n, np.inf)])
    x_scale = np.concatenate([problem.std, np.ones(len(x0) - n)])
    res = least_squares(
        problem,
        np.clip(x0, lo, hi),
        bounds=(lo, hi),
        x_scale=x_scale,
        diff_step=1e-4,
        loss="soft_l1",
        f_scale=f_scale,
        max_nfev=max_nfev,
        method="trf",
        jac_sparsity=problem.sparsity(),
        tr_solver="lsmr",
    )
    m = problem.measured.size
    r = res.fun[:m]
    return FitResult(res.x[:n], res.x, robust_cost(r, f_scale), _theta_information(problem, res.jac), r)


def _theta_information(problem: Problem, jac) -> np.ndarray:
    """J_t^T J_t minus what the initial states explain (Schur complement, window by window)."""
    n, ns = problem.n, problem.ns
    rows = (problem.windows.horizon + 1) * ns
    jac = jac.tocsr()
    info = np.zeros((n, n))
    for i in range(len(problem.windows.starts)):
        block = jac[i * rows : (i + 1) * rows].toarray()
        jt, js = block[:, :n], block[:, n + i * ns : n + (i + 1) * ns]
        proj = js @ np.linalg.pinv(js.T @ js) @ (js.T @ jt)
        info += jt.T @ (jt - proj)
    return info


def robust_cost(r: np.ndarray, f_scale: float) -> float:
    """Mean soft-L1 cost of normalized residuals (what the fit minimises, without the prior)."""
    z = (r / f_scale) ** 2
    return float(np.mean(2.0 * f_scale**2 * (np.sqrt(1.0 + z) - 1.0)))


def identifiability(fit: FitResult, prior_std: np.ndarray, inflation: float) -> tuple[np.ndarray, np.ndarray, list]:
    """(posterior std, posterior/prior std ratio, flat eigen-directions) in log-scale coordinates.

    `inflation` multiplies the residual variance: residuals inside a window share
    process noise (action noise, pushes), so they are not independent.
    """
    n = len(prior_std)
    if n == 0:
        return np.zeros(0), np.zeros(0), []
    sigma2 = (1.4826 * float(np.median(np.abs(fit.residuals)))) ** 2 * inflation
    info = fit.info / max(sigma2, 1e-24)
    cov = np.linalg.inv(info + np.diag(1.0 / prior_std**2))
    post = np.sqrt(np.diag(cov))
    eigval, eigvec = np.linalg.eigh(info * np.outer(prior_std, prior_std))  # information in prior units
    flat = [(float(v), eigvec[:, i]) for i, v in enumerate(eigval) if v < 1.0 / POSTERIOR_SHRINK**2]
    return post, post / prior_std, flat


def one_step_noise(twin: Twin, log: FieldLog, scales: dict[str, float], latency: int) -> np.ndarray:
    """Observation noise std per state observation, from one-step prediction residuals e_k.

    With white measurement noise n and process noise w, e_k ~ n_{k+1} - n_k + w_k
    (for a control period short against the dynamics), so the lag-1
    autocovariance of e is -var(n) while w (action noise, pushes) adds none.
    """
    win = cut_windows(twin, log, horizon=1, stride=1, max_latency=latency)
    e = (twin.predict(scales, win.states, win.controls(latency)) - win.target)[:, 0, :]
    consecutive = np.flatnonzero(np.diff(win.starts) == 1)
    lag1 = np.mean((e[consecutive] - e.mean(0)) * (e[consecutive + 1] - e.mean(0)), axis=0)
    return np.sqrt(np.maximum(-lag1, 0.0))
