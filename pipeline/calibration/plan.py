"""Excitation planning: a short perturbation on the legacy action that makes chosen parameters identifiable.

A good controller keeps the plant quiet, and a quiet log pins little (the
cart-pole's pole mass and hinge damping stay flat under the legacy LQR). The
plan is a sequence added to the legacy controller's normalized action for a
few seconds, within an amplitude the operator sets. Each candidate generator
(a random binary sequence held for a few steps, a multisine over a band, and
`none` as the quiet reference) is scored before anyone runs it: a log of the
nominal twin (the config's `reality` noise and pushes) is simulated with it,
the fit's Gauss-Newton information is read there (`fit.sandwich`) and turned
into identifiable combinations with their 90 % intervals by the same code that
reports a real calibration (`identify`). The score is the information gained on
the chosen parameters: per identified combination, log(config range's std /
expected std), weighted by the chosen parameters' share of its weights.

The best-scoring candidate is kept only if the safety check passes (the
command's: `pipeline.evaluation.excitation.corner_check`, every corner of
`reality` through the shield); otherwise the next is tried, and if none is
safe there is no plan.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np
from scipy.stats import norm

from pipeline.calibration.logs import QUIET_SPREAD, CalibrationError
from pipeline.calibration.twin import task_facts

PLAN_FORMAT = "sim2real-excitation-plan/1"
# Generators tried, the quiet reference first. Holds and bands span the cart-pole's slow cart mode and its
# faster pole mode at 50 Hz; a plant with other time scales is still scored honestly, only maybe less well served.
CANDIDATES: tuple[dict, ...] = (
    {"kind": "none"},
    {"kind": "prbs", "hold_steps": 2},
    {"kind": "prbs", "hold_steps": 8},
    {"kind": "multisine", "band_hz": [0.2, 2.0]},
    {"kind": "multisine", "band_hz": [1.0, 6.0]},
)
# Least-squares evaluations that settle the windows' states at the nominal scales before the information is read.
SETTLE_NFEV = 4
MULTISINE_TONES = 24


def excitation(generator: dict, steps: int, act_dim: int, amplitude: float, dt: float) -> np.ndarray:
    """(steps, act_dim) perturbation in normalized action units, |value| <= amplitude, from its generator parameters.

    generator: {"kind": "none" | "prbs" | "multisine", "seed": int, "hold_steps": int (prbs),
    "band_hz": [low, high] (multisine)}; dt: control period, s.
    """
    kind = generator["kind"]
    rng = np.random.default_rng(int(generator.get("seed", 0)))
    if kind == "none":
        return np.zeros((steps, act_dim))
    if kind == "prbs":
        hold = int(generator["hold_steps"])
        levels = rng.choice([-1.0, 1.0], size=(-(-steps // hold), act_dim))
        return amplitude * np.repeat(levels, hold, axis=0)[:steps]
    if kind == "multisine":
        lo, hi = generator["band_hz"]
        t = np.arange(steps) * dt
        freqs = np.linspace(lo, hi, MULTISINE_TONES)
        k = np.arange(MULTISINE_TONES)
        out = np.empty((steps, act_dim))
        for d in range(act_dim):
            # Schroeder phases keep the crest factor low: more power inside the same peak.
            phase = -math.pi * k * (k - 1) / MULTISINE_TONES + rng.uniform(0, 2 * math.pi)
            x = np.cos(2 * math.pi * freqs[None, :] * t[:, None] + phase[None, :]).sum(axis=1)
            out[:, d] = amplitude * x / np.max(np.abs(x))
        return out
    raise CalibrationError(f"excitation kind {kind!r}: not one of none, prbs, multisine")


def label(generator: dict) -> str:
    """A generator in a few characters: `prbs/hold 2`, `multisine 0.2-2 Hz`, `none`."""
    if generator["kind"] == "prbs":
        return f"prbs/hold {generator['hold_steps']}"
    if generator["kind"] == "multisine":
        lo, hi = generator["band_hz"]
        return f"multisine {lo:g}-{hi:g} Hz"
    return generator["kind"]


def replay(sequence: np.ndarray):
    """The probe a simulated legacy loop adds: step k gets sequence[k] (zero once the plan has run out)."""
    seq = np.asarray(sequence, np.float64)

    def probe(step: int, rng) -> np.ndarray:
        return seq[step] if step < len(seq) else np.zeros(seq.shape[1])

    return probe


class ExcitedLegacy:
    """The legacy controller plus the plan, as a batch policy for the episode runner (restarts with each episode)."""

    def __init__(self, env_id: str, sequence: np.ndarray):
        import envs

        self.legacy, self.sequence, self.k = envs.legacy_controller(env_id), np.asarray(sequence, np.float32), 0

    def reset(self) -> None:
        self.k = 0

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        u = np.asarray(self.legacy(obs), np.float32)
        if self.k < len(self.sequence):
            u = u + self.sequence[self.k]
        self.k += 1
        return np.clip(u, -1.0, 1.0)


def _expected(cfg, generator, *, scales, latency, steps, amplitude, seed, chosen, path) -> dict:
    """Simulate the plan on the nominal twin and read the information there: combinations, pinned parameters, gain."""
    from pipeline.calibration.calibrate import F_SCALE, LOCAL_NFEV, fit_setup
    from pipeline.calibration.fit import sandwich, solve
    from pipeline.calibration.identify import INTERVAL, combinations, covariance, pinned
    from pipeline.calibration.simulate import simulated_log

    task = task_facts(cfg.task.env_id)
    seq = excitation(generator, steps, task["act_dim"], amplitude, task["control_period_s"])
    log = simulated_log(cfg, scales, latency, path, steps=steps, seed=seed, probe=replay(seq))
    # setup.quiet: what calibrate would refuse a log like this one for (the config's legacy controller plus the plan).
    setup = fit_setup(cfg, log, quiet_ok=True)
    names = setup.names
    problem = setup.problem(latency)
    theta = np.log([scales[n] for n in names])
    fit = solve(problem, problem.start(theta), F_SCALE, SETTLE_NFEV, setup.bounds)
    a, b = sandwich(problem, fit)
    # The intervals calibrate will state carry the assumption shifts; the plan's promise carries them too.
    shifts = setup.assumption_shifts(latency, theta, LOCAL_NFEV)
    combos = combinations(a, b, theta, names, *setup.log_range(setup.hull), shifts)
    cov = covariance(a, b, combos, names)
    sampling_cov = covariance(a, b, combos, names, systematic=False)
    alone = pinned(combos, names)
    z = float(norm.ppf(0.5 + INTERVAL / 2))
    gain = 0.0
    for c in combos:
        w = np.array([c["weights"][n] for n in names])
        share = float(sum(c["weights"][n] ** 2 for n in chosen) / np.sum(w**2))
        if c["identified"]:
            gain += share * max(0.0, math.log(c["range_log_std"] / c["log_std"]))
        c["expected_half_width"] = math.expm1(z * c["log_std"]) if math.isfinite(c["log_std"]) else None
    parameters = {}
    for i, n in enumerate(names):
        sd = math.sqrt(max(cov[i, i], 0.0)) if alone[i] else math.inf
        parameters[n] = {
            "pinned": alone[i],
            "expected_interval": [scales[n] * math.exp(-z * sd), scales[n] * math.exp(z * sd)] if alone[i] else None,
            "expected_half_width": math.expm1(z * sd) if alone[i] else None,
            # The sampling part alone: what the excitation buys (the systematic floor is the same for any log).
            "expected_log_std_sampling": math.sqrt(max(sampling_cov[i, i], 0.0)) if alone[i] else None,
        }
    return {
        "generator": generator,
        "sequence": seq,
        "gain": gain,
        "combinations": combos,
        "parameters": parameters,
        "pinned_chosen": [n for n in chosen if parameters[n]["pinned"]],
        "quiet": setup.quiet,
    }


def chosen_parameters(setup_names: list[str], known: dict, hull: dict, params: list[str] | None) -> list[str]:
    """Validate --params against the config: every one randomized and not held by calibration.known."""
    if params is None:
        return list(setup_names)
    bad = [p for p in params if p not in hull]
    if bad:
        raise CalibrationError(f"--params {','.join(bad)}: not randomized by the config; choose from {sorted(hull)}")
    held = [p for p in params if p in known]
    if held:
        raise CalibrationError(f"--params {','.join(held)}: held fixed by calibration.known, nothing to identify")
    if not params:
        raise CalibrationError("--params: empty; name at least one randomized parameter")
    return list(params)


def design_plan(
    cfg,
    *,
    params: list[str] | None = None,
    amplitude: float = 0.1,
    steps: int = 1500,
    from_log: str | None = None,
    seed: int = 0,
    safety_check,
) -> dict:
    """Pick the safest informative excitation for `params` (default: what `from_log` leaves unpinned, else every
    randomized parameter); amplitude: the perturbation's peak, a fraction of the normalized action range [-1, 1].

    safety_check: sequence (steps, act_dim) -> figures with `safe` (pipeline.evaluation.excitation.corner_check,
    which the command passes in: evaluation sits above calibration). Returns the plan (JSON-ready: generator,
    sequence, expected intervals, candidates, safety figures, and the quiet log's calibration when given) with
    `plan["excitation"]` None when no candidate is safe.
    """
    from pipeline.calibration.calibrate import calibrate
    from pipeline.calibration.sets import configured_ranges

    if not (isinstance(amplitude, (int, float)) and 0.0 < amplitude <= 1.0):
        raise CalibrationError(f"--amplitude {amplitude}: must be in (0, 1], a fraction of the action range")
    task = task_facts(cfg.task.env_id)
    dt = float(task["control_period_s"])
    least = math.ceil(cfg.calibration.min_log_seconds / dt)
    if steps < least:
        raise CalibrationError(
            f"--steps {steps}: under calibration.min_log_seconds "
            f"({cfg.calibration.min_log_seconds:g} s = {least} steps)"
        )
    hull, known = configured_ranges(cfg), dict(cfg.calibration.known or {})
    unknown_known = sorted(set(known) - set(hull))
    if unknown_known:
        raise CalibrationError(f"calibration.known: {unknown_known} not randomized by the config")
    names = [n for n in sorted(hull) if n not in known]
    chosen = chosen_parameters(names, known, hull, params)
    reality = cfg.randomization.get("reality") or cfg.randomization["train"]
    latency = round(0.5 * (reality.latency_steps.low + reality.latency_steps.high)) if reality.latency_steps else 0
    quiet = None
    if from_log:
        quiet = calibrate(cfg, from_log, quiet_ok=True)  # a quiet log is what a plan is for
        latency = quiet["latency_steps"]["identified"]
        if params is None:
            chosen = list(quiet["unidentified"]) or names
    scales = {**{n: 1.0 for n in names}, **known}
    candidates = []
    with tempfile.TemporaryDirectory(prefix="sim2real-plan-") as work:
        for i, gen in enumerate(CANDIDATES):
            generator = {**gen, "seed": seed}
            candidates.append(
                _expected(
                    cfg,
                    generator,
                    scales=scales,
                    latency=latency,
                    steps=steps,
                    amplitude=amplitude,
                    seed=seed,
                    chosen=chosen,
                    path=Path(work) / f"candidate-{i}.npz",
                )
            )
    # A log calibrate would refuse as quiet pins nothing, whatever its information says: ranked last.
    ranked = sorted(candidates[1:], key=lambda c: (bool(c["quiet"]), -len(c["pinned_chosen"]), -c["gain"]))
    picked, safety = None, []
    for c in ranked:
        check = safety_check(c["sequence"])
        safety.append({"generator": c["generator"], **check})
        if check["safe"]:
            picked = c
            break
    plan = {
        "format": PLAN_FORMAT,
        "task": cfg.task.name,
        "env_id": cfg.task.env_id,
        "control_period_s": dt,
        "amplitude": float(amplitude),
        "steps": int(steps),
        "seed": int(seed),
        "params": chosen,
        # --from-log already pins every parameter: the plan narrows them further, which the log may not need.
        "log_pins_all": bool(quiet is not None and params is None and not quiet["unidentified"]),
        "known": known,
        "nominal": scales,
        "latency_steps": int(latency),
        "excitation": None if picked is None else picked["generator"],
        "sequence": None if picked is None else picked["sequence"].round(6).tolist(),
        "expected": None if picked is None else _public(picked),
        "quiet_expected": _public(candidates[0]),
        "candidates": [
            {"generator": c["generator"], "gain": c["gain"], "pinned": c["pinned_chosen"]} for c in candidates
        ],
        "safety": safety,
        "quiet_log": None if quiet is None else _quiet(quiet),
    }
    return plan


def _public(candidate: dict) -> dict:
    """The expected figures of a candidate, JSON-ready."""
    return {
        "quiet": candidate["quiet"],
        "gain": candidate["gain"],
        "combinations": candidate["combinations"],
        "parameters": candidate["parameters"],
        "pinned_chosen": candidate["pinned_chosen"],
    }


def _quiet(result: dict) -> dict:
    """What the quiet log achieves: per parameter pinned or not and its interval, the combinations, the verdict."""
    return {
        "source": result["log"]["source"],
        "seconds": result["log"]["seconds"],
        "latency_steps": result["latency_steps"]["identified"],
        "verdict": result["verdict"],
        "combinations": result["combinations"],
        "parameters": {
            n: {
                "pinned": p["identified_ok"],
                "interval": p.get("interval"),
                "log_std_sampling": p.get("log_std_sampling"),
                "range": p["range"],
            }
            for n, p in result["parameters"].items()
            if not p.get("known")
        },
    }


def load_plan(path: str | Path) -> dict:
    """Read a plan file written by `sim2real calibrate --plan`; CalibrationError naming the file if it is not one."""
    path = Path(path)
    try:
        plan = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CalibrationError(f"{path}: not a readable plan file ({type(err).__name__}: {err})") from None
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT or plan.get("sequence") is None:
        raise CalibrationError(f"{path}: not an excitation plan with a sequence ({PLAN_FORMAT})")
    plan["sequence"] = np.asarray(plan["sequence"], np.float64)
    return plan


def write_plan(plan: dict, path: str | Path) -> Path:
    """Write the plan as JSON (numbers as numbers, the sequence as a list of rows)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=1, default=_jsonable) + "\n")
    return path


