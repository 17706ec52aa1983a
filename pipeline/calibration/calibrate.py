"""Calibrate a task config's randomized physical parameters to field logs: the `calibrated` set.

`calibrate(cfg, logs)` returns a JSON-ready dict: the identifiable combinations
of log-scales with their 90 % intervals and the flat directions the logs cannot
see; per parameter the best fit (a single parameter gets an interval only when
the logs pin it alone) and the calibrated range (narrowed only along what the
logs saw, the configured range kept along the rest, its distribution kept); the
latency found with its confidence; observation noise with its evidence; the
verdict (`misfit`: the residual stays above the noise floor a right twin would
leave; `outside`: no plant inside the config's ranges fits); the prediction
error before (the nominal twin, no latency) and after; and `calibrated`, a
RandomizationSet dict. `summary_lines(result)` is its human summary (the CLI
and the flow's artifact); `write_calibrated_yaml` writes the calibrated set as
a `--domains` file. With an adaptive policy's bundle, `policy_estimate` sets the plant
that policy believes in, on the same logs, beside the fit (policy_estimate.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import yaml
from scipy.stats import norm

from pipeline.calibration.fit import (
    BOUND_WIDEN,
    Problem,
    Windows,
    assumption_shifts,
    cut_windows,
    global_search,
    latency_confidence,
    process_std,
    sandwich,
    solve,
)
from pipeline.calibration.identify import (
    INTERVAL,
    OUTSIDE_INTERVAL,
    combinations,
    consistent_ranges,
    covariance,
    pinned,
)
from pipeline.calibration.logs import (
    OBS_UNITS,
    QUIET_SPREAD,
    CalibrationError,
    FieldLog,
    load_field_log,
    quiet_channels,
)
from pipeline.calibration.noise import BLOCKS, defect_structure, observation_noise, residual_means, residual_spread
from pipeline.calibration.sets import calibrated_set, configured_ranges, kept_from, obs_noise_vector
from pipeline.calibration.twin import Twin, task_facts

GLOBAL_STARTS = 3  # starts per latency besides the ranges' centre (a Sobol design over the ranges)
GLOBAL_NFEV, LOCAL_NFEV = 6, 20  # least-squares evaluations per start in the global stage, in the local one
MISFIT_RATIO = 1.5  # a residual this many times the noise floor (any channel) is more than noise
# F statistic of a velocity's defects on the state and action above which the twin misses dynamics.
# Empirical, not a p-value: the smoother leaves some structure in a right twin's defects too (F up to
# a few tens); bench/bench_calibration.py reports how often an inside plant is flagged.
STRUCTURE_F = 40.0
# A constant the twin lacks (a sensor's zero, a steady force) leaves errors of one sign that neither the spread nor
# the structure test reads (the regression has an intercept, and a 0.3-spread mean adds 4 % to the spread): an
# average this many standard errors from 0 (Student's t over BLOCKS blocks: 8e-5 two-sided per channel on a right
# twin) and this large a share of the residual's expected spread. A cart-pole's pole angle read 0.03 rad off left
# its rate's one-step errors at -0.28 (t -5.5), 0.05 rad at -0.55 (t -10.7); the right twin's largest was t 2.0.
OFFSET_T = 5.0
OFFSET_SIZE = 0.15
# The kept ranges bound the calibrated set when they hold a plant at the centre of every identified band (this
# coverage: 0, the fit's estimate itself). A plant on their edge does half the time; otherwise the hull's set,
# which holds the kept one's, takes over: a wider set, where a narrower one could leave the plant out.
KEPT_CORE = 0.0
F_SCALE = 3.0  # soft-L1 knee, in units of a residual's expected spread


def _longest_latency(cfg) -> int:
    """The longest latency, in control steps, any randomization set allows (0 where none randomizes it)."""
    return max((r.latency_steps.high for r in cfg.randomization.values() if r.latency_steps is not None), default=0)


def _latency_candidates(cfg) -> list[int]:
    return list(range(0, _longest_latency(cfg) + 2))  # one step past the configured worst case


def latency_outside(cfg, latency: int, confidence: float) -> str | None:
    """The verdict line for a latency longer than every set's `latency_steps` allows, identified at OUTSIDE_INTERVAL
    confidence or more over the runner-up (None otherwise): the shield predicts through the sets' latencies only,
    and a policy trained on them never met it, so such a plant is outside whatever its parameters."""
    most = _longest_latency(cfg)
    if latency <= most or confidence < OUTSIDE_INTERVAL:
        return None
    return (
        f"outside: the plant's latency is {latency} control steps (confidence {confidence:.3f}), longer than any "
        f"set's latency_steps allows (at most {most}); train and the shield were not made for it: widen "
        f"latency_steps in every set (and shield.latency_steps where the config sets it) to {latency} and rerun"
    )


def latency_undecided(cfg, latency: int, runner_up: int | None, confidence: float) -> str | None:
    """The verdict line for a best-fitting latency past every set's `latency_steps` that the runner-up cannot be
    ruled out against (confidence below OUTSIDE_INTERVAL: not called outside). A latency that varies from step to
    step between the two reads so. The calibrated set then carries both (`calibrated_set`), and a set reaching past
    the sets' latencies is one neither train nor the shield was made for: said, not written silently."""
    most = _longest_latency(cfg)
    if latency <= most or confidence >= OUTSIDE_INTERVAL or runner_up is None:
        return None
    low, high = min(latency, runner_up), max(latency, runner_up)
    return (
        f"latency?: the logs favour {latency} control steps over {runner_up} (confidence {confidence:.3f}, short "
        f"of the {OUTSIDE_INTERVAL:.0%} that calls a plant outside); a latency varying between the two reads so. "
        f"The calibrated set carries {low}..{high}, past every set's latency_steps (at most {most}): widen "
        f"latency_steps in every set (and shield.latency_steps where set) to {high} before training on it, or "
        f"record a longer log to decide"
    )


