"""What a shield synthesis certified, or why it refused, and the largest range that can be certified.

A certificate says: the envelope covered (every randomization set's ranges), the
model-error bounds the spec uses and how they were measured (samples, plants,
confidence), the falsification effort spent and the lowest barrier value it found,
and the legacy controller's intervention rate on `reality`. A refusal names the
parameter and the range that cannot be certified, the physical reason, and the
largest sub-range that can (found by bisecting the offending end of the range).

The falsification and the episodes are run by the caller (`pipeline.commands.shield`):
this layer sits below evaluation.
"""

from __future__ import annotations

import math
import time

import numpy as np

from pipeline.safety import predictive, sampling, synthesis
from pipeline.safety.predictive import ROOM_MEANING
from shield.spec import MAX_INPUT_GAIN_ERROR

BISECTION_STEPS = 6  # halvings of the offending range: its end is found to 1/64 of the range's width


def envelope_record(cfg) -> dict:
    """Every set's randomized ranges, latency, noise and push: what the certificate covers."""
    out = {}
    for name, rset in cfg.randomization.items():
        out[name] = {
            "ranges": {n: [lo, hi] for n, lo, hi in synthesis.range_parameters(rset)},
            "latency_steps": [rset.latency_steps.low, rset.latency_steps.high] if rset.latency_steps else [0, 0],
            "obs_noise_std": list(rset.obs_noise_std),
            "push": rset.push.model_dump() if rset.push is not None else None,
        }
    return out


def narrowed(cfg, parameter: str, low: float, high: float):
    """A copy of `cfg` whose every set draws `parameter` within [low, high] (a set's range clipped into it)."""
    from envs.randomization import ScaleRange

    out = cfg.model_copy(deep=True)
    for rset in out.randomization.values():
        if parameter == "gravity_scale":
            if rset.gravity_scale is not None:
                r = rset.gravity_scale
                rset.gravity_scale = ScaleRange(
                    dist=r.dist, low=min(max(r.low, low), high), high=max(min(r.high, high), low)
                )
            continue
        group, element = parameter.split(".", 1)
        ranges = getattr(rset, group)
        if element in ranges:
            r = ranges[element]
            ranges[element] = ScaleRange(dist=r.dist, low=min(max(r.low, low), high), high=max(min(r.high, high), low))
    return out


def latency_capped(cfg, most: int):
    """A copy of `cfg` whose every set's latency is at most `most` control steps (its range clipped below it)."""
    from envs.randomization import StepRange

    out = cfg.model_copy(deep=True)
    for rset in out.randomization.values():
        r = rset.latency_steps
        if r is not None and r.high > most:
            rset.latency_steps = StepRange(low=min(r.low, most), high=most)
    return out


def largest_certifiable_latency(cfg, seed: int = 0) -> tuple[int, int, int] | None:
    """(the fewest and the most latency the sets admit, the most that synthesis certifies with every set capped
    there), or None where the sets admit no latency or none below their most certifies: for a refusal that names
    no range, since a plan the shield predicts through more steps spreads its model error wider (a reaction wheel
    certified at 0-1 steps and refused at 0-2)."""
    ranges = [r.latency_steps for r in cfg.randomization.values() if r.latency_steps is not None]
    if not ranges:
        return None
    most, fewest = max(r.high for r in ranges), min(r.low for r in ranges)
    for cap in range(most - 1, fewest - 1, -1):
        if _certifiable(latency_capped(cfg, cap), seed):
            return fewest, most, cap
    return None


def _full_range(cfg, parameter: str) -> tuple[float, float]:
    lo, hi = np.inf, -np.inf
    for rset in cfg.randomization.values():
        for n, a, b in synthesis.range_parameters(rset):
            if n == parameter:
                lo, hi = min(lo, a), max(hi, b)
    return float(lo), float(hi)


def _certifiable(cfg, seed: int) -> bool:
    """True when synthesis builds a spec for `cfg` that every check accepts (braking, envelope, overrides)."""
    from pipeline.safety.shield_spec import EnvelopeError, build_shield_spec

    meas = synthesis.measure(cfg, seed=seed)
    try:
        build_shield_spec(cfg, measurement=meas)
    except EnvelopeError:
        return False
    return True


