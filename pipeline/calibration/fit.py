"""Multi-step (simulation-error) fit of the twin's physical scales and latency to a field log.

Windows of H control steps are cut from the log; each starts from its own
initial state (an unknown: the logged obs[k] is only a noisy measurement of it)
and replays the logged actions, delayed by L whole steps, through the twin.
scipy's `least_squares` (trust-region reflective, soft-L1 loss so a push inside
a window does not drag the fit) minimises the predicted-vs-logged error over
all windows, in log-scale coordinates. The process noise the config declares
(action noise; pushes, heavy-tailed, caught by the soft-L1) enters as dynamics
defects of each step (multiple shooting), so feedback and pushes inside a window
are not blamed on the parameters, as a pure simulation error would blame them.

The global stage (`global_search`) fits every latency candidate from several
starts spread over the config's ranges on a third of the windows; calibrate
runs each latency's best start to convergence there to rank the latencies, and
the local stage refines the best two of those converged fits on every window. Latency is discrete: its confidence
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
# The fit's own assumptions, varied within reason: (process spread, soft-L1 knee) factors. A combination
# the logs pin does not move when they change; one set by the assumptions does (see assumption_shifts).
ASSUMPTIONS = ((0.5, 1.0), (2.0, 1.0), (1.0, 0.5), (1.0, 2.0))


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

    def subset(self, mask: np.ndarray) -> Windows:
        """The windows where mask is True."""
        return Windows(
            self.starts[mask],
            self.states[mask],
            self.first[mask],
            self.target[mask],
            self.action,
            self.horizon,
            self.dropped_late,
        )


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
        raise CalibrationError(
            f"--from-log {log.source}: only {len(starts)} prediction windows of {horizon} steps "
            f"fit in the log's runs; record longer episodes"
        )
    idx = starts[:, None] + 1 + np.arange(horizon)[None, :]
    target = log.obs[idx][:, :, twin.state_obs]
    first = log.obs[starts][:, twin.state_obs]
    return Windows(starts, twin.initial_states(log.obs[starts]), first, target, log.action, horizon, dropped)


class Problem:
    """Residuals of one window set at one latency: multiple shooting with process noise.

    Unknowns: the log-scales theta, then every window's state at each of its
    H+1 steps (in units of the obs noise). Residuals, window by window: the
    observation misfit (state - logged obs) / obs_std, then the dynamics defects
    (state[k+1] - twin(state[k], action[k - L])) / process_std. The process noise
    the config declares (action noise, pushes) lands in the defects instead of
    being blamed on the parameters, which a pure simulation error would do under
    feedback and pushes; with process_std -> 0 it is the simulation error.
    """

    def __init__(
        self,
        twin: Twin,
        windows: Windows,
        latency: int,
        names: list[str],
        known: dict[str, float],
        obs_std: np.ndarray,
        process_std: np.ndarray,
    ):
        self.twin, self.windows, self.names, self.known, self.latency = twin, windows, names, known, latency
        self.obs_std, self.process_std = obs_std, process_std
        self.n, self.ns, self.h = len(names), len(twin.state_obs), windows.horizon
        self.w = len(windows.starts)
        self.controls = windows.controls(latency).reshape(self.w * self.h, 1, -1)
        self.template = np.repeat(windows.states, self.h, axis=0)
        self.measured = np.concatenate([windows.first[:, None], windows.target], axis=1)  # (W, H+1, ns)

    def scales(self, theta: np.ndarray) -> dict[str, float]:
        """Scales by name for log-scales theta (known parameters held at their values)."""
        return {**self.known, **{n: float(math.exp(t)) for n, t in zip(self.names, theta)}}

    def start(self, theta: np.ndarray, states: np.ndarray | None = None) -> np.ndarray:
        """The unknown vector at theta with every state at its logged value (or at `states`, (W, H+1, ns))."""
        s = self.measured if states is None else states
        return np.concatenate([theta, (s / self.obs_std).ravel()])

    def states(self, x: np.ndarray) -> np.ndarray:
        """(W, H+1, ns) states in x."""
        return x[self.n :].reshape(self.w, self.h + 1, self.ns) * self.obs_std

    def parts(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(obs misfit (W, H+1, ns), defects (W, H, ns)), normalized."""
        s = self.states(x)
        start = self.twin.set_states(self.template, s[:, :-1].reshape(-1, self.ns))
        pred = self.twin.predict(self.scales(x[: self.n]), start, self.controls)[:, 0]
        defect = (s[:, 1:] - pred.reshape(self.w, self.h, self.ns)) / self.process_std
        return (s - self.measured) / self.obs_std, defect

    def window_residuals(self, x: np.ndarray) -> np.ndarray:
        """(W, rows): each window's observation misfits then its defects."""
        obs, defect = self.parts(x)
        return np.concatenate([obs.reshape(self.w, -1), defect.reshape(self.w, -1)], axis=1)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.window_residuals(x).ravel()

    def simulate(self, x: np.ndarray, controls: np.ndarray | None = None) -> np.ndarray:
        """(W, H+1, ns) open-loop prediction from each window's first state in x (the logged actions replayed)."""
        s0 = self.states(x)[:, 0]
        states = self.twin.set_states(self.windows.states, s0)
        controls = self.windows.controls(self.latency) if controls is None else controls
        pred = self.twin.predict(self.scales(x[: self.n]), states, controls)
        return np.concatenate([s0[:, None], pred], axis=1)

    def sparsity(self):
        """Which unknowns each residual depends on: theta every defect; a state its obs row and two defect steps."""
        from scipy.sparse import coo_matrix

        w, h, ns, n = self.w, self.h, self.ns, self.n
        rows_per = (2 * h + 1) * ns
        r, c = [], []
        wi = np.arange(w)[:, None, None]
        k = np.arange(h + 1)[None, :, None]
        ch = np.arange(ns)[None, None, :]
        col = n + (wi * (h + 1) + k) * ns + ch  # (w, h+1, ns) state columns
        obs_row = wi * rows_per + k * ns + ch
        r.append(np.broadcast_to(obs_row, col.shape).ravel())
        c.append(col.ravel())
        d0 = wi * rows_per + (h + 1) * ns  # first defect row of each window
        # defect (k, c) = state[k+1, c] - F(state[k, :]) : depends on state[k+1, c] and all of state[k, :]
        kd = np.arange(h)[None, :, None]
        rows_d = d0 + kd * ns + ch  # (w, h, ns)
        r.append(rows_d.ravel())
        c.append((n + (wi * (h + 1) + kd + 1) * ns + ch).ravel())
        for j in range(ns):
            r.append(rows_d.ravel())
            c.append(np.broadcast_to(n + (wi * (h + 1) + kd) * ns + j, rows_d.shape).ravel())
        for i in range(n):
            r.append(rows_d.ravel())
            c.append(np.full(rows_d.size, i))
        r, c = np.concatenate(r), np.concatenate(c)
        return coo_matrix((np.ones(len(r), np.int8), (r, c)), shape=(w * rows_per, n + w * (h + 1) * ns)).tocsr()