def _prediction_error(problem: Problem, x) -> dict:
    """Open-loop error from the first states in x over each window (steps 1..H): physical and in obs-noise units."""
    physical = (problem.simulate(x) - problem.measured)[:, 1:]
    r = physical / problem.obs_std
    return {
        "rms_normalized": float(np.sqrt(np.mean(r**2))),
        "rms_per_state_obs": [float(v) for v in np.sqrt(np.mean(physical**2, axis=(0, 1)))],
        "final_step_rms_per_state_obs": [float(v) for v in np.sqrt(np.mean(physical[:, -1] ** 2, axis=0))],
    }


def _ranges(combos, names, kept_lo, kept_hi, hull_lo, hull_hi, bounds) -> tuple[np.ndarray, str]:
    """Log-scale calibrated ranges and where they lie: `inside` the kept ranges, the `hull`, or `outside` both.

    The kept ranges (`reality`'s) are a belief about the plant, the hull (every set) is the envelope training and the
    shield cover. The kept ranges bound the calibrated set only where they hold a plant that moves as the fit's
    estimate does (KEPT_CORE): a plant just past them (an outside user's cart at 0.8x, `reality` from 0.9x, `train`
    from 0.75x) leaves them only the bands' tails, and the set cut down to those tails (a cart at 0.900..0.915)
    held no plant that moves like it. The hull's consistent set then holds it."""
    if consistent_ranges(combos, names, kept_lo, kept_hi, KEPT_CORE) is not None:
        r = consistent_ranges(combos, names, kept_lo, kept_hi)
        if r is not None:
            return r, "inside"
    r = consistent_ranges(combos, names, hull_lo, hull_hi)
    if r is not None:
        return r, "hull"
    r = consistent_ranges(combos, names, hull_lo, hull_hi, OUTSIDE_INTERVAL)
    if r is not None:
        return r, "hull"
    r = consistent_ranges(combos, names, *bounds)
    return (r if r is not None else np.stack(bounds, axis=1)), "outside"


def _runs_past(
    ranges: dict[str, tuple[float, float]], reference: dict[str, tuple[float, float]]
) -> list[tuple[str, float, float, float, float, bool]]:
    """Each parameter whose range runs past its reference range, by name: (name, lo, hi, ref_lo, ref_hi, disjoint)."""
    out = []
    for name, (a, b) in sorted(ranges.items()):
        if name not in reference:
            continue
        lo, hi = reference[name]
        if a < lo * (1 - 1e-9) or b > hi * (1 + 1e-9):
            out.append((name, a, b, lo, hi, b < lo or a > hi))
    return out


def _past_hull(hull: dict[str, tuple[float, float]], ranges: dict[str, tuple[float, float]]) -> list[str]:
    """An outside verdict's parameters: those whose calibrated range lies past every set's, then those reaching
    past it (an outside user's stiffness at 1.6x against 0.7..1.3 was in no line of the verdict)."""
    runs = _runs_past(ranges, hull)
    past = [f"{n}: the logs allow {a:.3g}..{b:.3g}, every set spans {lo:g}..{hi:g}" for n, a, b, lo, hi, d in runs if d]
    reaching = [f"{n} reaches {a:.3g}..{b:.3g} (every set: {lo:g}..{hi:g})" for n, a, b, lo, hi, d in runs if not d]
    return past + reaching


def _shield_floor(cfg, ranges: dict[str, tuple[float, float]]) -> list[str]:
    """Parameters whose every consistent value lies beyond the shield's stated model_ranges."""
    out = []
    for name, (lo, hi) in sorted((cfg.shield.model_ranges or {}).items()):
        if name in ranges:
            a, b = ranges[name]
            if b < lo or a > hi:
                out.append(f"{name}: the logs allow {a:.3g}..{b:.3g}, the shield is stated for {lo:g}..{hi:g}")
    return out