def _measured_figure(cfg, meas: synthesis.Measurement, k: int, d: int | None):
    """(where the figure was measured, the figure as a function of a plant's domain at that state), or None where
    it was measured nowhere. The figure: with a direction d, the braking of position k toward that side
    (`synthesis.authority_problems`); with d None, the input effect on it (`synthesis.gain_problems`). With
    `at_rest`, at the same positions with every speed zeroed: whether the positions alone (a ball below a tilted
    plate's axis) make the figure what it is, or a speed does."""
    at = meas.authority_at[k][d] if d is not None else (meas.gain_at[k] if k < len(meas.gain_at) else {})
    if not at:
        return None
    env = synthesis.EnvelopeSampler(cfg, np.random.default_rng(0), draws=0)
    plant = env.plants[at["set"]]
    x = np.array([at["state"][str(o)] for o in env.state_index])
    rest = x.copy()
    rest[env.iv] = 0.0

    if d is None:

        def figure(domain, at_rest: bool = False):
            plant.apply(domain)
            return synthesis.input_effect(env, plant, rest if at_rest else x, k) or 0.0

    else:
        v, j = env.iv[k], env.main_in[k]
        sign = -1.0 if d == 0 else 1.0
        u = np.zeros(len(env.full))
        u[j] = sign * np.sign(env.B[v, j]) * env.full[j]

        def figure(domain, at_rest: bool = False):
            plant.apply(domain)
            here = rest if at_rest else x
            return sign * (plant.step(here, u)[v] - here[v]) / env.dt

    return at, figure


def offending_parameter(cfg, meas: synthesis.Measurement, k: int, d: int | None) -> tuple[str, str] | None:
    """(parameter, "low" or "high"): of the parameters of the plant where the figure was measured
    (`_measured_figure`), the one whose other end (or either end, for a value inside its range) helps it most (the
    same plant and state, one step); the offending end is the one it did not move to."""
    measured = _measured_figure(cfg, meas, k, d)
    if measured is None:
        return None
    at, figure = measured
    base, best = figure(at["domain"]), None
    ranges = sampling.ranges(cfg.randomization[at["set"]])
    for name, value in at["domain"].items():
        lo, hi = ranges.get(name, (value, value))
        if hi <= lo:
            continue
        # The weakest figure may lie inside a range (a random draw): each end is tried, and the end that
        # helps most names the other end as the offending one.
        for end, other in ((lo, "high"), (hi, "low")):
            if end == value:
                continue
            gain = figure(dict(at["domain"], **{name: end})) - base
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, name, other)
    return None if best is None else (best[1], best[2])


def largest_certifiable(cfg, parameter: str, end: str, seed: int = 0) -> tuple[float, float] | None:
    """The widest [low, high'] (or [low', high]) of `parameter`, the other end kept, that synthesis certifies
    (falsification aside). Where the kept end alone is refused too, both ends are: the widest range around the
    nominal value (1x, or the range's middle where 1x lies outside it), each end bisected in turn; `end` "both"
    goes there directly. None when even that value alone is refused."""
    lo, hi = _full_range(cfg, parameter)
    keep = lo if end == "high" else hi
    if end != "both" and _certifiable(narrowed(cfg, parameter, keep, keep), seed):
        good = _bisect_end(cfg, parameter, keep, hi if end == "high" else lo, seed)
        return (keep, good) if end == "high" else (good, keep)
    centre = nominal_value(lo, hi)
    if not _certifiable(narrowed(cfg, parameter, centre, centre), seed):
        return None
    low = _bisect_end(cfg, parameter, centre, lo, seed)
    return low, _bisect_end(cfg, parameter, low, hi, seed, start=centre)


def _bisect_end(cfg, parameter: str, keep: float, far: float, seed: int, start: float | None = None) -> float:
    """The end toward `far` of the widest range from `keep` that synthesis certifies, starting from `start`
    (certified; default `keep`), to 1/2^BISECTION_STEPS of the distance, rounded inward to 0.001."""
    good, bad = (keep if start is None else start), far
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (good + bad)
        if _certifiable(narrowed(cfg, parameter, min(keep, mid), max(keep, mid)), seed):
            good = mid
        else:
            bad = mid
    return math.floor(good * 1000) / 1000 if far > keep else math.ceil(good * 1000) / 1000


def nominal_value(lo: float, hi: float) -> float:
    """Where a range is pinned "at nominal": 1x (the MJCF's own value), or the range's middle where 1x lies outside."""
    return 1.0 if lo <= 1.0 <= hi else 0.5 * (lo + hi)


def _randomized_names(cfg) -> list[str]:
    """Every randomized parameter of every set, once each, in the order the sets first name them."""
    return list(dict.fromkeys(n for rset in cfg.randomization.values() for n, _, _ in synthesis.range_parameters(rset)))


