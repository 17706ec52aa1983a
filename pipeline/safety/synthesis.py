"""Shield synthesis: measure, from the MJCF and the config's randomization sets alone, what the shield needs.

For a plant whose shield model is ``linear`` (MuJoCo's finite differences at the
operating point over one control period, every coupling the MJCF has included),
this simulates the whole envelope and measures:

- the model error: one-step prediction residuals of the nominal model, per state
  coordinate, at states inside the constraints (and as far out as the plant goes
  on the coordinates no constraint bounds) and actions in the box, on every set's
  corners (sampled when there are many) and random draws; the residual of a
  velocity as an acceleration (units/s^2), with the state-dependent law that
  bounds it best (``a + b f(x)``, f a coordinate's magnitude or a speed squared),
  and the position residual over the longest latency plus one step;
- the input's effect relative to nominal, per position, as it is (low, high);
- the braking authority each position really has toward each direction: the
  weakest plant's full action toward it, the other inputs at their worst, over
  the half of the constraint nearer the bound that braking protects;
- each set's push, as the acceleration it gives each position where it is
  measured (a push on a payload moves the swing, not the world axis it is along).

`derive` turns a measurement into the numbers a shield spec needs; `override_problems`
holds hand-set numbers to it. Nothing here is tuned: every figure is a max or min over
simulated samples, with the stated sample counts (`Measurement.record`).
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from pipeline.safety.envelope import NOISE_SIGMAS

# The max of N draws bounds the (1 - ln(1/delta) / N) quantile of what it measures with confidence 1 - delta;
# the bound the spec uses is that max times INFLATION, since a finite sample never reaches the true supremum.
CONFIDENCE = 0.95
INFLATION = 1.2
MAX_CORNERS = 64  # per set: all 2^d corners up to this many, else this many sampled corners
VIABLE_BRAKING = 1.5  # x the nominal full-action acceleration: the most braking a synthesized barrier counts on
ROLLOUT_EPISODES = 4  # per corner, open-loop random bang-bang runs that find how fast the plant goes


class SynthesisError(ValueError):
    """The plant or config cannot be synthesized for (names the key or the task)."""


@dataclass
class Measurement:
    """What `measure` found; per position lists follow `positions` (observation indices)."""

    task: str
    positions: list[int]
    velocities: list[int]
    full_accel: list[float]  # nominal full-action acceleration per position (units/s^2)
    gain_range: list[tuple[float, float]]  # measured input effect / nominal per position: (low, high)
    residual_accel: list[float]  # per position: bound on the velocity residual as an acceleration (units/s^2)
    residual_law: list[dict]  # per position: {"accel", "per_unit", "feature"}: accel + per_unit * feature(x)
    residual_pos: list[float]  # per position: position residual over latency + 1 steps (units)
    authority: list[tuple[float, float]]  # per position (toward -, toward +): weakest full-action accel
    authority_at: list[tuple[dict, dict]]  # where each authority minimum was: {set, domain, state}
    push_accel: dict[str, list[float]]  # per set, per position (units/s^2)
    noise_margin: float  # NOISE_SIGMAS x the largest noise std of a constrained observation
    samples: int  # residual samples over all sets
    domains: int  # plants simulated
    speed_bound: list[float]  # per velocity coordinate of the state: how fast the plant went (sampling range)
    wall_s: float = 0.0
    sets: dict = field(default_factory=dict)  # per set: samples, corners, draws

    def gain_error(self) -> float:
        """The symmetric relative error the CBF's two gain cases need to cover every measured (low, high)."""
        return max([max(1.0 - lo, hi - 1.0) for lo, hi in self.gain_range] + [0.0])

    def margin(self) -> float:
        """Noise at NOISE_SIGMAS plus the largest position residual through the latency."""
        return self.noise_margin + max(self.residual_pos + [0.0])

    def record(self) -> dict:
        """The measurement as the certificate and the spec's assumptions state it."""
        q = 1.0 - math.log(1.0 / (1.0 - CONFIDENCE)) / max(1, self.samples // max(1, len(self.sets)))
        return {
            "method": "one-step and latency+1-step prediction residuals of the nominal linear model, simulated in "
                      "MuJoCo at states inside the constraints and actions in the box, on every randomization "
                      "set's corners and random draws",
            "samples": self.samples, "domains": self.domains, "sets": self.sets,
            "confidence": f"per set, the max of its samples bounds the {q:.4f} quantile with confidence "
                          f"{CONFIDENCE:g}; bounds are that max x {INFLATION:g}",
            "positions": self.positions,
            "input_gain_range": [list(r) for r in self.gain_range],
            "residual_accel": self.residual_accel, "residual_law": self.residual_law,
            "residual_position": self.residual_pos,
            "authority_accel": [list(a) for a in self.authority],
            "authority_at": [list(a) for a in self.authority_at],
            "push_accel": self.push_accel, "noise_margin": self.noise_margin,
            "speed_bound": self.speed_bound, "wall_s": round(self.wall_s, 2),
        }


def range_parameters(rset) -> list[tuple[str, float, float]]:
    """(name, low, high) of every randomized physical scale of a set (the names `DomainRandomizer.apply` reads)."""
    out = []
    for group in ("body_mass", "geom_friction", "joint_damping", "actuator_gain"):
        for element, r in getattr(rset, group).items():
            out.append((f"{group}.{element}", float(r.low), float(r.high)))
    if rset.gravity_scale is not None:
        out.append(("gravity_scale", float(rset.gravity_scale.low), float(rset.gravity_scale.high)))
    return out


def set_domains(rset, rng: np.random.Generator, draws: int) -> list[dict]:
    """The set's corners (all, or MAX_CORNERS sampled when 2^d is larger), its nominal-most point and random draws."""
    from envs.randomization import sample_domain

    params = range_parameters(rset)
    d = len(params)
    if 2 ** d <= MAX_CORNERS:
        bits = list(itertools.product((0, 1), repeat=d))
    else:
        bits = [tuple(rng.integers(0, 2, d)) for _ in range(MAX_CORNERS)]
    out = [{n: (lo, hi)[b] for (n, lo, hi), b in zip(params, corner)} for corner in bits]
    for _ in range(draws):
        dom = sample_domain(rset, rng)
        dom.pop("latency_steps", None)
        out.append(dom)
    return out


class _Plant:
    """The nominal MJCF with one domain applied, stepped one control period from any state."""

    def __init__(self, nominal, rset):
        import mujoco

        from envs.domain import DomainRandomizer

        self._mj = mujoco
        self.model = copy.copy(nominal.model)
        self.data = mujoco.MjData(self.model)
        self.substeps = nominal.substeps
        self._randomizer = DomainRandomizer(self.model, rset)

    def apply(self, domain: dict) -> None:
        self._randomizer.apply(domain)

    def step(self, qpos: np.ndarray, qvel: np.ndarray, ctrl: np.ndarray, force: tuple | None = None) -> tuple:
        """(qpos, qvel) one control period later; `force`: (body id, world force N) held over it."""
        d = self.data
        d.qpos[:], d.qvel[:], d.ctrl[:] = qpos, qvel, ctrl
        d.act[:] = 0.0
        d.xfrc_applied[:] = 0.0
        if force is not None:
            d.xfrc_applied[force[0], :3] = force[1]
        for _ in range(self.substeps):
            self._mj.mj_step(self.model, d)
        return d.qpos.copy(), d.qvel.copy()


def _wrap(delta: np.ndarray, angle_cols: list[int]) -> np.ndarray:
    if angle_cols:
        delta[..., angle_cols] = (delta[..., angle_cols] + np.pi) % (2 * np.pi) - np.pi
    return delta


def measure(cfg, samples: int | None = None, seed: int = 0, draws: int = 16) -> Measurement:
    """Simulate `cfg`'s envelope and measure the nominal model's error, input gain, braking authority and pushes.

    Deterministic for a config and seed (the spec it leads to is the same at export and at eval)."""
    import envs
    from pipeline.safety.shield_spec import _unlimited_angles, linearize_mujoco

    t0 = time.monotonic()
    env_id = cfg.task.env_id
    safety = envs.safety_spec(env_id)
    if safety["model"] != "linear":
        raise SynthesisError(f"task {cfg.task.name}: shield synthesis measures linear shield models "
                             f"(plant.shield_model.type: linear); this task's is {safety['model']!r}: set "
                             f"shield.margin, brake_accel (or brake_fraction), disturbance_accel and input_gain_error")
    samples = int(samples or cfg.shield.synthesis_samples)
    rng = np.random.default_rng(seed)
    nominal = envs.nominal_model(env_id)
    state_index = sorted(nominal.obs_to_state)
    A, B, c = linearize_mujoco(nominal, state_index)
    dt = float(safety["dt"])
    pos = list(safety["kinematics"]["position_index"])
    vel = list(safety["kinematics"]["velocity_index"])
    col = {o: j for j, o in enumerate(state_index)}
    ip, iv = [col[o] for o in pos], [col[o] for o in vel]
    n, model = len(state_index), nominal.model
    low = np.asarray(safety["action_low"], np.float64)
    high = np.asarray(safety["action_high"], np.float64)
    full = np.maximum(np.abs(low), np.abs(high))
    angle_cols = [col[o] for o, _ in _unlimited_angles(nominal, state_index)]
    # Each shield-state column as (qpos or qvel, index); every state of the plant is a shield state (nq == nv).
    src = [nominal.obs_to_state[o] for o in state_index]
    qcols = {i: j for j, (kind, i) in enumerate(src) if kind == "qpos"}
    vcols = {i: j for j, (kind, i) in enumerate(src) if kind == "qvel"}
    if len(qcols) != model.nq or len(vcols) != model.nv:
        raise SynthesisError(f"task {cfg.task.name}: synthesis needs every joint's position and velocity observed "
                             f"(plant.observations), so a sampled shield state is a whole plant state")
    box = _constraint_box(safety, state_index, col)
    x_op = np.array([nominal.qpos[i] if kind == "qpos" else nominal.qvel[i] for kind, i in src])
    lat_max = max([r.latency_steps.high for r in cfg.randomization.values() if r.latency_steps is not None] + [0])

    def split(x):
        qp, qv = np.zeros(model.nq), np.zeros(model.nv)
        for i, j in qcols.items():
            qp[i] = x[j]
        for i, j in vcols.items():
            qv[i] = x[j]
        return qp, qv

    def join(qp, qv):
        x = np.zeros(n)
        for i, j in qcols.items():
            x[j] = qp[i]
        for i, j in vcols.items():
            x[j] = qv[i]
        return x

    def predict(x, u):
        return A @ x + B @ u + c

    # 1. How far and fast the plant goes: open-loop random bang-bang from the declared initial states, each set's
    #    corners, cut where a constrained coordinate leaves its bound (the shield keeps it inside).
    plants, domains_of = {}, {}
    reach_lo, reach_hi = x_op.copy(), x_op.copy()
    steps = int(getattr(cfg.task, "max_episode_steps", None) or 250)
    for name, rset in cfg.randomization.items():
        plants[name] = _Plant(nominal, rset)
        domains_of[name] = set_domains(rset, rng, draws)
        for dom in domains_of[name][:MAX_CORNERS][::max(1, len(domains_of[name]) // 8)]:
            plants[name].apply(dom)
            for _ in range(ROLLOUT_EPISODES):
                x = x_op + rng.uniform(-0.05, 0.05, n)
                hold, u = 0, np.zeros(len(full))
                for _t in range(steps):
                    if hold <= 0:
                        u, hold = rng.choice([-1.0, 1.0], len(full)) * full, int(rng.integers(1, 15))
                    hold -= 1
                    x = _wrap(join(*plants[name].step(*split(x), u)) - x_op, angle_cols) + x_op
                    if not np.all(np.isfinite(x)) or np.any(x < box[0]) or np.any(x > box[1]):
                        break
                    reach_lo, reach_hi = np.minimum(reach_lo, x), np.maximum(reach_hi, x)
    lo_s = np.where(np.isfinite(box[0]), box[0], reach_lo)
    hi_s = np.where(np.isfinite(box[1]), box[1], reach_hi)
    for j in angle_cols:  # an unbounded angle that turns without limit is anywhere on its circle
        if not np.isfinite(box[0][j]):
            lo_s[j] = x_op[j] - np.pi
        if not np.isfinite(box[1][j]):
            hi_s[j] = x_op[j] + np.pi
    speed = np.maximum(np.abs(reach_lo - x_op), np.abs(reach_hi - x_op))

    # A state moving toward a bound faster than VIABLE_BRAKING x the nominal full-action braking can stop in the
    # distance left is outside the safe set of every barrier whose braking is below that (the spec's braking is
    # capped there): no shield keeps it, none needs its model error.
    reach = [VIABLE_BRAKING * float(np.abs(B[j]) @ full) / dt for j in iv]

    def draw_state():
        x = rng.uniform(lo_s, hi_s)
        ends = rng.random(n) < 0.25  # a quarter of each coordinate's draws at an end of its range
        x[ends] = np.where(rng.random(ends.sum()) < 0.5, lo_s[ends], hi_s[ends])
        for p, v, a in zip(ip, iv, reach):
            room = (hi_s[p] - x[p]) if x[v] > 0 else (x[p] - lo_s[p])
            if np.isfinite(box[0][p]) and np.isfinite(box[1][p]):
                x[v] = np.sign(x[v]) * min(abs(x[v]), math.sqrt(2.0 * a * max(room, 0.0)))
        return x

    def draw_action():
        return rng.choice([-1.0, 1.0], len(full)) * full if rng.random() < 0.5 else rng.uniform(low, high)

    # 2. Residuals, input gain and pushes, per set.
    main_in = [int(np.argmax(np.abs(B[j]) * full)) for j in iv]
    res_v, res_p, feats, gains = [], [], [], [[] for _ in pos]
    push_accel, sets_info, n_domains = {}, {}, 0
    for name, rset in cfg.randomization.items():
        plant, doms = plants[name], domains_of[name]
        n_domains += len(doms)
        pushed = None
        if rset.push is not None:
            import mujoco

            from envs.randomization import AXIS_INDEX
            body = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, rset.push.body)
            pushed = (body, [AXIS_INDEX[a] for a in rset.push.axes], float(rset.push.max_force))
        push_k = np.zeros(len(pos))
        per_dom = max(1, samples // len(doms))
        for dom in doms:
            plant.apply(dom)
            for _ in range(per_dom):
                x, u = draw_state(), draw_action()
                qp, qv = split(x)
                x1 = join(*plant.step(qp, qv, u))
                r = _wrap(x1 - predict(x, u), angle_cols)
                res_v.append(r[iv] / dt)
                feats.append(np.abs(x - x_op))
                # Position error through the longest latency: the actions sent but not applied are predicted.
                xs, xm = x, x
                for _h in range(lat_max):
                    uh = draw_action()
                    xs = _wrap(join(*plant.step(*split(xs), uh)) - x_op, angle_cols) + x_op
                    xm = predict(xm, uh)
                rp = _wrap((join(*plant.step(*split(xs), u)) if lat_max else x1) - (predict(xm, u)), angle_cols)
                res_p.append(np.abs(rp[ip]))
                if rng.random() < 0.25:  # input gain: the response to full action either way, against nominal
                    for k, j in enumerate(iv):
                        e = np.zeros(len(full))
                        e[main_in[k]] = full[main_in[k]]
                        up = join(*plant.step(qp, qv, np.clip(u * 0 + e, low, high)))[j]
                        dn = join(*plant.step(qp, qv, np.clip(u * 0 - e, low, high)))[j]
                        nominal_effect = 2 * B[j, main_in[k]] * full[main_in[k]]
                        if abs(nominal_effect) > 1e-12:
                            gains[k].append((up - dn) / nominal_effect)
                if pushed is not None and rng.random() < 0.1:
                    base = join(*plant.step(qp, qv, u))
                    for axis in pushed[1]:
                        for sign in (-1.0, 1.0):
                            f = np.zeros(3)
                            f[axis] = sign * pushed[2]
                            kicked = join(*plant.step(qp, qv, u, (pushed[0], f)))
                            push_k = np.maximum(push_k, np.abs(kicked[iv] - base[iv]) / dt)
        push_accel[name] = [float(p) * INFLATION for p in push_k]
        sets_info[name] = {"plants": len(doms), "samples": per_dom * len(doms),
                           "corners": min(2 ** len(range_parameters(rset)), MAX_CORNERS), "draws": draws}
    res_v, res_p, feats = np.abs(np.array(res_v)), np.array(res_p), np.array(feats)

    # 3. Braking authority: full action toward each direction, the other inputs at their worst, over the half of
    #    the position's constraint nearer the bound the braking protects, moving toward that bound.
    authority, authority_at = [], []
    for k, (p, v) in enumerate(zip(ip, iv)):
        pair, where = [], []
        for d, sign in ((0, -1.0), (1, 1.0)):
            worst, at = np.inf, {}
            j_main = main_in[k]
            others = [j for j in range(len(full)) if j != j_main]
            for name, rset in cfg.randomization.items():
                plant = plants[name]
                for dom in domains_of[name]:
                    plant.apply(dom)
                    for _ in range(max(4, samples // (8 * len(domains_of[name])))):
                        x = draw_state()
                        mid = 0.5 * (lo_s[p] + hi_s[p])
                        # braking toward - protects the upper bound: states in its upper half, moving up
                        x[p] = rng.uniform(mid, hi_s[p]) if sign < 0 else rng.uniform(lo_s[p], mid)
                        if rng.random() < 0.25:
                            x[p] = hi_s[p] if sign < 0 else lo_s[p]
                        x[v] = -sign * abs(x[v])
                        qp, qv = split(x)
                        for rest in itertools.product((-1.0, 1.0), repeat=len(others)):
                            u = np.zeros(len(full))
                            u[j_main] = sign * np.sign(B[v, j_main]) * full[j_main]
                            for j, s in zip(others, rest):
                                u[j] = s * full[j]
                            a = sign * (join(*plant.step(qp, qv, u))[v] - x[v]) / dt
                            if a < worst:
                                worst, at = a, {"set": name, "domain": dict(dom),
                                                "state": {str(o): float(x[col[o]]) for o in state_index}}
            pair.append(float(worst))
            where.append(at)
        authority.append(tuple(pair))
        authority_at.append(tuple(where))

    residual_accel = [float(res_v[:, k].max()) * INFLATION for k in range(len(pos))]
    laws = [_residual_law(res_v[:, k], feats, state_index, n) for k in range(len(pos))]
    noise = 0.0
    constrained = sorted({i for con in safety["constraints"] for i in _constraint_obs(con)})
    for rset in cfg.randomization.values():
        std = list(rset.obs_noise_std)
        for o in constrained:
            s = std[0] if len(std) == 1 else (std[o] if o < len(std) else 0.0)
            noise = max(noise, NOISE_SIGMAS * s)
    nominal_full = [float((np.abs(B[j]) * full).sum() / dt) for j in iv]
    gain_range = [(min(g) if g else 1.0, max(g) if g else 1.0) for g in gains]
    return Measurement(
        task=cfg.task.name, positions=pos, velocities=vel, full_accel=nominal_full, gain_range=gain_range,
        residual_accel=residual_accel, residual_law=laws,
        residual_pos=[float(res_p[:, k].max()) * INFLATION for k in range(len(pos))],
        authority=authority, authority_at=authority_at, push_accel=push_accel, noise_margin=noise,
        samples=len(res_v), domains=n_domains, speed_bound=[float(speed[j]) for j in iv],
        wall_s=time.monotonic() - t0, sets=sets_info)


def _constraint_obs(con: dict) -> list[int]:
    if con["type"] == "halfspace":
        return [i for i, a in enumerate(con["a"]) if a != 0.0]
    return list(con["index"])


def _constraint_box(safety: dict, state_index: list[int], col: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per shield-state column, the bounds box constraints put on it (+-inf where none)."""
    lo, hi = np.full(len(state_index), -np.inf), np.full(len(state_index), np.inf)
    for con in safety["constraints"]:
        if con["type"] != "box":
            continue
        for o, a, b in zip(con["index"], con["low"], con["high"]):
            if o in col:
                lo[col[o]], hi[col[o]] = max(lo[col[o]], a), min(hi[col[o]], b)
    return lo, hi


def _residual_law(res: np.ndarray, feats: np.ndarray, state_index: list[int], n: int) -> dict:
    """The bound ``accel + per_unit * f(x)`` on |res| over every sample that is smallest on average, f one
    coordinate's distance from the operating point or its square (a pull growing with a speed squared):
    ``accel`` holds where f is small, ``per_unit`` the most any sample needs beyond it."""
    best = {"accel": float(res.max()) * INFLATION, "per_unit": 0.0, "feature": "constant"}
    mean_best = best["accel"]
    for j in range(n):
        for power in (1, 2):
            f = feats[:, j] ** power
            small = f <= np.quantile(f, 0.25)
            a = float(res[small].max()) if small.any() else 0.0
            with np.errstate(divide="ignore", invalid="ignore"):
                b = float(np.max(np.where(f > 1e-9, (res - a) / f, 0.0)))
            b = max(b, 0.0)
            if np.any(res > a + b * f + 1e-12):
                continue
            mean = float(np.mean(a + b * f)) * INFLATION
            if mean < mean_best:
                mean_best = mean
                best = {"accel": a * INFLATION, "per_unit": b * INFLATION,
                        "feature": f"|obs[{state_index[j]}] - operating point|" + ("^2" if power == 2 else "")}
    return best


def derived_numbers(meas: Measurement) -> dict:
    """The shield numbers a measurement gives: margin, input_gain_error, disturbance_accel, brake_accel (pairs)."""
    brake = []
    for k, pair in enumerate(meas.authority):
        brake.append([_round_down(min(a, VIABLE_BRAKING * meas.full_accel[k])) for a in pair])
    return {"margin": _round_up(meas.margin()), "input_gain_error": _round_up(meas.gain_error()),
            "disturbance_accel": [_round_up(w) for w in meas.residual_accel], "brake_accel": brake}


def _round_up(v: float, digits: int = 3) -> float:
    scale = 10 ** digits
    return math.ceil(v * scale - 1e-9) / scale


def _round_down(v: float, digits: int = 3) -> float:
    scale = 10 ** digits
    return math.floor(v * scale + 1e-9) / scale


def override_problems(cfg, meas: Measurement, spec: dict) -> list[str]:
    """Every hand-set shield number that does not cover what synthesis measured, naming the key and the figure."""
    sc, problems = cfg.shield, []
    if sc.margin is not None and sc.margin + 1e-9 < meas.margin():
        problems.append(f"shield.margin = {sc.margin:g} does not cover the measured {meas.margin():.4g} "
                        f"({NOISE_SIGMAS:g} sigma of the constrained observations' noise {meas.noise_margin:.4g} plus "
                        f"the largest position residual through the latency {max(meas.residual_pos):.4g})")
    if sc.input_gain_error is not None:
        for k, (lo, hi) in enumerate(meas.gain_range):
            if lo < 1.0 - sc.input_gain_error - 1e-9 or hi > 1.0 + sc.input_gain_error + 1e-9:
                problems.append(f"shield.input_gain_error = {sc.input_gain_error:g} does not cover the measured input "
                                f"effect on position obs[{meas.positions[k]}]: {lo:.3f} .. {hi:.3f} x nominal")
    pairs = spec["kinematics"]["brake_accel"]
    key = "shield.brake_accel" if sc.brake_accel is not None else "shield.brake_fraction"
    slack = []
    for k, o in enumerate(meas.positions):
        p = pairs[k] if isinstance(pairs[k], list) else [pairs[k], pairs[k]]
        slack.append(min(meas.authority[k][d] - p[d] for d in (0, 1)))
        for d, sign in enumerate("-+"):
            if sc.brake_accel is None and sc.brake_fraction is None:
                continue
            if p[d] > meas.authority[k][d] + 1e-9:
                problems.append(f"{key}: the shield brakes position obs[{o}] toward {sign} at {p[d]:g}, but the "
                                f"weakest plant measurably reaches {meas.authority[k][d]:.4g} at full action "
                                f"({_where(meas.authority_at[k][d])})")
    if sc.disturbance_accel is not None:
        for k, o in enumerate(meas.positions):
            w = sc.disturbance_accel[k] if k < len(sc.disturbance_accel) else 0.0
            if w + max(slack[k], 0.0) + 1e-9 < meas.residual_accel[k]:
                problems.append(f"shield.disturbance_accel[{k}] = {w:g}: the nominal model's error on position "
                                f"obs[{o}] measures up to {meas.residual_accel[k]:.4g} units/s^2, more than it and "
                                f"the braking slack {max(slack[k], 0.0):.4g} cover together")
    return problems


def _where(at: dict) -> str:
    if not at:
        return "nowhere sampled"
    dom = ", ".join(f"{k} {v:.3g}" for k, v in sorted(at.get("domain", {}).items())) or "nominal"
    return f"set {at.get('set')}: {dom}"
