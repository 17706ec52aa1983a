"""Noise the logs show: observation noise with evidence, and the noise floor a right twin would leave.

Observation noise is estimated from one-step prediction residuals e_k: with
white measurement noise n and process noise w, e_k ~ n_{k+1} - J n_k + w_k (J the
twin's one-step response to its own state), so the lag-1 autocovariance of channel
c is -J_cc var(n_c). A damped velocity carries less than all of itself to the next
step (J_cc 0.83 for the cart-pole's cart), and reading the autocovariance as
-var(n) put its noise 8 % low. The estimate is noisy (pushes make w
correlated), so the configured std is kept unless the log's interval excludes
it; a channel never drops below what the log can vouch for, and never to 0 on
an estimate that merely fails to be positive.

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


def observation_noise(
    twin: Twin, log: FieldLog, scales: dict[str, float], latency: int, configured: np.ndarray
) -> list[dict]:
    """Per state observation: {estimate, interval (2 se), configured, used} std in the observation's units."""
    win = cut_windows(twin, log, horizon=1, stride=1, max_latency=latency)
    e = (twin.predict(scales, win.states, win.controls(latency)) - win.target)[:, 0, :]
    consecutive = np.flatnonzero(np.diff(win.starts) == 1)
    carried = _self_response(twin, scales, win, latency)
    prod = (e[consecutive] - e.mean(0)) * (e[consecutive + 1] - e.mean(0)) / carried
    var = -prod.mean(axis=0)
    blocks = np.array([b.mean(axis=0) for b in np.array_split(prod, BLOCKS)])
    se = blocks.std(axis=0, ddof=1) / math.sqrt(BLOCKS)
    out = []
    for c in range(len(var)):
        lo, hi = var[c] - 2 * se[c], var[c] + 2 * se[c]
        used, why = noise_used(float(var[c]), float(lo), float(hi), float(configured[c]))
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


def noise_used(var: float, lo: float, hi: float, configured: float) -> tuple[float, str]:
    """(std the calibrated set carries, why) from the log's variance estimate `var`, its interval [lo, hi] and the
    configured std: the configured one unless the interval excludes it, and never zero for a configured noise."""
    cfg_var = configured**2
    if lo <= cfg_var <= hi:
        return configured, "configured (inside the log's interval)"
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


def residual_spread(fit_residuals: np.ndarray, problem: Problem) -> np.ndarray:
    """Per residual kind and channel (obs misfit, then defects): 1.4826 x median |r|; pushes do not move it."""
    w, h, ns = problem.w, problem.h, problem.ns
    obs = fit_residuals[:, : (h + 1) * ns].reshape(w, h + 1, ns)
    defect = fit_residuals[:, (h + 1) * ns :].reshape(w, h, ns)
    return np.concatenate(
        [1.4826 * np.median(np.abs(obs), axis=(0, 1)), 1.4826 * np.median(np.abs(defect), axis=(0, 1))]
    )


def defect_structure(problem: Problem, residuals: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Per state observation, the F statistic of its dynamics defects regressed on the state and the action.

    The action noise a right twin leaves in the defects does not depend on the
    state it acts on; a twin that misses part of the dynamics (a longer pole's
    slower swing) leaves defects that follow the state. Defects are clipped at
    3 (in units of their expected spread) so a push does not count as structure.
    """
    s = problem.states(x)[:, :-1].reshape(-1, problem.ns)
    u = problem.controls.reshape(len(s), -1)
    d = np.clip(residuals[:, (problem.h + 1) * problem.ns :].reshape(-1, problem.ns), -3.0, 3.0)
    design = np.column_stack([s / problem.obs_std, u, np.ones(len(s))])
    k, n = design.shape[1] - 1, len(s)
    out = []
    for c in range(problem.ns):
        y = d[:, c]
        beta = np.linalg.lstsq(design, y, rcond=None)[0]
        rss1, rss0 = float(np.sum((y - design @ beta) ** 2)), float(np.sum((y - y.mean()) ** 2))
        out.append(((rss0 - rss1) / k) / max(rss1 / (n - k - 1), 1e-300))
    return np.array(out)