def _pinned_culprit(cfg, parameters: list[str], seed: int = 0) -> str | None:
    """The first of `parameters` whose range, pinned at its nominal value with every other range as it is, lets
    synthesis certify the envelope: where the braking figure blames one range and the predictive filter fails on
    another's account (a light payload's swing under the wind, not the motor the barrier could not brake with)."""
    for name in parameters:
        lo, hi = _full_range(cfg, name)
        if hi <= lo:
            continue
        centre = nominal_value(lo, hi)
        if _certifiable(narrowed(cfg, name, centre, centre), seed):
            return name
    return None


def unblamed_ways(cfg, seed: int = 0, progress=None) -> dict:
    """For a refusal no measured figure blames on a range (the predictive filter could not hold the plant either):
    the ways to a certificate. The first randomized range, widest first (relative to its far end), that pinned at
    nominal with the rest as they are certifies, with the sub-range around nominal that can; and the longest latency
    that certifies with every set capped there. Either can be what the plant needs (helper-65's hoist: its 0.3-1.5x
    payload narrowed certifies with 0-2 steps kept, and 0 steps certifies with the payload kept), so both are
    looked for; {} where neither is found. Each try is a synthesis (tens of seconds where it is refused): `progress`
    (a callable taking one line) hears what is tried next."""
    say = progress or (lambda line: None)
    ranges = {n: _full_range(cfg, n) for n in _randomized_names(cfg)}
    widest = sorted(
        (n for n, (lo, hi) in ranges.items() if hi > lo),
        key=lambda n: -(ranges[n][1] - ranges[n][0]) / max(abs(ranges[n][0]), abs(ranges[n][1])),
    )
    out: dict = {}
    say(f"pinning each randomized range at nominal in turn, the widest first ({', '.join(widest) or 'none'})")
    culprit = _pinned_culprit(cfg, widest, seed)
    if culprit is not None:
        say(f"{culprit} pinned certifies: bisecting its ends for the widest sub-range around nominal that does")
        sub = largest_certifiable(cfg, culprit, "both", seed)
        out.update(
            parameter=culprit,
            range=list(ranges[culprit]),
            offending_end="both",
            certifiable_range=list(sub) if sub else None,
        )
    say("capping every set's latency_steps lower, one step at a time")
    capped = largest_certifiable_latency(cfg, seed)
    if capped is not None:
        fewest, most, cap = capped
        out.update(latency_range=[fewest, most], certifiable_latency=cap)
    return out


def ways_line(ways: dict) -> str:
    """The refusal's tail for `unblamed_ways`: each way to a certificate, or what is left to try."""
    said = []
    if ways.get("parameter"):
        lo, hi = ways["range"]
        sub = ways["certifiable_range"]
        said.append(
            f"randomization.*.{ways['parameter']} (now [{lo:g}, {hi:g}]) pinned at nominal certifies it"
            + (f": a sub-range around nominal that can be certified is [{sub[0]:g}, {sub[1]:g}]" if sub else "")
        )
    if "certifiable_latency" in ways:
        said.append(
            f"with every set's latency_steps at most {ways['certifiable_latency']} (now up to "
            f"{ways['latency_range'][1]}) it can be certified"
        )
    if not said:
        return (
            "; no range pinned at nominal, nor a shorter latency, certifies it with the rest as they are: narrow "
            "several ranges together, lighten the pushes, or give the drive more authority"
        )
    return "; " + "; or, ".join(said)