@dataclass
class FitResult:
    theta: np.ndarray
    x: np.ndarray  # theta and the windows' states
    cost: float  # mean robust cost of the residuals
    window_cost: np.ndarray  # (W,) robust cost per window
    residuals: np.ndarray  # (W, rows) at the fit
    latency: int
    f_scale: float
    jac: object = None  # the loss-weighted sparse Jacobian at the fit


def robust(r: np.ndarray, f_scale: float) -> np.ndarray:
    """Soft-L1 cost of each normalized residual (what the fit minimises)."""
    return 2.0 * f_scale**2 * (np.sqrt(1.0 + (r / f_scale) ** 2) - 1.0)


def solve(
    problem: Problem, x0: np.ndarray, f_scale: float, max_nfev: int, bounds: tuple[np.ndarray, np.ndarray]
) -> FitResult:
    """scipy least_squares (trf, soft-L1, sparse finite differences) from x0."""
    n = problem.n
    lo = np.concatenate([bounds[0], np.full(len(x0) - n, -np.inf)])
    hi = np.concatenate([bounds[1], np.full(len(x0) - n, np.inf)])
    x_scale = np.concatenate([np.full(n, 0.1), np.ones(len(x0) - n)])
    from threadpoolctl import threadpool_limits

    # lsmr's many small vector products stall when BLAS threads spin against other work.
    with threadpool_limits(1, user_api="blas"):
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
    r = res.fun.reshape(problem.w, -1)
    per = robust(r, f_scale)
    return FitResult(res.x[:n], res.x, float(per.mean()), per.mean(axis=1), r, problem.latency, f_scale, res.jac)


def process_std(problem_at, theta: np.ndarray, action_std: float, floor: np.ndarray) -> np.ndarray:
    """Per state observation, the one-step spread the configured action noise causes on the twin at theta."""
    p = problem_at
    x = p.start(theta)
    s = p.states(x)
    start = p.twin.set_states(p.template, s[:, :-1].reshape(-1, p.ns))
    base = p.twin.predict(p.scales(theta), start, p.controls)[:, 0]
    bumped = p.twin.predict(p.scales(theta), start, p.controls + 0.05)[:, 0]
    gain = np.median(np.abs(bumped - base), axis=0) / 0.05
    return np.maximum(gain * action_std, floor)


