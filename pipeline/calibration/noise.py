"""Noise the logs show: observation noise with evidence, and the noise floor a right twin would leave.

Observation noise is estimated from one-step prediction residuals e_k: with
white measurement noise n and process noise w, e_k ~ n_{k+1} - n_k + w_k, so the
lag-1 autocovariance of e is -var(n). The estimate is noisy (pushes make w
correlated), so the configured std is kept unless the log's interval excludes
it; a channel never drops below what the log can vouch for, and never to 0 on
an estimate that merely fails to be positive.

The noise floor: the same windows replayed through the fitted twin with the
configured action and observation noise, their initial states refitted like the
fit's; a fit whose residual stays well above that floor has dynamics the twin
lacks (a misfit).
"""

from __future__ import annotations

import math

import numpy as np

from pipeline.calibration.fit import Problem, cut_windows, project_out, state_jacobian
from pipeline.calibration.logs import FieldLog
from pipeline.calibration.twin import Twin

BLOCKS = 20  # the log is cut in this many blocks for the estimate's standard error


def observation_noise(twin: Twin, log: FieldLog, scales: dict[str, float], latency: int,
                      configured: np.ndarray) -> list[dict]:
    """Per state observation: {estimate, interval (2 se), configured, used} std in the observation's units."""
    win = cut_windows(twin, log, horizon=1, stride=1, max_latency=latency)
    e = (twin.predict(scales, win.states, win.controls(latency)) - win.target)[:, 0, :]
    consecutive = np.flatnonzero(np.diff(win.starts) == 1)
    prod = (e[consecutive] - e.mean(0)) * (e[consecutive + 1] - e.mean(0))
    var = -prod.mean(axis=0)
    blocks = np.array([b.mean(axis=0) for b in np.array_split(prod, BLOCKS)])
    se = blocks.std(axis=0, ddof=1) / math.sqrt(BLOCKS)
    out = []
    for c in range(len(var)):
        cfg_var = float(configured[c]) ** 2
        lo, hi = var[c] - 2 * se[c], var[c] + 2 * se[c]
        if lo <= cfg_var <= hi:
            used, why = float(configured[c]), "configured (inside the log's interval)"
        elif hi < cfg_var:
            used, why = math.sqrt(max(hi, 0.0)), "lower than configured: the interval's upper end"
        else:
            used, why = math.sqrt(var[c]), "higher than configured: the log's estimate"
        out.append({"estimate": math.sqrt(max(var[c], 0.0)),
                    "interval": [math.sqrt(max(lo, 0.0)), math.sqrt(max(hi, 0.0))],
                    "configured": float(configured[c]), "used": used, "why": why})
    return out


def robust_rms(r: np.ndarray) -> np.ndarray:
    """Per channel (last axis), 1.4826 x median |r| over windows and steps 1..H: pushes do not move it."""
    return 1.4826 * np.median(np.abs(r[:, 1:]), axis=(0, 1))


def noise_floor(problem: Problem, x: np.ndarray, obs_std: np.ndarray, action_std: float, seed: int = 0,
                draws: int = 3) -> np.ndarray:
    """Per channel: the robust residual RMS (scale units) the fit would leave if the twin at x were the plant."""
    rng = np.random.default_rng(seed)
    theta, s0 = x[:problem.n], problem.states(x)
    base = problem.predict(theta, s0)
    js = state_jacobian(problem, x)
    shape = base.shape
    out = []
    for _ in range(draws):
        controls = problem.controls + rng.normal(0.0, action_std, problem.controls.shape)
        delta = problem.predict(theta, s0, controls) - base + rng.normal(0.0, 1.0, shape) * obs_std
        r = (delta / problem.scale).reshape(shape[0], -1, 1)
        r = project_out(r, js)[..., 0].reshape(shape)
        out.append(robust_rms(r))
    return np.median(np.array(out), axis=0)