def refusal(
    cfg, meas: synthesis.Measurement, problems: list[tuple[int, int | None, str]] | None = None, bisect: bool = True
) -> dict:
    """Why the envelope cannot be certified: the parameter, its range, the physical reason, and (with `bisect`:
    a measurement per halving) the largest sub-range that can. `problems`: `synthesis.gain_problems` or
    `synthesis.authority_problems` (by default the first of them that has any)."""
    if problems is None:
        problems = synthesis.gain_problems(meas) or synthesis.authority_problems(meas)
    k, d, reason = problems[0]
    out = {"certified": False, "reason": reason, "reasons": [r for _, _, r in problems]}
    measured = _measured_figure(cfg, meas, k, d) if d is None else None
    nominal = measured[1]({}) if measured is not None else None  # the nominal plant at the same state
    if measured is not None and nominal is not None and 1.0 - nominal > MAX_INPUT_GAIN_ERROR:
        # The nominal plant is as weak at that state: the state is the cause, and narrowing any range only moves the
        # blame to the next parameter measured there.
        out["state_is_the_cause"] = True
        rest = measured[1]({}, at_rest=True)
        out["effect_at_rest"] = rest
        if 1.0 - rest > MAX_INPUT_GAIN_ERROR:
            cause = (
                f", and {rest:.3g}x at rest at the same positions: no parameter's range is the cause, the positions "
                f"the constraints admit are (the drive's effect on {meas.names[k]} falls or reverses there, whatever "
                f"the speeds)"
            )
        else:
            cause = (
                " (at rest at the same positions it does not fall that far: a speed there is part of the cause): no "
                f"parameter's range is the cause, the state is (the drive's effect on {meas.names[k]} falls or "
                f"reverses there)"
            )
        out["message"] = (
            f"cannot certify {cfg.task.name}: {reason}. The nominal plant, at the same state, has {nominal:.3g}x too"
            f"{cause}. Narrow the constraints that admit that state (where a coordinate no constraint limits turns "
            f"the drive, a body's heading say, add a box on it), or change the plant's masses or geometry so the "
            f"drive moves {meas.names[k]} the same way over the whole constraint box"
        )
        return out
    found = offending_parameter(cfg, meas, k, d)
    if found is None:
        out["message"] = f"cannot certify {cfg.task.name}: {reason}"
        return out
    parameter, end = found
    sub = largest_certifiable(cfg, parameter, end) if bisect else None
    if bisect and sub is None:
        # Not even that range's nominal value certifies with the others as they are: the cause may be another
        # range, one the figure that blamed this one does not see.
        others = [n for n in _randomized_names(cfg) if n != parameter]
        culprit = _pinned_culprit(cfg, others)
        if culprit is not None:
            parameter, end = culprit, "both"
            sub = largest_certifiable(cfg, culprit, "both")
    lo, hi = _full_range(cfg, parameter)
    out.update(
        {
            "parameter": parameter,
            "range": [lo, hi],
            "offending_end": end,
            "certifiable_range": list(sub) if sub else None,
        }
    )
    where = f"randomization.*.{parameter}"
    if not bisect:
        tail = "; `sim2real shield synthesize` finds the largest sub-range that can be certified"
    elif sub and end == "both":  # one of the ranges around nominal: a wider low end may cost the high one
        tail = (
            f"; a sub-range around nominal that can be certified is [{sub[0]:g}, {sub[1]:g}] (its low end pushed "
            f"out first, then its high end)"
        )
    elif sub:
        tail = f"; the largest sub-range that can be certified is [{sub[0]:g}, {sub[1]:g}]"
    else:
        tail = (
            "; no sub-range of it, nor any other range pinned at nominal, can be certified with the rest as they "
            "are: narrow several ranges together, lighten the pushes, or give the drive more authority over the "
            "plant's inertia (a stronger motor, or a gearbox's reflected inertia: armature in the MJCF)"
        )
    which = "both ends" if end == "both" else f"its {end} end"
    out["message"] = f"cannot certify {where} over [{lo:g}, {hi:g}] ({which}): {reason}{tail}"
    return out


def certificate(
    cfg, meas: synthesis.Measurement | None, spec: dict, falsified: dict | None, legacy: dict | None
) -> dict:
    """The certificate of a synthesized (or checked) shield spec: see the module docstring."""
    return {
        "certified": True,
        "task": cfg.task.name,
        "config_hash": cfg.config_hash(),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "envelope": envelope_record(cfg),
        "shield_numbers": {
            "margin": spec["margin"],
            "brake_accel": spec["kinematics"]["brake_accel"],
            "disturbance_accel": spec["disturbance_accel"],
            "input_gain_error": spec["input_gain_error"],
            "push_velocity": spec.get("push_velocity"),
            "latency_steps": spec["latency_steps"],
            "set_by_hand": _set_by_hand(cfg),
        },
        "filter": filter_record(spec, cfg),
        "model_error": meas.record() if meas is not None else None,
        "falsification": falsified,
        "legacy_on_reality": legacy,
        "conservative": conservative_record(cfg, spec, legacy),
    }


# A certified shield that changes more of the legacy controller's steps on `reality` than this is reported as
# conservative: a policy trained without it is changed about as often, and the gate's intervention-rate check
# meets that.
CONSERVATIVE_SHARE = 0.05