def _jsonable(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON: {type(x).__name__}")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"+-{100 * x:.1f} %"


def plan_lines(plan: dict) -> list[str]:
    """The plan's human summary: what to run, what it should pin (expected), against the quiet log, and its safety."""
    from pipeline.calibration.calibrate import _combo
    from pipeline.calibration.identify import IDENTIFIED_SHRINK, SYSTEMATIC_STD

    dt = plan["control_period_s"]
    lines = []
    chosen = plan["params"]
    lines.append(f"excitation plan for {plan['task']}: chosen parameters {', '.join(chosen)}")
    if plan.get("log_pins_all"):
        lines.append(
            "the --from-log logs pin every parameter already: this plan would narrow their intervals further "
            "(compare its expected intervals with the log's, below); where those are narrow enough, it is not needed"
        )
    lines.append(
        "candidates (expected information gain on them, nats; chosen parameters pinned alone): "
        + "; ".join(f"{label(c['generator'])} {c['gain']:.2f} ({len(c['pinned'])})" for c in plan["candidates"])
    )
    for s in plan["safety"]:
        where = f"; FAILS at {len(s['failed'])} corner(s), first {s['failed'][0]}" if s["failed"] else ""
        lines.append(
            f"safety of {label(s['generator'])} on {s['corners']} corners of reality ({s['steps']} steps each, "
            f"shielded): {s['violations']} violations, {s['interventions']} shield interventions; the raw sequence "
            f"replayed where the shield intervened: {s['raw_replays']} corners, {s['raw_violations']} violations; "
            f"{s['drops']} plant(s) lost by the plan; the legacy controller alone, the same runs: "
            f"{s['drops_without_plan']} lost, {s['violations_without_plan']} violations{where}"
        )
    if plan["excitation"] is None:
        lines.append(
            f"NO PLAN: no candidate at amplitude {plan['amplitude']:g} is safe at every corner; lower --amplitude"
        )
        return lines
    lines.insert(
        1,
        f"apply: add `sequence[k]` to the legacy action for k = 0..{plan['steps'] - 1} ({plan['steps'] * dt:.0f} s): "
        f"{label(plan['excitation'])}, peak {plan['amplitude']:g} of the action range, seed {plan['seed']}",
    )
    lines.append(f"expected on the nominal twin (latency {plan['latency_steps']} steps), before anyone runs it:")
    if plan["expected"].get("quiet"):
        lines.append(
            f"  QUIET: even with this plan the log would barely move the plant ({'; '.join(plan['expected']['quiet'])};"
            f" calibrate needs {QUIET_SPREAD:g}x and refuses less): raise --amplitude, as far as the safety line "
            f"above allows"
        )
    for c in plan["expected"]["combinations"]:
        if c["identified"]:
            lines.append(
                f"  identified: {_combo(c['weights'])}, expected 90 % interval {_pct(c['expected_half_width'])}"
            )
        elif math.isfinite(c["log_std"]) and c["log_std"] < c["range_log_std"]:
            # Information, but not enough: calibration states a combination only once its std is under
            # IDENTIFIED_SHRINK of the configured range's, and never under the systematic floor.
            lines.append(
                f"  NOT pinned with this plan: {_combo(c['weights'])}, std {c['log_std']:.3f} against the configured "
                f"range's {c['range_log_std']:.3f} (identified below {IDENTIFIED_SHRINK:g}x it; never below "
                f"{SYSTEMATIC_STD:g}, the twin's own floor)"
            )
        else:
            lines.append(f"  NOT identifiable with this plan (flat): {_combo(c['weights'])}")
    quiet = plan["quiet_expected"]["parameters"]
    logged = (plan.get("quiet_log") or {}).get("parameters", {})
    for n in chosen:
        p = plan["expected"]["parameters"][n]
        now = "pinned" if quiet[n]["pinned"] else "not pinned"
        if n in logged:
            q = logged[n]
            now = (
                f"the quiet log pins it {q['interval'][0]:.3f}..{q['interval'][1]:.3f}"
                if q["pinned"]
                else f"the quiet log leaves it unpinned (calibrated range {q['range'][0]:.3f}..{q['range'][1]:.3f})"
            )
        else:
            now = f"a quiet log of the same length would leave it {now}"
        if p["pinned"]:
            lines.append(f"  {n}: pinned alone, expected 90 % interval {_pct(p['expected_half_width'])}; {now}")
        else:
            lines.append(f"  {n}: NOT pinned alone even with the plan (see the combinations above); {now}")
    if not plan["expected"]["pinned_chosen"]:
        lines.append(
            "NOTHING PINNED: this plan is expected to pin none of the chosen parameters, so running it buys no "
            "interval. Raise --amplitude (as far as the safety line allows) or --steps; where a configured range is "
            f"already within a few times the twin's floor (log std {SYSTEMATIC_STD:g}), no log narrows it"
        )
    return lines


def plan_pins_something(plan: dict) -> bool:
    """A safe plan was found and it is expected to pin at least one chosen parameter (what exit 0 promises)."""
    return plan["excitation"] is not None and bool(plan["expected"]["pinned_chosen"])