def global_search(
    make_problem,
    latencies: list[int],
    lo: np.ndarray,
    hi: np.ndarray,
    bounds,
    f_scale: float,
    starts: int,
    max_nfev: int,
    seed: int = 0,
) -> list[FitResult]:
    """The best fit per latency, each from `starts` points spread over [lo, hi] (log scales) plus the centre.

    A Latin hypercube keeps starts apart in every parameter, so a fit trapped
    in one basin (or at a bound) is outvoted by one started elsewhere.
    """
    n = len(lo)
    points = [0.5 * (lo + hi)]
    if n and starts > 0:
        unit = qmc.LatinHypercube(n, seed=seed).random(starts)
        points += list(lo + unit * (hi - lo))
    best = []
    for lat in latencies:
        problem = make_problem(lat)
        fits = [solve(problem, problem.start(p), f_scale, max_nfev, bounds) for p in points]
        best.append(min(fits, key=lambda f: f.cost))
    return best


def assumption_shifts(make_problem, theta: np.ndarray, f_scale: float, nfev: int, bounds) -> np.ndarray:
    """(len(ASSUMPTIONS), n): how far the log-scales move when the fit's assumptions change.

    make_problem(process_factor) is the problem on the windows to use with its
    process spread scaled. The joint fit of states and scales is not a
    likelihood of the scales alone: along a direction the logs barely see
    (the pole's damping against its inertia under pushes and sensor noise), its
    optimum is set by how much the states may absorb (the process spread) and
    how pushes are discounted (the loss's knee), and the local curvature there
    can look sharp. Each variant is refitted from the same base fit; the
    shifts are what no sandwich shows, so each combination's interval carries
    them (identify.combinations).
    """
    base_p = make_problem(1.0)
    base = solve(base_p, base_p.start(theta), f_scale, nfev, bounds)
    shifts = []
    for process, knee in ASSUMPTIONS:
        p = base_p if process == 1.0 else make_problem(process)
        shifts.append(solve(p, base.x, f_scale * knee, nfev, bounds).theta - base.theta)
    return np.array(shifts).reshape(len(ASSUMPTIONS), len(theta))


def latency_confidence(best: FitResult, other: FitResult) -> float:
    """Probability that `best`'s latency beats `other`'s: a paired test over the same windows' errors."""
    d = other.window_cost - best.window_cost
    se = float(np.std(d, ddof=1)) / math.sqrt(len(d)) if len(d) > 1 else 0.0
    if se <= 0:
        return 1.0 if d.mean() > 0 else 0.5
    return float(norm.cdf(d.mean() / se))


def project_out(block: np.ndarray, js: np.ndarray) -> np.ndarray:
    """Per window, the part of `block` (W, rows, k) the window's own states cannot explain."""
    gram = np.einsum("wri,wrj->wij", js, js) + 1e-9 * np.eye(js.shape[2])
    return block - js @ np.linalg.solve(gram, np.einsum("wri,wrk->wik", js, block))


def sandwich(problem: Problem, fit: FitResult, cluster: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) of the cluster-robust sandwich covariance A^-1 B A^-1 of the log-scales.

    A: Gauss-Newton information (the windows' states marginalised, soft-L1
    weights); B: the spread of the per-cluster scores. Neighbouring windows
    share pushes and slow drifts that the plain J^T J would count as
    independent evidence; clusters of `cluster` consecutive windows carry it.
    """
    n, w = problem.n, problem.w
    rows = fit.residuals.shape[1]
    cols = (problem.h + 1) * problem.ns
    jac = fit.jac.tocsr()
    weight = (1.0 + (fit.residuals / fit.f_scale) ** 2) ** -0.25  # sqrt of soft-L1's rho'
    r_w = fit.residuals * weight
    a = np.zeros((n, n))
    score = np.zeros((w, n))
    for i in range(w):
        block = jac[i * rows : (i + 1) * rows]
        jt = block[:, :n].toarray()
        js = block[:, n + i * cols : n + (i + 1) * cols].toarray()
        free = project_out(jt[None], js[None])[0]
        a += free.T @ free
        score[i] = free.T @ r_w[i]
    groups = np.arange(w) // cluster
    g = np.stack([score[groups == k].sum(axis=0) for k in np.unique(groups)])
    b = g.T @ g * len(g) / max(len(g) - 1, 1)
    return a, b
