"""The assumption monitor's threshold, measured: how far the plants a config admits stray from the shield's model.

The monitor (`shield.monitor`) flags a window of W steps when, for some velocity,

    |sum e_t| > sum (hull half-width_t + per_speed |v_t| dt) + W accel dt + z sigma_W

(e_t: observed velocity minus the centre of what the shield's model predicted,
over its input-gain and latency cases). `accel` is what the model leaves out
and the envelope still admits: wind, pushes averaged over the window, the inner
loop's transients, linearization error. A bound written down from the
disturbances a config declares (the push's peak counted as if it lasted, plus a
slack) comes out so wide that plants just past the envelope's edge, the
dangerous ones, are never flagged.

Here it is measured instead: the shield runs (its monitor silenced) on plants
drawn from every randomization set (corners and uniform draws, each set's
latency, noise and pushes) under the legacy, random, bang-bang and adversarial
policies, and per run and velocity the largest acceleration the window needed
beyond the hull, the speed term and the noise term is recorded (zero where the
hull left room to spare: a run's slack is not a need). A sample's largest value
understates what longer or unluckier runs reach (two horizontal axes of one
symmetric plant measured a third apart), so the bound is the larger of that
largest value and the runs' mean plus TAIL_SIGMAS standard deviations of their
needs. The monitor's `accel` is that bound plus
MARGIN_SHARE of the velocity's full-action acceleration: the stated margin
between the worst plant expected inside the envelope and the first one flagged. A plant outside the envelope is flagged
once its unmodelled acceleration exceeds `accel` and the hull's half-width by the noise term over the
steps seen so far (about z sigma_t / (t dt)); for an input gain a fraction
eps past the hull's end that is eps |B (u + drift)| / dt.
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np

from pipeline.evaluation.adversary import reference_policy
from pipeline.progress import Progress

WINDOW = 50  # steps: long enough that a push's impulse, spread over it, stays well under a persistent fault
MARGIN_SHARE = 0.05  # of each velocity's full-action acceleration, added to the measured bound
TAIL_SIGMAS = 3.0  # the bound covers the runs' maxima to this many standard deviations above their mean
_POLICIES = ("legacy", "random", "bang_bang", "adversarial")
# Shielded runs per randomization set, half at corners, that measure a bundle's bounds: as the monitor's tests do
# (silent over 50,000 steps of the envelope's plants per task). `shield synthesize --monitor-runs` takes more.
RUNS_PER_SET = 8


def full_action_accel(spec) -> list[float]:
    """Per velocity, the acceleration the whole action box gives it in the nominal model (units/s^2), once an
    inner loop's lag (internal states) has settled: the largest one-step velocity change of a held action."""
    model = spec.linear_model()
    col = {o: j for j, o in enumerate(spec.state_index)}
    full = np.maximum(np.abs(spec.action_low), np.abs(spec.action_high))
    tau = float(spec.model.get("response_time_s", 0.0)) if model.internal_dim else 0.0
    steps = max(1, math.ceil(3.0 * tau / spec.dt))
    reach, best = np.zeros_like(model.B), np.zeros(len(spec.velocity_index))
    vel = [col[v] for v in spec.velocity_index]
    for _ in range(steps):  # reach: the state k steps after a unit step of each input, from rest
        before, reach = reach, model.A @ reach + model.B
        best = np.maximum(best, np.abs(reach[vel] - before[vel]) @ full / spec.dt)
    return best.tolist()


def window_excess(
    trace: list[list[tuple[float, float, float]]], sigma: list[list[float]], window: int, dt: float
) -> np.ndarray:
    """Per velocity, the largest acceleration (units/s^2) the monitor's window needed beyond its other terms.

    `trace`: per step, per velocity (e, hull half-width + per-speed allowance) x dt units; `sigma`: the monitor's
    noise term per window length (1..window) and velocity. Windows grow from one step, as the monitor's do.
    """
    if not trace:
        return np.zeros(len(sigma[0]))
    arr = np.asarray(trace, np.float64)  # (steps, velocities, 2)
    e, a = arr[:, :, 0], arr[:, :, 1]
    zeros = np.zeros((1, e.shape[1]))
    ce, ca = np.vstack([zeros, np.cumsum(e, 0)]), np.vstack([zeros, np.cumsum(a, 0)])
    steps = len(e)
    t = np.arange(1, steps + 1)
    count = np.minimum(t, window)
    se, sa = ce[t] - ce[t - count], ca[t] - ca[t - count]
    sig = np.asarray(sigma, np.float64)[count - 1]
    need = (np.abs(se) - sa - sig) / (count[:, None] * dt)
    return need.max(axis=0)