def conservative_record(cfg, spec: dict, legacy: dict | None) -> dict | None:
    """Where the legacy controller behind the shield is changed on more than CONSERVATIVE_SHARE of its steps: that
    share, and what takes the room: per constraint, what the predictive filter's tube takes off it at rest; per
    position, the barrier's model error over its weaker braking. None otherwise (or with no legacy run)."""
    if not legacy or not legacy.get("episodes") or legacy["intervention_rate"] <= CONSERVATIVE_SHARE:
        return None
    record: dict = {"legacy_changed": legacy["intervention_rate"], "above": CONSERVATIVE_SHARE}
    if "predictive" in spec:
        from pipeline.safety.predictive import legacy_lqr_weights, tube_at_rest

        record["backup_weights"] = "legacy_lqr" if legacy_lqr_weights(cfg) is not None else "bryson"
        record["tube_at_rest"] = [
            {"constraint": name, "taken": round(taken, 4), "room": round(room, 4)}
            for name, taken, room in tube_at_rest(spec)
        ]
    else:
        names = cfg.observation_names(spec["kinematics"]["position_index"])
        record["error_over_braking"] = [
            {"position": name, "ratio": round(w / max(min(pair) if isinstance(pair, list) else pair, 1e-12), 3)}
            for name, w, pair in zip(names, spec["disturbance_accel"], spec["kinematics"]["brake_accel"])
        ]
    return record


def conservative_line(record: dict) -> str:
    """`conservative_record` in one line of what it means and what to do."""
    head = (
        f"CONSERVATIVE: it changes {record['legacy_changed']:.1%} of the legacy controller's steps on reality (more "
        f"than {record['above']:.0%}); a policy trained without the shield is changed about as often (one trained "
        f"with it, shield.train_in_loop, learns to stay where it is seldom changed: helper-71's, 0.16 % behind a "
        f"shield changing 44 % of its LQR's steps), and gate.max_intervention_rate judges that. "
    )
    if "tube_at_rest" in record:
        rows = [r for r in record["tube_at_rest"] if r["room"] > 0]
        worst = max(rows, key=lambda r: r["taken"] / r["room"]) if rows else None
        what = (
            f"At rest the model error under the backup takes {worst['taken']:.3g} of constraint "
            f"{worst['constraint']!r}'s {worst['room']:.3g} room ({worst['taken'] / worst['room']:.0%}; "
            f"{ROOM_MEANING}). "
            if worst
            else ""
        )
        weights = (
            "your legacy LQR's weights"
            if record.get("backup_weights", "legacy_lqr") == "legacy_lqr"
            else "Bryson's rule over your limits and ranges, your legacy not being an LQR"
        )
        widens = (
            f"the sets' pushes, latency, noise and ranges, and a slow backup (it is {weights}, with its input weight "
            "raised until stable and gentle enough near rest: where those weights barely weigh what your limits read, "
            "it is slow there)"
        )
    else:
        worst = max(record["error_over_braking"], key=lambda r: r["ratio"])
        what = f"The model error on {worst['position']} is {worst['ratio']:.0%} of the braking it has there. "
        widens = "the sets' pushes, latency, noise and ranges (the model error), and a weak drive (the braking)"
    return (
        head + what + f"What widens it: {widens}. Try each on a copy of the config with `shield synthesize "
        "--no-falsify` (a minute): which one moves the rate is plant-specific"
    )


def _set_by_hand(cfg) -> list[str]:
    sc = cfg.shield
    keys = ["margin", "brake_fraction", "brake_accel", "disturbance_accel", "input_gain_error"]
    return [f"shield.{k}" for k in keys if getattr(sc, k) is not None]


def filter_record(spec: dict, cfg=None, starts: dict | None = None) -> dict:
    """Which filter keeps the constraints, and why: the braking barrier, or the predictive filter where the
    barrier cannot brake a constraint (with the measured reason and the numbers it was synthesized with, and with
    `cfg`, which of the episodes' starts it certifies from their first step: `predictive.start_coverage`, or
    `starts` where the caller measured it already)."""
    pr = spec.get("predictive")
    if pr is None:
        from pipeline.safety.barrier_checks import BARRIER_ACTS_SHARE

        return {
            "type": "barrier",
            "why": "full action brakes every constrained position at every admitted state, and the barrier finds an "
            f"action by its conditions at rest and on at least {BARRIER_ACTS_SHARE:.0%} of the states sampled "
            "inside its own safe set",
        }
    return {
        "type": "predictive",
        "why": pr["measured"].get("why", []),
        "horizon": pr["horizon"],
        "backup_gain": pr["backup_gain"],
        "tube_at_horizon": pr["tube"][-1],
        "tube_measured": {k: v for k, v in pr["measured"].items() if k != "why"},
        **({"starts": starts or predictive.start_coverage(cfg, spec)} if cfg is not None else {}),
    }
