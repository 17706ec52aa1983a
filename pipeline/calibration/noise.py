"""Noise the logs show: observation noise with evidence, and the noise floor a right twin would leave.

Observation noise is estimated from one-step prediction residuals e_k: with
white measurement noise n and process noise w, e_k ~ n_{k+1} - J n_k + w_k (J the
twin's one-step response to its own state), so the lag-1 autocovariance of channel
c is -J_cc var(n_c). A damped velocity carries less than all of itself to the next
step (J_cc 0.83 for the cart-pole's cart), and reading the autocovariance as
-var(n) put its noise 8 % low. The estimate is noisy (pushes make w
correlated), so the configured std is kept unless the log's interval excludes
it; a channel never drops below what the log can vouch for, and never to 0 on
an estimate that merely fails to be positive. The estimate assumes residuals that
are white past one step (C(2) = C(3) = 0). Pushes lasting several steps make C(2)
positive and read a noise low (the cart-pole's 0.03 rad/s pole velocity as 0.022):
the interval's upper end is also read with C(2) taken as process, -(C(1) - C(2)) / J,
and the larger bounds a lowering. Where the residuals are not white (a lightly damped
mode the fitted twin misses leaves slowly decaying residuals, whose positive
lag-1 part reads as less noise: a flexible joint's 0.01 rad/s sensor read as
0.004), the log cannot vouch for a lower noise and the configured one is kept.

The noise floor: the same windows replayed through the fitted twin with the
configured action and observation noise, their states refitted like the fit's;
a fit whose residual stays well above that floor has dynamics the twin
lacks (a misfit).
"""

from __future__ import annotations

import math

import numpy as np

from pipeline.calibration.fit import Problem, cut_windows
from pipeline.calibration.logs import FieldLog
from pipeline.calibration.twin import Twin

BLOCKS = 20  # the log is cut in this many blocks for the estimate's standard error
# Chi-square (2 dof) of the residuals' lag-2 and lag-3 autocovariances over their standard errors above which they are
# not white past one step (5 % of white logs exceed it: they then only keep the configured noise).
WHITE_CHI2 = 5.99


def observation_noise(
    twin: Twin, log: FieldLog, scales: dict[str, float], latency: int, configured: np.ndarray
) -> list[dict]:
    """Per state observation: {estimate, interval (2 se), configured, used} std in the observation's units."""
    win = cut_windows(twin, log, horizon=1, stride=1, max_latency=latency)
    e = (twin.predict(scales, win.states, win.controls(latency)) - win.target)[:, 0, :]
    carried = _self_response(twin, scales, win, latency)
    (c1, se1), (c2, se2), (c3, se3) = (_lagged(e, win.starts, lag) for lag in (1, 2, 3))
    var, se = -c1 / carried, se1 / carried
    # Read with the lag-2 autocovariance taken as process (a push lasting steps): its upper end bounds a lowering.
    var_apart, se_apart = -(c1 - c2) / carried, np.hypot(se1, se2) / carried
    chi2 = (c2 / np.maximum(se2, 1e-300)) ** 2 + (c3 / np.maximum(se3, 1e-300)) ** 2
    out = []
    for c in range(len(var)):
        lo, hi = var[c] - 2 * se[c], max(var[c] + 2 * se[c], var_apart[c] + 2 * se_apart[c])
        used, why = noise_used(float(var[c]), float(lo), float(hi), float(configured[c]), white=chi2[c] <= WHITE_CHI2)
        out.append(
            {
                "estimate": math.sqrt(max(var[c], 0.0)),
                "interval": [math.sqrt(max(lo, 0.0)), math.sqrt(max(hi, 0.0))],
                "configured": float(configured[c]),
                "used": used,
                "why": why,
            }
        )
    return out


def _lagged(e: np.ndarray, starts: np.ndarray, lag: int) -> tuple[np.ndarray, np.ndarray]:
    """Per channel, the autocovariance of residuals `e` (one per window, windows starting at `starts`) at `lag`
    steps inside a run, and its standard error over BLOCKS blocks."""
    first = np.flatnonzero(starts[lag:] - starts[:-lag] == lag)
    centred = e - e.mean(axis=0)
    return _blocked(centred[first] * centred[first + lag])