def window_dist_excess(
    dists: list[list[list[float]]],
    speeds: list[list[float]],
    noise: list[list[float]],
    per_speed: list[float],
    window: int,
    dt: float,
) -> np.ndarray:
    """Per velocity, the largest acceleration (units/s^2) the monitor's second test needed beyond its speed and
    noise terms, under the latency that explained the window best.

    `dists`: per step, per velocity, per latency the distance outside the gain cases' span (units/s); `speeds`: per
    step, per velocity |v|; `noise`: the test's noise term per window length and velocity (`shield.monitor`)."""
    if not dists:
        return np.zeros(len(noise[0]))
    d = np.asarray(dists, np.float64)  # (steps, velocities, latencies)
    v = np.asarray(speeds, np.float64)
    cd = np.concatenate([np.zeros((1,) + d.shape[1:]), np.cumsum(d, 0)])
    cv = np.vstack([np.zeros((1, v.shape[1])), np.cumsum(v, 0)])
    t = np.arange(1, len(d) + 1)
    count = np.minimum(t, window)
    sd = (cd[t] - cd[t - count]).min(axis=2)
    sv = cv[t] - cv[t - count]
    need = (sd - np.asarray(per_speed) * dt * sv - np.asarray(noise, np.float64)[count - 1]) / (count[:, None] * dt)
    return need.max(axis=0)


