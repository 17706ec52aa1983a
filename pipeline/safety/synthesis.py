"""Shield synthesis: measure, from the MJCF and the config's randomization sets alone, what the shield needs.

For a plant whose shield model is ``linear`` (MuJoCo's finite differences at the
operating point over one control period: every coupling the MJCF has is in it),
this simulates the whole envelope and measures:

- the braking authority each position really has toward each direction: the
  weakest plant's full action toward it (less the set's action noise, the other
  inputs at their worst), over
  the half of the constraint nearer the bound that braking protects, at states the
  braking barrier admits (moving toward a bound no faster than the measured braking
  stops in the room left: found by iterating from the nominal full action);
- the model error: one-step prediction residuals of the nominal model, per
  position, at those states and actions in the box (the plant getting each
  command moved within the set's action noise), on every set's corners
  (sampled when 2^d is large) and random draws; as an acceleration (units/s^2),
  with the state-dependent law that bounds it best (``a + b f(x)``, f a
  coordinate's distance from the operating point or its square: a pull growing with
  a speed squared), and the position residual through the longest latency;
- the input's effect relative to nominal, per position, as it is (low, high);
- each set's push, as the acceleration it gives each position where it is
  measured (a push on a payload moves the swing, not the world axis it is along).

`derived_numbers` turns a measurement into the numbers a shield spec needs;
`override_problems` holds hand-set numbers to it; `authority_problems` says where
no braking barrier can be certified, `gain_problems` where the drive is too weak for any
shield model. Nothing here is tuned: every figure is a max or
min over simulated samples, with the stated sample counts (`Measurement.record`).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from pipeline.safety.envelope import NOISE_SIGMAS
from pipeline.safety.sampling import (  # noqa: F401
    VIABLE_BRAKING,
    EnvelopeSampler,
    SteppedPlant,
    SynthesisError,
    constraint_obs,
    range_parameters,
)
from shield.spec import MAX_INPUT_GAIN_ERROR

# The max of N draws bounds the (1 - ln(1/delta) / N) quantile of what it measures with confidence 1 - delta;
# the bounds the spec uses are that max times INFLATION, since a finite sample never reaches the supremum.
CONFIDENCE = 0.95
INFLATION = 1.2
AUTHORITY_PASSES = 2  # braking measured at the states the previous pass's braking admits
DRAWS = 16  # random plants per set besides its corners


@dataclass
class Measurement:
    """What `measure` found; per position lists follow `positions` (observation indices)."""

    task: str
    positions: list[int]
    names: list[str]  # of the positions (observation names, or obs[i])
    state_names: dict[int, str]  # observation index -> name, for every shield-state entry
    full_accel: list[float]  # nominal full-action acceleration per position (units/s^2)
    gain_range: list[tuple[float, float]]  # measured input effect / nominal per position: (low, high)
    residual_accel: list[float]  # per position: bound on the velocity residual as an acceleration (units/s^2)
    residual_law: list[dict]  # per position: {"accel", "per_unit", "feature"}: accel + per_unit * feature(x)
    residual_pos: list[float]  # per position: position residual through the longest latency + 1 step (units)
    authority: list[tuple[float, float]]  # per position (toward -, toward +): weakest full-action accel
    authority_at: list[tuple[dict, dict]]  # where each minimum was: {set, domain, state}
    push_accel: dict[str, list[float]]  # per set, per position (units/s^2)
    noise_margin: float  # NOISE_SIGMAS x the largest noise std of a constrained observation
    samples: int  # residual samples over all sets
    domains: int  # plants simulated
    speed_bound: list[float]  # per position's velocity: how fast the plant went (sampling range)
    latency_steps: int = 0  # the longest latency any set admits (control steps)
    dt: float = 0.0  # control period (s)
    wall_s: float = 0.0
    sets: dict = field(default_factory=dict)  # per set: plants, samples
    gain_at: list[dict] = field(default_factory=list)  # per position, where the weakest input effect was: {set, ...}

    def gain_error(self) -> float:
        """The symmetric relative error the CBF's two gain cases need to cover every measured (low, high)."""
        return max([max(1.0 - lo, hi - 1.0) for lo, hi in self.gain_range] + [0.0])

    def margin(self) -> float:
        """Noise at NOISE_SIGMAS, plus whatever position error through the latency the disturbance bound does not
        already account for (the barrier lets `residual_accel` act over the latency and one period: w T^2 / 2)."""
        return self.noise_margin + max([self.excess_position(k) for k in range(len(self.positions))] + [0.0])

    def excess_position(self, k: int) -> float:
        """Position k's measured error through the latency beyond what its disturbance bound accounts for (units)."""
        horizon = (self.latency_steps + 1) * self.dt
        return max(0.0, self.residual_pos[k] - 0.5 * self.residual_accel[k] * horizon**2)

    def record(self) -> dict:
        """The measurement as the certificate and the spec's assumptions state it."""
        per_set = max(1, self.samples // max(1, len(self.sets)))
        q = 1.0 - math.log(1.0 / (1.0 - CONFIDENCE)) / per_set
        return {
            "method": "one-step and latency+1-step prediction residuals of the nominal linear model, simulated in "
            "MuJoCo at states inside the constraints (moving no faster than the measured braking stops) "
            "and actions in the box, on every randomization set's corners and random draws",
            "samples": self.samples,
            "plants": self.domains,
            "sets": self.sets,
            "confidence": f"per set, the max of its samples bounds the {q:.4f} quantile with confidence "
            f"{CONFIDENCE:g}; every bound is that max x {INFLATION:g}",
            "positions": self.positions,
            "names": self.names,
            "input_gain_range": [[round(lo, 4), round(hi, 4)] for lo, hi in self.gain_range],
            "residual_accel": [round(r, 4) for r in self.residual_accel],
            "residual_law": self.residual_law,
            "residual_position": [round(r, 5) for r in self.residual_pos],
            "authority_accel": [[round(a, 4) for a in pair] for pair in self.authority],
            "authority_at": [list(a) for a in self.authority_at],
            "push_accel": {k: [round(p, 4) for p in v] for k, v in self.push_accel.items()},
            "noise_margin": self.noise_margin,
            "speed_bound": [round(s, 4) for s in self.speed_bound],
            "wall_s": round(self.wall_s, 2),
        }


def measure_authority(env: EnvelopeSampler, samples: int) -> tuple[list, list]:
    """Per position, (toward -, toward +): the least acceleration full action toward that side gives, the other
    inputs at every corner of their box, over every set's plants and the admitted states in the half of the
    position's range nearer the bound that braking protects, moving toward that bound; and where it was."""
    rng, authority, where = env.rng, [], []
    for k, (p, v) in enumerate(zip(env.ip, env.iv)):
        pair, at_pair = [], []
        j_main = env.main_in[k]
        others = [j for j in range(len(env.full)) if j != j_main]
        for sign in (-1.0, 1.0):
            worst, at = np.inf, {}
            for name, plant in env.plants.items():
                doms = env.domains[name]
                for dom in doms:
                    plant.apply(dom)
                    for _ in range(max(4, samples // (8 * len(doms)))):
                        x = rng.uniform(env.lo_s, env.hi_s)
                        ends = rng.random(env.n) < 0.25
                        x[ends] = np.where(rng.random(int(ends.sum())) < 0.5, env.lo_s[ends], env.hi_s[ends])
                        mid = 0.5 * (env.lo_s[p] + env.hi_s[p])
                        # Braking toward - protects the upper bound: states in the upper half, moving up.
                        x[p] = rng.uniform(mid, env.hi_s[p]) if sign < 0 else rng.uniform(env.lo_s[p], mid)
                        x[v] = -sign * abs(x[v])
                        x = env.admit(x)
                        # Full action, less what the set's action noise may take off it.
                        weakest = max(env.full[j_main] - env.action_noise[name][j_main], 0.0)
                        for rest in itertools.product((-1.0, 1.0), repeat=len(others)):
                            u = np.zeros(len(env.full))
                            u[j_main] = sign * np.sign(env.B[v, j_main]) * weakest
                            for j, s in zip(others, rest):
                                u[j] = s * env.full[j]
                            a = sign * (plant.step(x, u)[v] - x[v]) / env.dt
                            if a < worst:
                                worst, at = (
                                    float(a),
                                    {
                                        "set": name,
                                        "domain": dict(dom),
                                        "state": {str(o): round(float(x[env.col[o]]), 4) for o in env.state_index},
                                    },
                                )
            pair.append(worst)
            at_pair.append(at)
        authority.append(tuple(pair))
        where.append(tuple(at_pair))
    return authority, where


def measure(cfg, samples: int | None = None, seed: int = 0, draws: int = DRAWS) -> Measurement:
    """Simulate `cfg`'s envelope: braking authority, the nominal model's error, input gain and pushes.

    Deterministic for a config and seed, so the spec it leads to is the same at export and at eval."""
    t0 = time.monotonic()
    samples = int(samples or cfg.shield.synthesis_samples)
    rng = np.random.default_rng(seed)
    env = EnvelopeSampler(cfg, rng, draws)
    env.reach_box()
    for _ in range(AUTHORITY_PASSES):
        authority, authority_at = measure_authority(env, samples)
        # The barrier brakes at most at VIABLE_BRAKING x nominal: states faster than that are not admitted.
        env.braking = [tuple(min(a, VIABLE_BRAKING * f) for a in pair) for pair, f in zip(authority, env.nominal_full)]
    lat_max = max([r.latency_steps.high for r in cfg.randomization.values() if r.latency_steps is not None] + [0])
    res_v, res_p, feats, gains = [], [], [], [[] for _ in env.pos]
    gain_at: list[dict] = [{} for _ in env.pos]
    driven = env.driven_positions()  # after reach_box: it reads the speed ranges
    push_accel, sets_info, n_domains = {}, {}, 0
    for name, rset in cfg.randomization.items():
        plant, doms = env.plants[name], env.domains[name]
        n_domains += len(doms)
        pushed = _pushed(env, rset)
        push_k = np.zeros(len(env.pos))
        per_dom = max(1, samples // len(doms))
        for dom in doms:
            plant.apply(dom)
            for _ in range(per_dom):
                x, u = env.draw_state(), env.draw_action()
                x1 = plant.step(x, env.applied(name, u))
                r = env.wrap(x1 - env.predict(x, u) + env.x_op) - env.x_op
                # The barrier's conditions hold for every input effect in the measured gain range, so the part of
                # the residual that is the main input's effect off nominal at this state is theirs to cover, not
                # the disturbance's: counted in both, a plant whose load changes the drive's effect (a heavier
                # link, a weaker motor) was braked for its gain error twice.
                here = _gain_samples(env, plant, x, driven, gains, gain_at, {"set": name, "domain": dict(dom)})
                for k, g in here.items():
                    j, m = env.iv[k], env.main_in[k]
                    r[j] -= (g - 1.0) * env.B[j, m] * u[m]
                res_v.append(np.abs(r[env.iv]) / env.dt)
                feats.append(np.abs(x - env.x_op))
                # Through the longest latency the actions sent but not yet applied are predicted too.
                xs, xm = x, x
                for _h in range(lat_max):
                    uh = env.draw_action()
                    xs, xm = env.wrap(plant.step(xs, env.applied(name, uh))), env.predict(xm, uh)
                rp = (
                    env.wrap(plant.step(xs, env.applied(name, u)) - env.predict(xm, u) + env.x_op) - env.x_op
                    if lat_max
                    else r
                )
                res_p.append(np.abs(rp[env.ip]))
                if pushed is not None and rng.random() < 0.1:
                    base = plant.step(x, u)
                    for axis in pushed[1]:
                        for sign in (-1.0, 1.0):
                            f = np.zeros(3)
                            f[axis] = sign * pushed[2]
                            kicked = plant.step(x, u, (pushed[0], f))
                            push_k = np.maximum(push_k, np.abs(kicked[env.iv] - base[env.iv]) / env.dt)
        push_accel[name] = [float(p) * INFLATION for p in push_k]
        sets_info[name] = {
            "plants": len(doms),
            "samples": per_dom * len(doms),
            "corners": len(doms) - draws,
            "draws": draws,
        }
    res_v, res_p, feats = np.array(res_v), np.array(res_p), np.array(feats)
    noise = _noise_margin(cfg, env.safety)
    names = cfg.observation_names(env.pos)
    return Measurement(
        task=cfg.task.name,
        positions=env.pos,
        names=names,
        full_accel=env.nominal_full,
        state_names=dict(zip(env.state_index, cfg.observation_names(env.state_index))),
        gain_range=[(min(g), max(g)) if g else (1.0, 1.0) for g in gains],
        residual_accel=[float(res_v[:, k].max()) * INFLATION for k in range(len(env.pos))],
        residual_law=[
            _residual_law(res_v[:, k], feats, cfg.observation_names(env.state_index), env.x_op)
            for k in range(len(env.pos))
        ],
        residual_pos=[float(res_p[:, k].max()) * INFLATION for k in range(len(env.pos))],
        authority=authority,
        authority_at=authority_at,
        push_accel=push_accel,
        noise_margin=noise,
        samples=len(res_v),
        domains=n_domains,
        speed_bound=env.speed,
        latency_steps=lat_max,
        dt=env.dt,
        wall_s=time.monotonic() - t0,
        sets=sets_info,
        gain_at=gain_at,
    )


def _pushed(env: EnvelopeSampler, rset):
    """(body id, world axes, force N) of a set's push, or None."""
    if rset.push is None:
        return None
    import mujoco

    from envs.randomization import AXIS_INDEX

    body = mujoco.mj_name2id(env.plants[next(iter(env.plants))].model, mujoco.mjtObj.mjOBJ_BODY, rset.push.body)
    return body, [AXIS_INDEX[a] for a in rset.push.axes], float(rset.push.max_force)


def input_effect(env: EnvelopeSampler, plant: SteppedPlant, x: np.ndarray, k: int) -> float | None:
    """Position k's response to its main input at full either way, over the nominal model's (None: no input moves
    it in the nominal model)."""
    j, i = env.iv[k], env.main_in[k]
    e = np.zeros(len(env.full))
    e[i] = env.full[i]
    effect = 2.0 * env.B[j, i] * env.full[i]
    if abs(effect) <= 1e-12:
        return None
    return float((plant.step(x, e)[j] - plant.step(x, -e)[j]) / effect)


def _gain_samples(
    env: EnvelopeSampler, plant: SteppedPlant, x: np.ndarray, driven: list, gains: list, gain_at: list, where: dict
) -> dict[int, float]:
    """Per position its main input drives (`driven`: `driven_positions`), the input effect at x (`input_effect`),
    recorded in `gains`, and where the weakest so far was (`gain_at`). Returns {position: effect} at x."""
    here = {}
    for k in driven:
        g = input_effect(env, plant, x, k)
        if g is None:
            continue
        if g < gain_at[k].get("effect", math.inf):
            state = {str(o): round(float(x[env.col[o]]), 4) for o in env.state_index}
            gain_at[k] = {**where, "state": state, "effect": g}
        gains[k].append(g)
        here[k] = g
    return here


def _noise_margin(cfg, safety: dict) -> float:
    constrained = sorted({i for con in safety["constraints"] for i in constraint_obs(con)})
    noise = 0.0
    for rset in cfg.randomization.values():
        std = list(rset.obs_noise_std)
        for o in constrained:
            s = std[0] if len(std) == 1 else (std[o] if o < len(std) else 0.0)
            noise = max(noise, NOISE_SIGMAS * s)
    return noise


def _residual_law(res: np.ndarray, feats: np.ndarray, names: list[str], x_op: np.ndarray) -> dict:
    """The bound ``accel + per_unit * f(x)`` on every sample's |res| that is smallest on average, f one state
    coordinate's distance from the operating point or its square: ``accel`` is the most where f is small (its
    lowest quarter), ``per_unit`` the most any sample needs beyond it; "constant" when no such law is smaller."""
    best = {"accel": float(res.max()) * INFLATION, "per_unit": 0.0, "feature": "constant"}
    mean_best = best["accel"]
    for j in range(feats.shape[1]):
        for power in (1, 2):
            f = feats[:, j] ** power
            small = f <= np.quantile(f, 0.25)
            a = float(res[small].max()) if small.any() else 0.0
            with np.errstate(divide="ignore", invalid="ignore"):
                b = float(np.max(np.where(f > 1e-9, (res - a) / np.maximum(f, 1e-9), 0.0), initial=0.0))
            b = max(b, 0.0)
            if np.any(res > a + b * f + 1e-9):
                continue
            mean = float(np.mean(a + b * f)) * INFLATION
            if mean < mean_best:
                mean_best = mean
                best = {
                    "accel": round(a * INFLATION, 4),
                    "per_unit": round(b * INFLATION, 4),
                    "feature": (f"|{names[j]}|" if x_op[j] == 0.0 else f"|{names[j]} - {x_op[j]:g}|")
                    + ("^2" if power == 2 else ""),
                }
    return best


def derived_numbers(meas: Measurement) -> dict:
    """The shield numbers a measurement gives: margin, input_gain_error, disturbance_accel, brake_accel (pairs)."""
    brake = [
        [_round_down(min(a, VIABLE_BRAKING * meas.full_accel[k])) for a in pair]
        for k, pair in enumerate(meas.authority)
    ]
    lo = _round_down(min(lo for lo, _ in meas.gain_range))
    hi = _round_up(max(hi for _, hi in meas.gain_range))
    return {
        "margin": _round_up(meas.margin()),
        "input_gain_error": _round_up(max(1.0 - lo, hi - 1.0)),
        "input_gain_range": [min(lo, 1.0), max(hi, 1.0)],
        "disturbance_accel": [_round_up(w) for w in meas.residual_accel],
        "brake_accel": brake,
    }


def _round_up(v: float, digits: int = 3) -> float:
    return math.ceil(v * 10**digits - 1e-9) / 10**digits


def _round_down(v: float, digits: int = 3) -> float:
    return math.floor(v * 10**digits + 1e-9) / 10**digits


def describe_state(meas: Measurement, at: dict) -> str:
    """Where a measured figure was, in words: the set, the plant's parameters at the ends, the state."""
    if not at:
        return "nowhere sampled"
    dom = ", ".join(f"{k} {v:.3g}x" for k, v in sorted(at.get("domain", {}).items())) or "nominal"
    state = ", ".join(
        f"{meas.state_names.get(int(o), 'obs[' + o + ']')} {v:.3g}" for o, v in at.get("state", {}).items()
    )
    return f"set {at.get('set')}, {dom}, at {state}"


def authority_problems(meas: Measurement) -> list[tuple[int, int, str]]:
    """(position k, direction d, reason) where the weakest plant cannot brake at all: full action toward that side
    still leaves the position accelerating the other way at some admitted state."""
    out = []
    for k, pair in enumerate(meas.authority):
        for d, side in enumerate(("-", "+")):
            if pair[d] <= 0.0:
                bound = "upper" if d == 0 else "lower"
                reason = (
                    f"full action cannot brake {meas.names[k]} (obs[{meas.positions[k]}]) moving toward its "
                    f"{bound} bound: what the rest of the plant does to it (a payload's pull, a coupling, "
                    f"gravity, or the other inputs at full action braking their own positions, as a thrust turned "
                    f"with a heading does) outweighs the actuator, which still leaves it accelerating "
                    f"{abs(pair[d]):.3g} units/s^2 toward that bound ({describe_state(meas, meas.authority_at[k][d])})"
                )
                out.append((k, d, reason))
    return out


def gain_problems(meas: Measurement) -> list[tuple[int, None, str]]:
    """(position k, None, reason) where the weakest measured input effect is below what a shield model takes: at
    1 - MAX_INPUT_GAIN_ERROR x nominal the input hardly moves the plant, and no filter can count on it."""
    out = []
    for k, (lo, _hi) in enumerate(meas.gain_range):
        if 1.0 - _round_down(lo) > MAX_INPUT_GAIN_ERROR + 1e-12:
            reason = (
                f"the drive's effect on {meas.names[k]} (obs[{meas.positions[k]}]) goes down to {lo:.3g}x nominal "
                f"({describe_state(meas, meas.gain_at[k] if k < len(meas.gain_at) else {})}); a shield model "
                f"takes an input down to {1.0 - MAX_INPUT_GAIN_ERROR:.2g}x nominal, below which the input hardly "
                f"moves the plant"
            )
            out.append((k, None, reason))
    return out


def override_problems(cfg, meas: Measurement, spec: dict) -> list[str]:
    """Every hand-set shield number that does not cover what synthesis measured, naming the key and the figure."""
    sc, problems = cfg.shield, []
    if sc.margin is not None and sc.margin + 1e-9 < meas.margin():
        problems.append(
            f"shield.margin = {sc.margin:g} does not cover the measured {meas.margin():.4g} "
            f"({NOISE_SIGMAS:g} sigma of the constrained observations' noise {meas.noise_margin:.4g} "
            f"plus the position error through the latency that the disturbance bound leaves)"
        )
    if sc.input_gain_error is not None:
        for k, (lo, hi) in enumerate(meas.gain_range):
            if lo < 1.0 - sc.input_gain_error - 1e-9 or hi > 1.0 + sc.input_gain_error + 1e-9:
                problems.append(
                    f"shield.input_gain_error = {sc.input_gain_error:g} does not cover the measured "
                    f"input effect on {meas.names[k]}: {lo:.3f} .. {hi:.3f} x nominal"
                )
    pairs = spec["kinematics"]["brake_accel"]
    key = "shield.brake_accel" if sc.brake_accel is not None else "shield.brake_fraction"
    slack = []
    for k in range(len(meas.positions)):
        p = pairs[k] if isinstance(pairs[k], list) else [pairs[k], pairs[k]]
        slack.append(min(meas.authority[k][d] - p[d] for d in (0, 1)))
        if sc.brake_accel is None and sc.brake_fraction is None:
            continue
        for d, side in enumerate("-+"):
            if p[d] > meas.authority[k][d] + 1e-9:
                problems.append(
                    f"{key}: the shield brakes {meas.names[k]} toward {side} at {p[d]:g}, but the "
                    f"weakest plant measurably reaches {meas.authority[k][d]:.4g} at full action "
                    f"({describe_state(meas, meas.authority_at[k][d])})"
                )
    if sc.disturbance_accel is not None:
        for k in range(len(meas.positions)):
            w = sc.disturbance_accel[k] if k < len(sc.disturbance_accel) else 0.0
            if w + max(slack[k], 0.0) + 1e-9 < meas.residual_accel[k]:
                problems.append(
                    f"shield.disturbance_accel[{k}] = {w:g}: the nominal model's error on "
                    f"{meas.names[k]} measures up to {meas.residual_accel[k]:.4g} units/s^2, more than "
                    f"it and the braking slack {max(slack[k], 0.0):.4g} cover together"
                )
    return problems


def measurement_from_json(data: dict) -> Measurement:
    """A Measurement from `dataclasses.asdict` of one through JSON (pairs back to tuples, indices back to int)."""
    data = dict(data)
    data["state_names"] = {int(k): v for k, v in data["state_names"].items()}
    for name in ("gain_range", "authority", "authority_at"):
        data[name] = [tuple(pair) for pair in data[name]]
    return Measurement(**data)


_CACHE: dict[tuple, Measurement] = {}


def cached_measure(cfg) -> Measurement:
    """`measure(cfg)`, once per config content in this process (every spec build of one config agrees), and on
    disk across processes (`pipeline.safety.cache`)."""
    from pipeline.safety.cache import cached

    key = (cfg.config_hash(),)
    if key not in _CACHE:
        _CACHE[key] = cached("measurement", cfg, lambda: measure(cfg), asdict, measurement_from_json)
    return _CACHE[key]