@dataclass
class FitSetup:
    """What every fit of one log shares: the twin, the validated log, the unknowns, windows and noise scales."""

    twin: Twin
    log: FieldLog
    names: list[str]  # the scales fitted (randomized, not known), sorted
    known: dict[str, float]
    hull: dict[str, tuple[float, float]]
    kept: dict[str, tuple[float, float]]
    latencies: list[int]
    windows: Windows
    reality: object  # the RandomizationSet whose noise the log is expected to carry
    obs_noise: list[float]  # configured obs noise std of every observation (sets.obs_noise_vector)
    obs_std: np.ndarray  # configured obs noise std of the state observations
    obs_scale: np.ndarray  # obs_std floored where a channel is noise-free
    process: np.ndarray  # per state observation, the one-step spread the action noise causes
    quiet: list[str] = field(default_factory=list)  # the state observations the log barely moves (quiet_channels)
    kept_sets: dict[str, str] = field(default_factory=dict)  # the set each kept range comes from (sets.kept_from)

    def log_range(self, ranges: dict[str, tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi) log-scales of `ranges` in `names` order."""
        return tuple(np.log([ranges[n][i] for n in self.names]).reshape(-1) for i in (0, 1))  # type: ignore[return-value]

    @property
    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """The fit's box: the configured hull widened by BOUND_WIDEN each way (log scales)."""
        lo, hi = self.log_range(self.hull)
        return lo - math.log(BOUND_WIDEN), hi + math.log(BOUND_WIDEN)

    def problem(self, latency: int, windows: Windows | None = None, process_factor: float = 1.0) -> Problem:
        """The multiple-shooting problem at `latency` over `windows` (default: all of them).

        process_factor scales the process spread (the fit's assumption varied by assumption_shifts).
        """
        win = self.windows if windows is None else windows
        return Problem(self.twin, win, latency, self.names, self.known, self.obs_scale, self.process * process_factor)

    def search_windows(self, windows: Windows | None = None) -> Windows:
        """A third of `windows` (default: the log's): the global stage's, the assumption shifts' and the column
        hints' (fits there are 3x cheaper)."""
        windows = self.windows if windows is None else windows
        return windows.subset(np.arange(len(windows.starts)) % 3 == 0)

    def assumption_shifts(self, latency: int, theta: np.ndarray, nfev: int) -> np.ndarray:
        """fit.assumption_shifts on the search windows at `latency`, from `theta`."""
        search = self.search_windows()
        return assumption_shifts(lambda f: self.problem(latency, search, f), theta, F_SCALE, nfev, self.bounds)


DERIVED_SCALE = 1.25  # a site or sensor column this many times (or this fraction of) what the joints put it at
DERIVED_SIGNAL = 10.0  # checked where the joints move it this many times its configured noise std


def _check_derived(twin: Twin, log: FieldLog, noise: list[float], cfg, logs) -> None:
    """Refuse a site or sensor column in other units or in another column's place (CalibrationError).

    The fit predicts the joints only, so such a column was never read: an outside user's tip angle (a tendon
    sensor, theta + alpha) logged in degrees passed as "down to the noise floor", though it is the column the
    reward tracks. Where the logged joints are the whole state it depends on, the nominal MJCF computes it from
    them; the log's column must follow that at the same scale (a regression with an offset: a sensor's zero may
    differ)."""
    rows = log.obs[:: max(1, len(log.obs) // 2000)]
    names = cfg.observation_names(list(range(log.obs.shape[1])))
    for o, computed in twin.derived_observations(rows).items():
        logged = rows[:, o]
        spread = float(np.std(computed))
        if not spread > DERIVED_SIGNAL * max(noise[o], 1e-9):
            continue
        c = computed - computed.mean()
        scale = float(c @ (logged - logged.mean()) / (c @ c))
        corr = float(np.corrcoef(computed, logged)[0, 1]) if np.std(logged) > 0 else 0.0
        what = f"{names[o]} (obs[{o}])"
        if corr < 0.9:
            raise CalibrationError(
                f"--from-log {logs}: {what} does not follow what the MJCF computes from the logged joints "
                f"(correlation {corr:.2f} over the log): another sensor's column, or columns in another order than "
                f"plant.observations declares? Fix the columns, not the config"
            )
        if not 1.0 / DERIVED_SCALE <= scale <= DERIVED_SCALE:
            raise CalibrationError(
                f"--from-log {logs}: {what} reads {scale:.3g}x what the MJCF computes from the logged joints "
                f"(correlation {corr:.3f}): in other units (degrees for rad: 57.3x; mm for m: 1000x)? {OBS_UNITS}. "
                "Convert the column, not the config"
            )


def fit_setup(cfg, logs, *, quiet_ok: bool = False) -> FitSetup:
    """Read and validate the logs at `logs` for `cfg`'s task and prepare the fit (CalibrationError on bad input)."""

    known, horizon, min_seconds = cfg.calibration.known, cfg.calibration.horizon_steps, cfg.calibration.min_log_seconds
    task = task_facts(cfg.task.env_id)
    twin = Twin(cfg.task.env_id)
    hull = configured_ranges(cfg)
    known = dict(known or {})
    unknown_known = sorted(set(known) - set(hull))
    if unknown_known:
        raise CalibrationError(
            f"calibration.known: {unknown_known} not randomized by the config; randomized parameters: {sorted(hull)}"
        )
    log = load_field_log(
        logs,
        task=cfg.task.name,
        obs_dim=task["obs_dim"],
        act_dim=task["act_dim"],
        dt=task["control_period_s"],
        min_seconds=min_seconds,
        action_box=twin.action_box(),
        position_limits=twin.position_limits(),
        names=cfg.observation_names(list(range(task["obs_dim"]))),
        velocity_pairs=twin.velocity_pairs(),
        angles=twin.unlimited_angles(),
    )
    reality = cfg.randomization.get("reality") or cfg.randomization["train"]
    obs_noise = obs_noise_vector(reality.obs_noise_std, task["obs_dim"])
    _check_derived(twin, log, obs_noise, cfg, logs)
    obs_std = np.array(obs_noise)[twin.state_obs]
    quiet = quiet_channels(log.obs[:, twin.state_obs], obs_std, cfg.observation_names(twin.state_obs))
    if quiet and not quiet_ok:
        raise CalibrationError(
            f"--from-log {logs}: the log barely moves the plant beyond its sensor noise ({'; '.join(quiet)}; "
            f"calibration needs {QUIET_SPREAD:g}x): the fit would take noise for dynamics, with intervals that "
            f"miss the plant and a false misfit. Record it with excitation: `sim2real calibrate --plan --from-log "
            f"{logs}` designs one from this log; where the log already follows a plan, raise its --amplitude (the "
            f"plan predicts each channel's spread with the config's legacy controller, not yours)"
        )
    names = [n for n in sorted(hull) if n not in known]
    kept = {n: kept_from(cfg, n) for n in names}
    latencies = _latency_candidates(cfg)
    windows = cut_windows(twin, log, horizon, horizon + 1, max(latencies))
    action_std = float(np.max(reality.action_noise_std))
    # A noise-free channel's spread is floored at 0.1 % of its typical change over a window.
    change = np.std(windows.target[:, -1] - windows.first, axis=0)
    obs_scale = np.maximum(obs_std, 1e-3 * change + 1e-12)
    setup = FitSetup(
        twin,
        log,
        names,
        known,
        hull,
        {n: r for n, (_, r) in kept.items()},
        latencies,
        windows,
        reality,
        obs_noise,
        obs_std,
        obs_scale,
        obs_scale,
        quiet,
        {n: s for n, (s, _) in kept.items()},
    )
    hull_lo, hull_hi = setup.log_range(hull)
    centre = 0.5 * (hull_lo + hull_hi)
    setup.process = process_std(setup.problem(0), centre, action_std, 0.05 * obs_scale)
    return setup


def calibrate(cfg, logs, bundle=None, *, quiet_ok: bool = False) -> dict:
    """Fit the twin to shadow logs at `logs` (file or directory) per `cfg.calibration`; see the module docstring.
    `bundle`: an adaptive policy's bundle whose plant estimate on the same logs is set beside the fit
    (`policy_estimate`, pipeline/calibration/policy_estimate.py). `quiet_ok`: fit a log that barely moves the
    plant instead of refusing it (the plan reads what such a log leaves unpinned)."""

    t0 = time.perf_counter()
    setup = fit_setup(cfg, logs, quiet_ok=quiet_ok)
    task = task_facts(cfg.task.env_id)
    twin, log, names, known, hull, kept = setup.twin, setup.log, setup.names, setup.known, setup.hull, setup.kept
    windows, latencies, reality, obs_std, bounds = (
        setup.windows,
        setup.latencies,
        setup.reality,
        setup.obs_std,
        setup.bounds,
    )
    hull_lo, hull_hi = setup.log_range(hull)
    kept_lo, kept_hi = setup.log_range(kept)
    problem = setup.problem

    # Global stage on a third of the windows: every latency, several starts.
    search = setup.search_windows()
    coarse = global_search(
        lambda lat: problem(lat, search), latencies, hull_lo, hull_hi, bounds, F_SCALE, GLOBAL_STARTS, GLOBAL_NFEV
    )
    # Latencies are ranked on converged fits: after a few evaluations the wrong latency's cost can still be half
    # the right one's. The local stage refines the converged points.
    converged = sorted(
        (solve(problem(c.latency, search), c.x, F_SCALE, LOCAL_NFEV, bounds) for c in coarse), key=lambda f: f.cost
    )
    # Local stage on every window: the best, and the runner-up latency for the latency's confidence.
    refined = []
    for c in converged[:2]:
        p = problem(c.latency)
        refined.append(solve(p, p.start(c.theta), F_SCALE, LOCAL_NFEV, bounds))
    refined.sort(key=lambda f: f.cost)
    best, runner_up = refined[0], refined[1] if len(refined) > 1 else None
    latency = best.latency
    final = problem(latency)
    a, b = sandwich(final, best)
    shifts = setup.assumption_shifts(latency, best.theta, LOCAL_NFEV)
    combos = combinations(a, b, best.theta, names, hull_lo, hull_hi, shifts)
    cov = covariance(a, b, combos, names)
    sampling_cov = covariance(a, b, combos, names, systematic=False)
    alone = pinned(combos, names)
    log_ranges, where = _ranges(combos, names, kept_lo, kept_hi, hull_lo, hull_hi, bounds)

    scales = {**known, **{n: float(math.exp(t)) for n, t in zip(names, best.theta)}}
    noise = observation_noise(twin, log, scales, latency, obs_std)
    # The residuals are in units of the configured noise (obs misfits: obs noise; defects: the
    # action noise's one-step effect), and smoothing only shrinks them: a right twin leaves at most 1.
    velocities = [i for i, o in enumerate(twin.state_obs) if twin.obs_to_state[o][0] == "qvel"]
    ratio, structure, misfit_spread, misfit_structure = _misfit(final, best, velocities)
    apart = _recordings_apart(log, windows, final, best, velocities)
    misfit = misfit_spread or misfit_structure or bool(apart)

    z = float(norm.ppf(0.5 + INTERVAL / 2))
    parameters = {}
    for i, name in enumerate(names):
        lo, hi = (float(math.exp(v)) for v in log_ranges[i])
        entry = {
            "nominal": 1.0,
            "configured": list(hull[name]),
            "identified": scales[name],
            "identified_ok": alone[i],
            "range": [lo, hi],
            "kept": list(kept[name]),
            "kept_from": setup.kept_sets[name],
        }
        if alone[i]:
            sd = math.sqrt(max(cov[i, i], 0.0))
            entry["interval"] = [scales[name] * math.exp(-z * sd), scales[name] * math.exp(z * sd)]
            entry["log_std_sampling"] = math.sqrt(max(sampling_cov[i, i], 0.0))  # what more excitation shrinks
        parameters[name] = entry
    for name, value in known.items():
        parameters[name] = {
            "nominal": 1.0,
            "configured": list(hull[name]),
            "identified": float(value),
            "identified_ok": True,
            "known": True,
            "range": [float(value), float(value)],
        }
    ranges = {n: tuple(p["range"]) for n, p in parameters.items()}
    shield_beyond = _shield_floor(cfg, ranges) if where == "outside" else []

    obs_noise = list(setup.obs_noise)
    for o, c in zip(twin.state_obs, noise):
        obs_noise[o] = float(c["used"])
    verdict = []
    named = [f"{n} (obs[{o}])" for n, o in zip(cfg.observation_names(twin.state_obs), twin.state_obs)]
    if misfit_spread:
        worst = int(np.argmax(ratio))
        verdict.append(
            f"misfit: the calibrated twin leaves {ratio[worst]:.1f}x the noise floor on observation "
            f"{named[worst]} (above {MISFIT_RATIO}x): the plant has dynamics the twin does not "
            f"model (a changed geometry, friction, a sensor), or more noise than configured"
        )
    if misfit_structure:
        worst = _most_shaped(structure, velocities)
        verdict.append(
            f"misfit: the calibrated twin's errors on observation {named[worst]} follow the "
            f"state or the action (F = {structure[worst]:.0f}, above {STRUCTURE_F:.0f}): the plant has dynamics "
            f"the twin does not model (a changed geometry, a drive's deadband or saturation, friction, a sensor)"
        )
    verdict += apart
    offset_lines, offset = _offsets(final, best, named, velocities)
    verdict += offset_lines
    confidence = latency_confidence(best, runner_up) if runner_up else 1.0
    late = latency_outside(cfg, latency, confidence)
    if late:
        verdict.append(late)
    elif undecided := latency_undecided(cfg, latency, runner_up.latency if runner_up else None, confidence):
        verdict.append(undecided)
    if where == "outside":
        named = _past_hull(hull, ranges) + shield_beyond
        verdict.append(
            "outside: no plant inside the config's randomization ranges fits the logs "
            f"(not even at the {OUTSIDE_INTERVAL:.0%} band); train and the shield were not made for it"
            + ("; " + "; ".join(named) if named else "")
        )
    if verdict:
        # A reversed sign explains every other line (a misfit, a latency fitted past the configured): it comes first.
        names_all = cfg.observation_names(list(range(task["obs_dim"])))
        verdict = action_sign_hints(setup, action_names(cfg)) + observation_hints(setup, names_all) + verdict
        verdict += action_units_hints(parameters, _units_per_action(cfg))
    before_p = problem(0)
    x_before = before_p.start(np.zeros(len(names)))
    result = {
        "task": cfg.task.name,
        "env_id": cfg.task.env_id,
        "log": {
            "source": log.source,
            "steps": len(log.obs),
            "seconds": log.seconds,
            "runs": len(log.runs),
            "windows": len(windows.starts),
            "horizon_steps": windows.horizon,
            "late_samples": len(log.late),
            "clock_note": log.clock_note,
            "windows_dropped_late": windows.dropped_late,
            "recordings": [{"recording": r, "rows": [a, b]} for r, a, b in log.recordings],
        },
        "latency_steps": {
            "identified": latency,
            "confidence": confidence,
            "runner_up": runner_up.latency if runner_up else None,
            "candidates": {str(f.latency): f.cost for f in sorted(converged, key=lambda f: f.latency)},
            "largest_tried": max(latencies),
        },
        "combinations": combos,
        "parameters": parameters,
        "unidentified": [n for n, ok in zip(names, alone) if not ok],
        "flat_directions": [
            {"weights": {n: w for n, w in c["weights"].items() if abs(w) > 0.2}} for c in combos if not c["identified"]
        ],
        "ranges_from": where,
        "obs_noise_std": obs_noise,
        "obs_noise": {str(o): c for o, c in zip(twin.state_obs, noise)},
        "state_obs": twin.state_obs,
        "state_obs_names": cfg.observation_names(twin.state_obs),
        "residual_vs_noise_floor": [float(v) for v in ratio],
        "defect_structure_F": [float(v) for v in structure],
        "misfit": misfit,
        "offset": offset,  # the constant the twin lacks (_offsets), None where no channel shows one
        "outside": where == "outside" or late is not None,
        "verdict": verdict,
        "prediction_error": {
            "before": _prediction_error(before_p, x_before),
            "after": _prediction_error(final, best.x),
        },
        "not_identified_from_logs": ["action_noise_std", "push"],
    }
    result["calibrated"] = calibrated_set(result, reality, cfg)
    if bundle is not None:
        from pipeline.calibration.policy_estimate import compare_with_fit

        result["policy_estimate"] = compare_with_fit(bundle, log, result)
    result["wall_s"] = time.perf_counter() - t0
    return result


def _misfit(problem: Problem, best, velocities: list[int], windows: np.ndarray | None = None):
    """(residual spread per channel in noise floors, defect structure F per state observation, spread past
    MISFIT_RATIO, structure past STRUCTURE_F on a velocity) of the fit on `windows` (a mask; default all)."""
    ratio = residual_spread(best.residuals, problem, windows).reshape(2, -1).max(axis=0)  # misfit or defect
    structure = defect_structure(problem, best.residuals, best.x, windows)
    shaped = bool(velocities) and structure[_most_shaped(structure, velocities)] > STRUCTURE_F
    return ratio, structure, bool(ratio.max() > MISFIT_RATIO), bool(shaped)


def _offsets(problem: Problem, best, named: list[str], velocities: list[int]) -> tuple[list[str], dict | None]:
    """(verdict lines, record) for the state observation whose calibrated errors (one-step errors first, then misfits
    to the logged values) average furthest from 0 past OFFSET_T and OFFSET_SIZE; ([], None) where no channel does.

    A rate's one-step errors of one sign point at a position first: an outside user's pole angle logged 0.04 rad
    off was named as its rate's errors, and the rate is not the sensor to zero. The line then names the positions,
    whose zeros change the forces the twin computes from them."""
    means = residual_means(problem, best.residuals)
    found = []
    for kind, what in ((1, "one-step errors"), (0, "misfits to the logged values")):
        mean, se = means[kind]
        t = mean / np.maximum(se, 1e-300)
        found += [(abs(t[c]), kind, what, c, mean[c], t[c]) for c in range(len(mean))]
    found = [f for f in found if f[0] > OFFSET_T and abs(f[4]) >= OFFSET_SIZE]
    if not found:
        return [], None
    _, kind, what, c, mean, t = max(found, key=lambda f: f[0])
    positions = [named[i] for i in range(len(named)) if i not in velocities]
    rate = kind == 1 and c in velocities and bool(positions)
    if rate:
        cause = (
            f"in a rate's steps, a position logged off by a constant, which changes the forces the twin computes "
            f"from it (a tilted pendulum's gravity, a spring's stretch): {', '.join(positions)}; or a steady force "
            f"(a slope, a cable's pull). The fitted scales absorb part of it: zero those sensors"
        )
    else:
        cause = (
            f"{named[c]}'s zero (logged off by a constant) or a steady force (a slope, a cable's pull). The fitted "
            f"scales absorb part of it: zero the sensor"
        )
    # The same mean in the log's own units: the logged value's offset, or what each step adds the twin lacks.
    size = float(mean * np.atleast_1d(problem.obs_std if kind == 0 else problem.process_std)[c])
    line = (
        f"offset: the calibrated twin's {what} on {named[c]} average {mean:+.2f} of their expected spread "
        f"({size:+.3g} in the log's units{' per step' if kind == 1 else ''}; {t:+.1f} standard errors from 0 over "
        f"{BLOCKS} blocks of the log): a constant the twin does not model, {cause} (the plant at rest must log its "
        f"rest) and calibrate again"
    )
    suspects = positions if rate else [named[c]]
    record = {"observation": named[c], "errors": what, "mean": float(mean), "size": size, "t": float(t)}
    return [line], {**record, "per_step": kind == 1, "suspects": suspects}


def _most_shaped(structure: np.ndarray, velocities: list[int]) -> int:
    return max(velocities, key=lambda i: structure[i])


RECORDING_WINDOWS = 20  # a recording with fewer windows than this is not checked alone


def _recordings_apart(log: FieldLog, windows: Windows, problem: Problem, best, velocities: list[int]) -> list[str]:
    """Verdict lines for recordings in the log (FieldLog.recordings) the one fitted twin misses alone: two plants
    (a payload changed between nights) fit as one average plant whose misfit on each cancels in the pooled test.
    Each recording's residual spread and defect structure are read on its own windows, against the same limits."""
    out = []
    for label, first, stop in log.recordings:
        mine = (windows.starts >= first) & (windows.starts < stop)
        if mine.sum() < RECORDING_WINDOWS:
            continue
        ratio, structure, spread, shaped = _misfit(problem, best, velocities, mine)
        if spread or shaped:
            said = (
                f"leaves {ratio.max():.1f}x the noise floor"
                if spread
                else f"leaves errors that follow the state or the action "
                f"(F = {structure[_most_shaped(structure, velocities)]:.0f})"
            )
            out.append(
                f"misfit: the twin fitted to all {len(log.recordings)} recordings {said} on {label} (rows "
                f"{first}..{stop - 1}) alone: the recordings may come from different plants (a payload or a "
                f"drive changed between them); calibrate each recording alone and compare"
            )
    return out


def _declared_actions(cfg) -> list[dict]:
    """The actions the task's declaration states (name, units_per_action), in order; [] for one that declares none."""
    import envs.registry

    io, _ = envs.registry.describe_io(cfg.task.env_id)
    return list((io or {}).get("actions") or [])


def _units_per_action(cfg) -> dict[str, float]:
    """Each actuator's physical units per unit action (N, N m), as the declaration (and the bundle's contract)
    states it; {} for a task that declares none."""
    return {a["name"]: float(a["units_per_action"]) for a in _declared_actions(cfg)}


def action_names(cfg) -> list[str]:
    """The actions' declared names, in order (action[j] for a task that declares none)."""
    names = [a["name"] for a in _declared_actions(cfg)]
    return names or [f"action[{j}]" for j in range(task_facts(cfg.task.env_id)["act_dim"])]


SIGN_RATIO = 0.5  # the nominal twin replays the log this much better with an action negated: its sign is reversed


def _nominal_replay(setup: FitSetup, windows: Windows) -> float:
    """The nominal twin's open-loop error over `windows` (expected-spread units), at the latency that replays best."""
    theta = np.zeros(len(setup.names))  # every unknown scale at 1: the nominal twin
    problems = [setup.problem(latency, windows) for latency in setup.latencies]
    return min(_prediction_error(p, p.start(theta))["rms_normalized"] for p in problems)


def observation_hints(setup: FitSetup, names: list[str]) -> list[str]:
    """Verdict lines for a misfit whose log has a joint's columns in another sign, unit or place than declared.

    The log's checks compare a joint's position with its own velocity (load_field_log), so a change that keeps the
    two consistent passes them: an encoder counting the other way (position and velocity negated), an angle and its
    rate both in degrees, two joints' columns exchanged pair for pair. The fit then settles on the plant that
    explains such a log least badly and blames the twin (helper-62: "the plant's latency is 4 control steps",
    "joint_damping.hinge: the logs allow 5.42..8"). As for an action's sign, the nominal twin replays the log as
    logged and with each such change undone; one that replays it SIGN_RATIO times better is named first."""
    log, twin = setup.log, setup.twin
    pairs = twin.velocity_pairs()
    changes = []
    for p, v, joint in pairs:
        undo = np.ones(log.obs.shape[1])
        undo[[p, v]] = -1.0
        changes.append(
            (
                log.obs * undo,
                f"the {joint!r} joint's position and velocity ({names[p]}, {names[v]}) with the "
                "other sign (an encoder counting the other way)",
                "negate both columns",
            )
        )
        if twin.joint_is_hinge(joint):
            undo = np.ones(log.obs.shape[1])
            undo[[p, v]] = math.pi / 180.0
            changes.append(
                (
                    log.obs * undo,
                    f"the {joint!r} joint's angle and rate ({names[p]}, {names[v]}) in degrees and deg/s",
                    "convert both columns to rad and rad/s",
                )
            )
    for i, (p, v, joint) in enumerate(pairs):
        for q, w, other in pairs[i + 1 :]:
            order = np.arange(log.obs.shape[1])
            order[[p, v, q, w]] = [q, w, p, v]
            changes.append(
                (
                    log.obs[:, order],
                    f"joints {joint!r} and {other!r} in each other's columns "
                    f"({names[p]}, {names[v]} against {names[q]}, {names[w]})",
                    "reorder the columns",
                )
            )
    if not changes:
        return []
    horizon, longest = setup.windows.horizon, max(setup.latencies)
    logged = _nominal_replay(setup, setup.search_windows())
    out = []
    for obs, what, fix in changes:
        # The same windows as the search's (the log's runs are unchanged), cut from the columns changed back.
        windows = cut_windows(twin, replace(log, obs=obs), horizon, horizon + 1, longest)
        undone = _nominal_replay(setup, setup.search_windows(windows))
        if undone < SIGN_RATIO * logged:
            out.append(
                f"columns? the nominal twin replays the log {logged / undone:.1f}x better read as {what} (open-loop "
                f"error {undone:.2f} against {logged:.2f} as logged, in expected-spread units): {fix} where the log "
                f"is written, and calibrate again before acting on the lines after this one"
            )
    return out


def action_sign_hints(setup: FitSetup, names: list[str]) -> list[str]:
    """Verdict lines for a misfit whose log drives the plant the opposite way to the twin's actuator.

    A reversed sign (a drive wired the other way, a log that records the command before an inverting stage) is
    fitted like any other log: the fit settles on the plant that explains it least badly, and the verdict said
    "misfit" with a latency of 0, which reads as a modelling problem. The sign is tested directly instead: the
    nominal twin replays the log's windows open loop, as logged and with each action negated in turn (at every
    latency the fit tries, the best of each). A drive the log has backwards moves the plant the other way from the
    first step, so its negation replays the log several times better, and a right sign replays worse negated (4 to
    12 times on 60 s of the shipped declared plants' legacy controllers on `reality`; reversed, 4 to 19 times
    better). Only a verdict that already has a line (a misfit, outside, a latency) gets the test."""
    windows = setup.search_windows()
    logged = _nominal_replay(setup, windows)
    out = []
    for j, name in enumerate(names):
        sign = np.ones(windows.action.shape[1])
        sign[j] = -1.0
        negated = _nominal_replay(setup, replace(windows, action=windows.action * sign))
        if negated < SIGN_RATIO * logged:
            out.append(
                f"sign? the nominal twin replays the log {logged / negated:.1f}x better with {name} negated "
                f"(open-loop error {negated:.2f} against {logged:.2f} as logged, in expected-spread units): the "
                f"logged {name} drives the plant the opposite way to the MJCF's actuator. Where the log is written "
                f"(or in the drive's wiring, or the actuator's gear in the MJCF), reverse its sign and calibrate again "
                f"before acting on the lines after this one: a reversed drive makes them"
            )
    return out


UNITS_SPAN = 1.5  # a units_per_action this far from 1 (either way) makes a log in physical units tell from one without


def action_units_hints(parameters: dict, units_per_action: dict[str, float]) -> list[str]:
    """Verdict lines for a misfit or outside fit whose actuator gain ran past the configured range toward
    1 / units_per_action: the log's legacy_action in N or N m rather than normalized. A unit larger than 1 puts such a
    log beyond the action box and the log is refused before the fit; a smaller one (a geared motor's 0.3 N m per
    unit) keeps it inside the box, where it reads as a drive 1/0.3 times stronger, hence these lines."""
    out = []
    for name, entry in sorted(parameters.items()):
        kind, _, actuator = name.partition(".")
        u = units_per_action.get(actuator)
        if kind != "actuator_gain" or u is None or u <= 0 or 1 / UNITS_SPAN < u < UNITS_SPAN:
            continue
        lo, hi = entry["configured"]
        gain = entry["identified"]
        # Nearer 1/u than its range (in log scale): a gain 1-5 % past its range is a plant (helper-51's payload
        # gave 0.888 against 0.9..1.1 with 10 N per unit), not a log 10x off.
        toward = (u < 1 and gain > hi) or (u > 1 and gain < lo)
        if toward and abs(math.log(gain * u)) < abs(math.log(gain / (hi if u < 1 else lo))):
            out.append(
                f"units? {name} fits at {gain:.3g}, beyond its configured {lo:g}..{hi:g} toward 1/units_per_action "
                f"= {1 / u:.3g}: if the log's legacy_action is in the actuator's physical units, divide it by its "
                f"units_per_action ({u:g}) and calibrate again; the log holds normalized actions "
                f"(docs/reference/contracts.md)"
            )
    return out


def _combo(weights: dict[str, float]) -> str:
    """A combination of log-scales as the product it fixes: cart^1 * cart_force^-1.00 ..."""
    return " * ".join(f"{n}^{w:+.2f}" for n, w in weights.items() if abs(w) > 0.005)


def summary_lines(result: dict) -> list[str]:
    """Verdict, what the logs pin (combinations with intervals), latency, ranges, noise: the human summary.

    The flow's markdown artifact uses the same lines (as a Markdown list).
    """
    err = result["prediction_error"]
    log = result["log"]
    lat = result["latency_steps"]
    lines = [
        f"calibration of {result['task']} from {log['seconds']:.0f} s of log "
        f"({log['windows']} windows of {log['horizon_steps']} steps; fitted in {result['wall_s']:.1f} s)"
    ]
    if log.get("late_samples"):
        lines.append(
            f"late samples: {log['late_samples']} (the step counter continues, the clock is late: a stall, or rows "
            f"dropped and the counter renumbered); {log['windows_dropped_late']} window(s) holding one left out"
        )
    if log.get("clock_note"):
        lines.append(f"clock: {log['clock_note']}")
    beyond = _past_kept(result) if result.get("ranges_from") == "hull" else []
    lines += [f"VERDICT {v}" for v in result["verdict"]] or [
        "verdict: the twin explains the logs down to the noise floor, inside the config's ranges"
        + (" (the envelope of every set; past reality's in places, below)" if beyond else "")
    ]
    if beyond:
        lines.append(
            "ranges: no plant inside the ranges kept for what the logs cannot see moves as the fit's estimate does; "
            "the calibrated set takes its ranges from the envelope every set spans (which training and the shield "
            "cover), past the kept ones here: "
            + "; ".join(beyond)
            + ". If this plant is one of yours, widen that set there"
        )
    lines.append(
        f"prediction error (RMS over the window, in expected-spread units): "
        f"nominal twin {err['before']['rms_normalized']:.2f} -> calibrated {err['after']['rms_normalized']:.2f}"
        f"; residual / noise floor per state observation "
        + ", ".join(
            f"{name} {v:.2f}"
            for name, v in zip(
                result.get("state_obs_names") or [f"obs[{o}]" for o in result["state_obs"]],
                result["residual_vs_noise_floor"],
            )
        )
    )
    runner = (
        f" (vs {lat['runner_up']} steps: confidence {lat['confidence']:.3f})" if lat["runner_up"] is not None else ""
    )
    edge = (
        "; the largest tried (one past your sets' largest): the plant's may be longer, so widen latency_steps in "
        "your sets and calibrate again"
        if lat["identified"] == lat.get("largest_tried")
        else ""
    )
    lines.append(f"latency: {lat['identified']} control steps{runner}{edge}")
    for c in result["combinations"]:
        if c["identified"]:
            lo, hi = c["interval"]
            lines.append(f"identified: {_combo(c['weights'])} = {c['estimate']:.4g} (90 % interval {lo:.4g}..{hi:.4g})")
    for c in result["combinations"]:
        if not c["identified"]:
            why = (
                "flat direction, the logs cannot see it"
                if not math.isfinite(c.get("log_std_sampling", math.inf))
                or c.get("log_std_sampling", math.inf) >= c.get("log_std_assumptions", 0.0)
                else "set by the fit's assumptions more than by the logs"
            )
            lines.append(f"NOT identified ({why}): {_combo(c['weights'])}")
    for name, p in sorted(result["parameters"].items()):
        lo, hi = p["range"]
        if p.get("known"):
            status = "known (calibration.known)"
        elif p["identified_ok"]:
            a, b = p["interval"]
            status = f"pinned alone, 90 % interval {a:.3f}..{b:.3f}; calibrated range {lo:.3f}..{hi:.3f}" + (
                f" ({p['kept_from']}: {p['kept'][0]:g}..{p['kept'][1]:g})" if "kept_from" in p else ""
            )
        else:
            past = not p["kept"][0] <= p["identified"] <= p["kept"][1]
            status = (
                f"not pinned alone (best fit {p['identified']:.3f} is one point of a flat direction"
                + (", which runs past the configured range there" if past else "")
                + f"); calibrated range {lo:.3f}..{hi:.3f} ({p.get('kept_from', 'configured')}: "
                f"{p['kept'][0]:g}..{p['kept'][1]:g})"
            )
        lines.append(f"{name}: {status}")
    noise = ", ".join(f"{v:.4f}" for v in result["obs_noise_std"])
    lines.append(
        f"observation noise std: [{noise}] (configured unless the log's interval excludes it); "
        f"action noise and pushes keep the configured values"
    )
    if result.get("policy_estimate"):
        from pipeline.calibration.policy_estimate import comparison_lines

        lines += comparison_lines(result["policy_estimate"])
    return lines


def _past_kept(result: dict) -> list[str]:
    """Each parameter whose calibrated range runs past its kept range: 'name lo..hi, <its set> lo..hi'."""
    params = {n: p for n, p in result["parameters"].items() if not p.get("known") and "kept" in p}
    runs = _runs_past(
        {n: tuple(p["range"]) for n, p in params.items()}, {n: tuple(p["kept"]) for n, p in params.items()}
    )
    return [f"{n} {a:.3f}..{b:.3f}, {params[n].get('kept_from', 'kept')} {lo:g}..{hi:g}" for n, a, b, lo, hi, _ in runs]


def write_calibrated_yaml(result: dict, path: str | Path) -> Path:
    """The calibrated set as a bare RandomizationSet YAML (usable as --domains), the summary as comments."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "".join(
        f"# {line}\n" for line in ["calibrated randomization set (sim2real calibrate)", *summary_lines(result)]
    )
    path.write_text(header + yaml.safe_dump(result["calibrated"], sort_keys=True))
    return path