def measure(
    cfg,
    spec: dict,
    *,
    runs_per_set: int = RUNS_PER_SET,
    steps: int = 400,
    seed: int = 0,
    window: int = WINDOW,
    progress: bool = False,
) -> dict:
    """The monitor's bounds for `spec` over `cfg`'s envelope: {"accel", "accel_per_speed", "window", "measured"}.

    `measured`: per velocity the bound on the window excess (units/s^2) and the largest seen, the steps and runs
    they rest on.
    """
    import gymnasium as gym

    from envs.randomization import parse_randomization
    from pipeline.evaluation.falsify import parameters, pinned_domain
    from shield.cbf import CbfShield
    from shield.spec import ShieldSpec

    quiet = copy.deepcopy(spec)
    mon = quiet["assumptions"].setdefault("monitor", {})
    k = len(quiet["kinematics"]["velocity_index"])
    per_speed = [float(x) for x in mon.get("accel_per_speed", [0.0] * k)]
    # Silenced: the shield never turns conservative while measured.
    mon.update(accel=[1e9] * k, dist_accel=[1e9] * k, window=window)
    shield = CbfShield(quiet)
    monitor = shield._monitor
    if not monitor.enabled:
        raise ValueError("shield spec: assumptions.obs_noise_std: missing, so the monitor is off; nothing to measure")
    s = shield.spec
    rng = np.random.default_rng(seed)
    maxima, dist_maxima = [], []
    total = 0
    bar = Progress(runs_per_set * len(cfg.randomization), "run", desc="monitor bounds", enabled=progress)
    for name, rset in cfg.randomization.items():
        params = parameters(rset)
        for i in range(runs_per_set):
            # Half the runs at corners (the extreme plants), half drawn inside; every policy on both.
            x = rng.integers(0, 2, len(params)).astype(float) if i % 2 else rng.uniform(0, 1, len(params))
            domain = parse_randomization(pinned_domain(rset, x))
            policy = reference_policy(_POLICIES[(i // 2) % len(_POLICIES)], cfg, s, seed=int(rng.integers(2**31)))
            env = gym.make(cfg.task.env_id, randomization=domain, max_episode_steps=steps)
            obs, _ = env.reset(seed=int(rng.integers(2**31)))
            shield.reset()
            if hasattr(policy, "reset"):
                policy.reset()
            trace, dists, speeds = [], [], []
            for _ in range(steps):
                obs_list = np.asarray(obs, np.float64).tolist()
                res = monitor.residuals(obs_list)
                if res is not None:
                    trace.append(
                        [
                            (e, hw + b * abs(obs_list[o]) * s.dt)
                            for (e, hw), o, b in zip(res, s.velocity_index, per_speed)
                        ]
                    )
                    dists.append(monitor.distances(obs_list))
                    speeds.append([abs(obs_list[o]) for o in s.velocity_index])
                u, _ = shield.filter(obs, policy(np.asarray(obs, np.float32)[None])[0])
                obs, _, terminated, truncated, _ = env.step(u)
                if terminated or truncated:
                    break
            env.close()
            maxima.append(window_excess(trace, monitor._sigma, window, s.dt))
            dist_maxima.append(window_dist_excess(dists, speeds, monitor._dist_noise, per_speed, window, s.dt))
            total += len(trace)
            bar.update(1)
    bar.close()
    # A run whose windows never needed more than the hull, the speed term and the noise term needed nothing: its
    # slack (a negative excess, as wide as its hull) is no sample of how far the worst runs stray, and counted as
    # one its spread set a tail many times the largest excess any run showed, so far above it that a steady force
    # on an unactuated coordinate (a crane's swing) several times the envelope's was never flagged.
    bound, largest = _tail_bound(maxima)
    dist_bound, dist_largest = _tail_bound(dist_maxima)
    margin = [MARGIN_SHARE * a for a in full_action_accel(ShieldSpec.from_dict(spec))]
    return {
        "accel": [float(w + m) for w, m in zip(bound, margin)],
        "dist_accel": [float(w + m) for w, m in zip(dist_bound, margin)],
        "accel_per_speed": per_speed,
        **({"push_impulse": mon["push_impulse"]} if mon.get("push_impulse") else {}),
        "window": window,
        "measured": {
            "excess_accel": bound.tolist(),
            "largest_excess_accel": largest.tolist(),
            "dist_excess_accel": dist_bound.tolist(),
            "largest_dist_excess_accel": dist_largest.tolist(),
            "margin_accel": margin,
            "steps": total,
            "runs": len(maxima),
            "seed": seed,
        },
    }


def bundle_spec(cfg) -> dict:
    """The shield.json a bundle of `cfg` carries: `build_shield_spec(cfg)` with its monitor's bounds measured over
    the envelope (RUNS_PER_SET runs per set, seed 0), so the monitor on the edge flags plants just past the
    envelope's edge; kept in the synthesis cache (`pipeline.safety.cache`), so the next export, eval or night on an
    unchanged plant reads it back. As built where its monitor is off (no noise figures)."""
    from pipeline.safety.cache import cached
    from pipeline.safety.shield_spec import build_shield_spec

    spec = build_shield_spec(cfg)
    if not isinstance((spec.get("assumptions") or {}).get("obs_noise_std"), list):
        return spec
    out = copy.deepcopy(spec)
    out["assumptions"]["monitor"] = cached(
        "monitor",
        cfg,
        lambda: measure(cfg, spec, seed=0, progress=True),
        _same,
        _same,
        extra=json.dumps(spec, sort_keys=True),
    )
    return out


def with_measured_monitor(cfg, spec: dict, **kw) -> dict:
    """A copy of `spec` whose monitor bounds are measured over `cfg`'s envelope (`measure`)."""
    out = copy.deepcopy(spec)
    out["assumptions"]["monitor"] = measure(cfg, spec, **kw)
    return out


def _tail_bound(maxima: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(bound, largest) over the runs' per-velocity needs: the larger of the largest and the mean plus TAIL_SIGMAS
    standard deviations, a run that needed nothing counted as 0 (see `measure`)."""
    arr = np.maximum(np.array(maxima), 0.0)
    largest = arr.max(axis=0)
    return np.maximum(largest, arr.mean(axis=0) + TAIL_SIGMAS * arr.std(axis=0)), largest


def _same(value):
    """The cache's encoding of the bounds: JSON values already."""
    return value