def _blocked(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column, the mean of `x` (rows in log order) and its standard error from BLOCKS consecutive blocks: a
    stretch of the log that errs one way counts once, not once per row."""
    blocks = np.array([b.mean(axis=0) for b in np.array_split(x, BLOCKS)])
    return x.mean(axis=0), blocks.std(axis=0, ddof=1) / math.sqrt(BLOCKS)


def noise_used(var: float, lo: float, hi: float, configured: float, white: bool = True) -> tuple[float, str]:
    """(std the calibrated set carries, why) from the log's variance estimate `var`, its interval [lo, hi] and the
    configured std: the configured one unless the interval excludes it, and never zero for a configured noise.
    `white`: the residuals are white past one step; where they are not, the estimate reads low and never lowers
    the configured noise."""
    cfg_var = configured**2
    if lo <= cfg_var <= hi:
        return configured, "configured (inside the log's interval)"
    if hi < cfg_var and lo <= 0.0 < cfg_var:
        # An interval that reaches zero cannot tell this noise from none (a negative estimate: the twin's errors
        # there hide the noise), so it cannot vouch for any lower one either.
        return configured, "configured (the log's interval reaches 0: it cannot vouch for a lower noise)"
    if not white and hi < cfg_var:
        return configured, (
            "configured (the residuals stay correlated 2-3 steps on: dynamics the twin leaves there read as less "
            "noise, so the log cannot vouch for a lower one)"
        )
    if hi <= 0.0 < cfg_var:
        # A variance whose whole interval is not positive is no reading of noise (the twin misses the dynamics
        # there, e.g. a latency past the ones tried): taken as it is, it would set a configured noise to zero.
        return configured, "configured (the log's interval is not positive: no reading of noise)"
    if hi < cfg_var:
        return math.sqrt(hi), "lower than configured: the interval's upper end"
    return math.sqrt(var), "higher than configured: the log's estimate"


SELF_RESPONSE_WINDOWS = 200  # windows the twin's one-step response to its own state is averaged over


def _self_response(twin: Twin, scales: dict[str, float], win, latency: int) -> np.ndarray:
    """Per state observation c, d x_c(k+1) / d x_c(k) of the twin at `scales`, averaged over windows spread along
    the log (central differences); never below 0.05, where the channel carries almost nothing to the next step."""
    pick = np.linspace(0, len(win.starts) - 1, min(SELF_RESPONSE_WINDOWS, len(win.starts))).astype(int)
    first, controls = win.first[pick], win.controls(latency)[pick]
    out = np.empty(first.shape[1])
    for c in range(first.shape[1]):
        step = 1e-4 * max(float(np.std(win.first[:, c])), 1e-6)
        up, down = first.copy(), first.copy()
        up[:, c] += step
        down[:, c] -= step
        moved = [twin.predict(scales, twin.set_states(win.states[pick], s), controls)[:, 0, c] for s in (up, down)]
        out[c] = float(np.mean((moved[0] - moved[1]) / (2.0 * step)))
    return np.maximum(out, 0.05)


def residual_spread(fit_residuals: np.ndarray, problem: Problem, windows: np.ndarray | None = None) -> np.ndarray:
    """Per residual kind and channel (obs misfit, then defects): 1.4826 x median |r|; pushes do not move it.
    `windows`: a mask of the windows to read (default all)."""
    h, ns = problem.h, problem.ns
    r = fit_residuals if windows is None else fit_residuals[windows]
    obs = r[:, : (h + 1) * ns].reshape(len(r), h + 1, ns)
    defect = r[:, (h + 1) * ns :].reshape(len(r), h, ns)
    return np.concatenate(
        [1.4826 * np.median(np.abs(obs), axis=(0, 1)), 1.4826 * np.median(np.abs(defect), axis=(0, 1))]
    )


def defect_structure(
    problem: Problem, residuals: np.ndarray, x: np.ndarray, windows: np.ndarray | None = None
) -> np.ndarray:
    """Per state observation, the F statistic of its dynamics defects regressed on the state and the action.

    The action noise a right twin leaves in the defects does not depend on the
    state it acts on; a twin that misses part of the dynamics (a longer pole's
    slower swing, a drive's deadband or saturation, friction) leaves defects that
    follow the state or the action, linearly or not. Defects are clipped at
    3 (in units of their expected spread) so a push does not count as structure. `windows`: a mask of the windows
    to read (default all): two plants' defects, each following the state, can cancel in one regression.
    """
    pick = np.ones(problem.w, bool) if windows is None else windows
    s = problem.states(x)[pick, :-1].reshape(-1, problem.ns)
    u = problem.controls.reshape(problem.w, problem.h, -1)[pick].reshape(len(s), -1)
    d = np.clip(residuals[pick, (problem.h + 1) * problem.ns :].reshape(-1, problem.ns), -3.0, 3.0)
    z = s / problem.obs_std
    linear = np.column_stack([z, u, np.ones(len(s))])
    # Then, on top of the linear terms, the shapes an unmodelled drive or friction leaves: a step in the action's
    # sign (a deadband, Coulomb friction on the drive), its square with its sign (saturation), and a soft sign of
    # each state (friction on a velocity), as a partial F: in one regression with the linear terms they diluted a
    # longer pole's linear structure below the limit. helper-51's drive with a 0.1 deadband and a 0.3 saturation
    # left its velocity defects at F 3-17 on the linear terms alone.
    full = np.column_stack([linear, np.tanh(u / 0.05), u * np.abs(u), np.tanh(z / 3.0)])
    n = len(s)
    out = []
    for c in range(problem.ns):
        y = d[:, c]
        rss0 = float(np.sum((y - y.mean()) ** 2))
        rss_linear, rss_full = (
            float(np.sum((y - a @ np.linalg.lstsq(a, y, rcond=None)[0]) ** 2)) for a in (linear, full)
        )
        k_linear, k_full = linear.shape[1] - 1, full.shape[1] - 1
        f_linear = ((rss0 - rss_linear) / k_linear) / max(rss_linear / (n - k_linear - 1), 1e-300)
        f_shapes = ((rss_linear - rss_full) / (k_full - k_linear)) / max(rss_full / (n - k_full - 1), 1e-300)
        out.append(max(f_linear, f_shapes))
    return np.array(out)


def residual_means(problem: Problem, residuals: np.ndarray) -> np.ndarray:
    """Per residual kind and channel (obs misfit, then defects): (mean, its standard error) over the windows, in
    units of the residual's expected spread; the error from blocks of windows (_blocked), so a push counts once.
    Shape (2, 2, ns): kind, (mean, se)."""
    h, ns, w = problem.h, problem.ns, problem.w
    per_window = [
        residuals[:, : (h + 1) * ns].reshape(w, h + 1, ns).mean(axis=1),
        residuals[:, (h + 1) * ns :].reshape(w, h, ns).mean(axis=1),
    ]
    out = np.empty((2, 2, ns))
    for k, per in enumerate(per_window):
        out[k] = _blocked(per)
    return out
