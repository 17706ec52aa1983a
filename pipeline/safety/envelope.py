"""The plants a config admits, per randomization set, and whether the shield's assumptions cover them.

Every randomization set in the config (not only `train`) is a promise about
where the plant may be. For each set this derives, from its ranges and the
nominal MuJoCo model:

- the latency range (control steps),
- the input's effect relative to nominal, ``r = actuator gain / mass`` (gear-
  weighted mean gain over mass-weighted mean mass of the moving bodies), from
  the worst corner (weakest actuators on the heaviest body) to the best,
- the persistent additive acceleration per position that the shield's model
  does not predict: for an acceleration-set-point (double-integrator) plant
  whose inner loop compensates gravity g_c = -g for the nominal mass, the plant
  feels ``r (u + g_c) - s g_c`` (s: the set's gravity scale); the model's
  input-gain cases scale u and g_c together (`gain_scaled_accel`), so what is
  left is ``|1 - s| |g_k|``, plus the ambient disturbance the config declares
  (`shield.ambient_disturbance_accel`: the quadrotor's built-in wind),
- the transient acceleration of a push: ``max_force / (lightest moving mass)`` on
  each pushed axis,
- the observation noise per element (std; the margin is checked at 3 sigma),
- every other randomized physical parameter (damping, friction, gravity) against
  the ranges the shield's guarantee was established for (`shield.model_ranges`).

`envelope_problems` lists every way a set leaves what the spec assumes, each
naming the set, the parameter, its range and the limit it breaks; the spec
builder refuses with them (`sim2real config --check`, `sim2real export`).
The limits checked, per position axis k, with full-action acceleration F_k:
latency <= latency_steps; [r_lo, r_hi] inside 1 +- input_gain_error;
persistent_k <= disturbance_accel_k; per direction, the weakest plant's full action toward it,
min over r in {r_lo, r_hi}, s in {s_lo, s_hi} of r (F_k +- g_c,k) -+ s g_c,k - ambient_k,
>= brake_accel_k toward that direction (enough authority to brake, or to hold a
floor against gravity); push_k <= the weaker direction's authority (the actuators
can cancel a push while it lasts); with `keepout_steering`, on each axis of a
keep-out zone sqrt(a^2 + push_k^2) <= that authority (a: the zone's braking);
3 sigma of the position noise <= margin.

Not a refusal but a term of the spec: where a push takes more than the braking margin
(authority - brake_accel) while it lasts, the speed it leaves, (push - margin) x its
duration, becomes the spec's `push_velocity` (the function of that name), which the barrier brakes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from envs.randomization import AXIS_INDEX
from shield.constraints import parse_constraints
from shield.spec import brake_pairs

NOISE_SIGMAS = 3.0  # the stated confidence of the observation-noise assumption: 3 sigma (99.7 % per sample)
_MODEL_RANGE_GROUPS = ("joint_damping", "geom_friction", "joint_stiffness", "joint_armature", "tendon_stiffness")


@dataclass
class SetEnvelope:
    """What one randomization set admits (see the module docstring)."""

    name: str
    latency_max: int
    latency_min: int
    ratio: tuple[float, float]
    persistent_accel: list[float]
    push_accel: list[float]
    obs_noise_std: list[float]
    other: dict[str, tuple[float, float]] = field(default_factory=dict)  # e.g. joint_damping.slider -> (lo, hi)
    # m/s^2 per position, (toward -, toward +): the weakest plant's full action against the persistent disturbance,
    # the other inputs through the coupling and (linear model) the declared model error
    authority: list[tuple[float, float]] = field(default_factory=list)
    moving_mass_low: float = 0.0  # kg: the lightest plant's moving mass
    push_duration_s: float = 0.0  # how long one push lasts


def _weighted_range(scales: dict, weights: dict[str, float]) -> tuple[float, float]:
    """(lowest, highest) weighted mean scale: every listed element at its low (high) end, the others at 1."""
    total = sum(weights.values())
    lo = sum(w * (scales[n].low if n in scales else 1.0) for n, w in weights.items()) / total
    hi = sum(w * (scales[n].high if n in scales else 1.0) for n, w in weights.items()) / total
    return lo, hi


def plant_weights(env_id: str) -> tuple[dict[str, float], dict[str, float], float, np.ndarray]:
    """Nominal masses of the moving bodies (kg), actuator gear magnitudes, moving mass (kg), gravity (m/s^2)."""
    import gymnasium as gym
    import mujoco

    import envs  # noqa: F401  (registers the task ids)

    env = gym.make(env_id)
    try:
        m = env.unwrapped.model
        masses = {}
        for b in range(1, m.nbody):
            name = mujoco.mj_id2name(m, mujoco.mjtObj.mjOBJ_BODY, b)
            if m.body_weldid[b] != 0 and m.body_mocapid[b] < 0 and m.body_mass[b] > 0 and name:  # a moving body
                masses[name] = float(m.body_mass[b])
        gears = {}
        for a in range(m.nu):
            name = mujoco.mj_id2name(m, mujoco.mjtObj.mjOBJ_ACTUATOR, a)
            if name:
                gears[name] = float(np.linalg.norm(m.actuator_gear[a, :3])) or 1.0
        return masses, gears, sum(masses.values()), np.asarray(m.opt.gravity, np.float64).copy()
    finally:
        env.close()


# How far a declared double integrator's nominal plant may answer from its model before the check refuses it:
# the gain it predicts with (relative), and any input's effect on another position (of that position's own).
MODEL_GAIN_TOLERANCE = 0.1
MODEL_CROSS_TOLERANCE = 0.1


def pushed_bodies(cfg) -> list[str]:
    """The bodies the config's randomization sets push (whose response `envs.measured_response` measures)."""
    return sorted({rset.push.body for rset in cfg.randomization.values() if rset.push is not None})


def declared_push_accel(measured: dict, rset, positions: list[int]) -> list[float]:
    """Per position, the acceleration a set's push gives a declared plant (`measured["push"]`: per newton along
    each world axis, measured on the pushed body), at its lightest: what the moving bodies' summed mass and
    position k = world axis k, which hold for the quadrotor, do not say of a declared plant."""
    p = rset.push
    if p is None:
        return [0.0] * len(positions)
    per_newton = measured["push"][p.body]
    m_lo = min([r.low for r in rset.body_mass.values()] + [1.0])
    return [p.max_force * sum(abs(per_newton[k][AXIS_INDEX[a]]) for a in p.axes) / m_lo for k in range(len(positions))]


def declared_model_problems(
    cfg,
    positions: list[int],
    accel_per_action: list[float],
    disturbance: list[float],
    response_time_s: float,
    measured: dict,
) -> list[str]:
    """Where a declared plant's `double_integrator` model (input j accelerates position j by accel_per_action[j]
    per unit action through the first-order lag response_time_s, nothing else moves it) is not what its MJCF
    does at nominal parameters (`envs.measured_response`): a stronger or weaker input, an input that moves
    another position (positions listed in another order than the actuators), an actuator lag other than the
    declared one, or a drift under zero action (gravity, a spring) anywhere the plant goes inside its
    constraints beyond `shield.disturbance_accel`, scaled by the sets' largest gravity scale. Empty when the
    model holds."""
    per_action, drift = np.asarray(measured["per_action"]), np.asarray(measured["drift"])
    s_hi = max([1.0] + [r.gravity_scale.high for r in cfg.randomization.values() if r.gravity_scale is not None])
    problems = []
    for j, lag in enumerate(measured["lag_s"]):
        if abs(lag - response_time_s) > MODEL_GAIN_TOLERANCE * max(lag, response_time_s):
            problems.append(
                f"plant.shield_model.response_time_s: {response_time_s:g} s, but actuator {j} has a "
                f"first-order lag of {lag:g} s in the MJCF (its filter's time constant): declare {lag:g}"
            )
    for k, o in enumerate(positions):
        declared, got = float(accel_per_action[k]), float(per_action[k, k]) if k < per_action.shape[1] else 0.0
        if abs(got - declared) > MODEL_GAIN_TOLERANCE * abs(declared):
            problems.append(
                f"plant.shield_model.accel_per_action[{k}]: declared {declared:g}, but a unit action of "
                f"input {k} accelerates position obs[{o}] by {got:.4g} units/s^2 in the MJCF at nominal "
                f"parameters (gear x units_per_action over what it moves, from rest): declare {got:.4g}"
            )
        for j in range(per_action.shape[1]):
            if j != k and abs(per_action[k, j]) > MODEL_CROSS_TOLERANCE * abs(declared):
                problems.append(
                    f"plant.kinematics.positions[{k}]: input {j} accelerates position obs[{o}] by "
                    f"{per_action[k, j]:.4g} units/s^2 per unit action; a double_integrator drives "
                    f"position k by input k alone: list the positions (and velocities) in the order "
                    f"of plant.actuators, or use shield_model: linear"
                )
        pull = abs(float(drift[k])) * s_hi
        if pull > disturbance[k] + 1e-6:
            problems.append(
                f"shield.disturbance_accel[{k}]: under zero action position obs[{o}] accelerates at up "
                f"to {drift[k]:.4g} units/s^2 in the MJCF (gravity, a spring) where the plant goes "
                f"inside its constraints ({measured['states']} states), x{s_hi:g} at the largest "
                f"gravity_scale, and the double_integrator model predicts none: declare at least "
                f"{pull:.4g}, compensate it in the plant, or use shield_model: linear"
            )
    return problems


def set_envelopes(
    cfg,
    positions: list[int],
    obs_dim: int,
    double_integrator: bool,
    full_accel: list[float],
    plant: tuple,
    cross_accel: list[float] | None = None,
    disturbance: list[float] | None = None,
    dt: float = 0.0,
    push_accel_of=None,
    ratio=None,
) -> list[SetEnvelope]:
    """One SetEnvelope per randomization set of `cfg`; `plant`: `plant_weights(cfg.task.env_id)`; `dt`: the control
    period (s), a push's duration is counted in.

    `cross_accel`: per position, what the inputs other than its strongest can do to it at full action (a
    coupled plant); `disturbance`: the spec's declared unknown additive acceleration per position. The
    authority to brake is the strongest input's, less both, at the weakest gain/mass. `push_accel_of(rset)`:
    per position, what the set's push gives the plant where it is measured (`declared_push_accel`); by default
    the push force over the moving bodies' mass, on world axis k = position k (the quadrotor). `ratio`: the input's
    effect over nominal (low, high) as synthesis measured it, instead of gear-weighted gain over moving mass."""
    masses, gears, moving_mass, gravity = plant
    ambient = list(cfg.shield.ambient_disturbance_accel or [0.0] * len(positions))
    cross = cross_accel or [0.0] * len(positions)
    declared = disturbance or [0.0] * len(positions)
    out = []
    for name, rset in cfg.randomization.items():
        m_lo, m_hi = _weighted_range(rset.body_mass, masses)
        g_lo, g_hi = _weighted_range(rset.actuator_gain, gears) if gears else (1.0, 1.0)
        grav = rset.gravity_scale
        s_lo, s_hi = (grav.low, grav.high) if grav is not None else (1.0, 1.0)
        ratio_set = ratio or (g_lo / m_hi, g_hi / m_lo)
        persistent, authority = [], []
        p = rset.push
        if push_accel_of is not None:  # measured on the plant (a declared double integrator)
            push = list(push_accel_of(rset))
        else:  # the force over the moving bodies' mass, on world axis k = position k
            push = [
                p.max_force / (moving_mass * m_lo)
                if p is not None and k < 3 and any(AXIS_INDEX[a] == k for a in p.axes)
                else 0.0
                for k in range(len(positions))
            ]
        for k in range(len(positions)):
            # The inner loop adds g_c = -g (for the nominal mass); the plant feels r (u + g_c) - s g_c.
            g_c = -float(gravity[k]) if double_integrator and k < 3 else 0.0
            amb = ambient[k] if k < len(ambient) else 0.0
            # The model's gain cases scale g_c with u: only the gravity scale's error is unpredicted.
            persistent.append(abs(g_c) * max(abs(1.0 - s_lo), abs(1.0 - s_hi)) + amb)
            # Full action toward each direction, at every end of the gain/mass and gravity ranges, against the
            # other inputs at full through the coupling and the persistent disturbance. A linear model's own
            # error over the safe set (gravity away from the operating point, Coriolis, the inertia's change) is
            # known only as the spec declares it (shield.disturbance_accel): braking must hold against it too.
            drift = 0.0 if double_integrator else declared[k]
            F, against = full_accel[k] - cross[k], ratio_set[1] * cross[k] + max(amb, drift)
            authority.append(
                (
                    min(r * (F - g_c) + s * g_c for r in ratio_set for s in (s_lo, s_hi)) - against,
                    min(r * (F + g_c) - s * g_c for r in ratio_set for s in (s_lo, s_hi)) - against,
                )
            )
        std = list(rset.obs_noise_std)
        noise = [std[0]] * obs_dim if len(std) == 1 else (std + [0.0] * obs_dim)[:obs_dim]
        other = {
            f"{group}.{el}": (r.low, r.high) for group in _MODEL_RANGE_GROUPS for el, r in getattr(rset, group).items()
        }
        if rset.gravity_scale is not None and not double_integrator:
            other["gravity_scale"] = (s_lo, s_hi)
        lat = rset.latency_steps.high if rset.latency_steps is not None else 0
        lat_min = rset.latency_steps.low if rset.latency_steps is not None else 0
        duration = rset.push.duration_steps * dt if rset.push is not None else 0.0
        out.append(
            SetEnvelope(
                name, lat, lat_min, ratio_set, persistent, push, noise, other, authority, moving_mass * m_lo, duration
            )
        )
    return out


def push_velocity(envelopes: list[SetEnvelope], brake: list) -> list[tuple[float, float]]:
    """Per position and braking direction (toward -, toward +), the most speed (units/s) one push leaves that the
    plant cannot brake away while it lasts.

    The barrier counts on braking at `brake_accel`; the weakest plant has `authority` (net of the persistent
    disturbance) at full action. A push of `push_accel` for `push_duration_s` takes ``push - (authority - brake)``
    of that braking while it lasts, where positive: the speed it leaves is what every barrier row braking that
    way must brake from on top (`push_velocity` in the spec). Zero where every set's pushes fit inside the braking
    margin. (Within the margin the shield re-plans from the measured state each step; only a shortfall of braking
    outlasts that.)"""
    pairs = brake_pairs(brake, len(brake))
    out = [[0.0, 0.0] for _ in brake]
    for e in envelopes:
        for k, push in enumerate(e.push_accel):
            for d in (0, 1):
                short = max(push - max(0.0, e.authority[k][d] - pairs[k][d]), 0.0) * e.push_duration_s
                out[k][d] = max(out[k][d], short)
    return [tuple(p) for p in out]


def envelope_problems(
    cfg, spec: dict, envelopes: list[SetEnvelope], full_accel: list[float], measured_ranges: bool = False
) -> list[str]:
    """Every way a set admits a plant the spec's assumptions do not cover (empty: all covered). `measured_ranges`:
    synthesis measured the model's error over every randomized range, so none needs `shield.model_ranges`."""
    problems = []
    err = spec["input_gain_error"]
    brake = brake_pairs(
        spec["kinematics"]["brake_accel"], len(spec["kinematics"]["position_index"])
    )  # (toward -, toward +)
    dist = spec["disturbance_accel"]
    pos = spec["kinematics"]["position_index"]
    # The positions some constraint reads: a free wheel's angle is a position of the model that no limit reads.
    limited = {i for c in parse_constraints(spec["constraints"], spec["obs_dim"]) for i in c.used}
    for env in envelopes:
        where = f"randomization.{env.name}"
        if env.latency_max > spec["latency_steps"]:
            problems.append(
                f"{where}.latency_steps: up to {env.latency_max} steps, beyond the "
                f"{spec['latency_steps']} the shield predicts through (shield.latency_steps)"
            )
        fewest = spec.get("latency_min_steps")
        if fewest is not None and env.latency_min < fewest:
            problems.append(
                f"{where}.latency_steps: from {env.latency_min} steps, below the {fewest} the shield "
                f"predicts for (shield.latency_min_steps)"
            )
        lo, hi = env.ratio
        gain_cover = spec.get("input_gain_range") or [1.0 - err, 1.0 + err]
        if lo < gain_cover[0] - 1e-9 or hi > gain_cover[1] + 1e-9:
            problems.append(
                f"{where}.actuator_gain / body_mass: input gain over mass ranges [{lo:.3f}, {hi:.3f}] x "
                f"nominal, outside the [{1 - err:.3f}, {1 + err:.3f}] of shield.input_gain_error = {err:g}"
            )
        for k, o in enumerate(pos):
            axis = f"position obs[{o}]"
            if env.persistent_accel[k] > dist[k] + 1e-9:
                problems.append(
                    f"{where}: persistent disturbance on {axis} up to {env.persistent_accel[k]:.3f} "
                    f"m/s^2 (gravity compensation at gain/mass {lo:.3f}..{hi:.3f} plus "
                    f"shield.ambient_disturbance_accel), beyond shield.disturbance_accel[{k}] = {dist[k]:g}"
                )
            for d, sign in enumerate("-+"):
                if env.authority[k][d] < brake[k][d] - 1e-9:
                    problems.append(
                        f"{where}.actuator_gain / body_mass: at gain/mass {lo:.3f}..{hi:.3f} the plant reaches "
                        f"{env.authority[k][d]:.3f} m/s^2 toward {sign} on {axis} at full action against the "
                        f"persistent disturbance, below the braking (or floor-holding) acceleration "
                        f"{brake[k][d]:g} the shield counts on (shield.brake_accel[{k}])"
                    )
            authority = min(env.authority[k])
            if env.push_accel[k] > max(authority, 0.0) + 1e-9:
                problems.append(
                    f"{where}.push.max_force: a push gives {env.push_accel[k]:.3f} m/s^2 on {axis}, more "
                    f"than the {max(authority, 0.0):.3f} m/s^2 the weakest plant can answer with"
                )
            noise = NOISE_SIGMAS * env.obs_noise_std[o]
            if o in limited and noise > spec["margin"] + 1e-9:  # the margin absorbs a limited position's noise
                problems.append(
                    f"{where}.obs_noise_std[{o}]: {NOISE_SIGMAS:g} sigma = {noise:.4f}, beyond "
                    f"shield.margin = {spec['margin']:g}{'' if cfg.shield.margin is not None else ' (synthesized)'}"
                )
        if spec["kinematics"].get("keepout_steering"):
            problems += _steering_problems(where, spec, env, brake)
    return problems + model_range_problems(cfg, envelopes, measured_ranges)


def model_range_problems(cfg, envelopes: list[SetEnvelope], measured_ranges: bool = False) -> list[str]:
    """`shield.model_ranges` against the sets, whichever filter keeps the plant: a set beyond a range the guarantee
    was stated for, and a key no set randomizes (a misspelt element covers nothing, and would say nothing).
    `measured_ranges`: synthesis measured the model's error over every randomized range, so none needs a key."""
    problems = []
    covered = cfg.shield.model_ranges
    for env in envelopes:
        where = f"randomization.{env.name}"
        for key, (lo_p, hi_p) in env.other.items():
            if measured_ranges and key not in covered:
                continue
            if key not in covered:
                problems.append(
                    f"{where}.{key}: range [{lo_p:g}, {hi_p:g}] is not among the ranges the shield's "
                    f"guarantee was established for (shield.model_ranges)"
                )
            elif lo_p < covered[key][0] - 1e-9 or hi_p > covered[key][1] + 1e-9:
                problems.append(
                    f"{where}.{key}: range [{lo_p:g}, {hi_p:g}] leaves shield.model_ranges.{key} = {list(covered[key])}"
                )
    randomized = sorted({key for env in envelopes for key in env.other})
    for key in covered:
        if key not in randomized:
            problems.append(
                f"shield.model_ranges.{key}: no randomization set randomizes it (randomized: {randomized or 'none'})"
            )
    return problems


def _steering_problems(where: str, spec: dict, env: SetEnvelope, brake: list[tuple[float, float]]) -> list[str]:
    """A keep-out row that credits passing (`keepout_steering`) brakes radially at its weakest axis's braking a
    while holding the sideways speed against a push w: per axis a |n_k| + w |t_k| <= sqrt(a^2 + w^2) at most."""
    problems = []
    pos = spec["kinematics"]["position_index"]
    for con in spec["constraints"]:
        if con["type"] not in ("cylinder", "sphere"):
            continue
        axes = [pos.index(o) for o in con["index"]]
        a = min(min(brake[k]) for k in axes)
        for k in axes:
            need = float(np.hypot(a, env.push_accel[k]))
            if min(env.authority[k]) < need - 1e-9:
                problems.append(
                    f"{where}.push.max_force: passing the keep-out {con['name']!r} the plant brakes at {a:g} "
                    f"and holds its sideways speed against a {env.push_accel[k]:.3f} m/s^2 push at once, "
                    f"{need:.3f} m/s^2 on position obs[{pos[k]}], more than the {min(env.authority[k]):.3f} "
                    f"the weakest plant has (lower shield.brake_accel, or set shield.keepout_steering: false)"
                )
    return problems


MONITOR_SLACK = (
    0.15  # of the full-action acceleration: what the monitor forgives as model error (lag shape, linearization)
)


def monitor_bounds(
    envelopes: list[SetEnvelope],
    full_accel: list[float],
    damping: list[tuple[float, str]],
    model_ranges: dict,
    disturbance: list[float] | None = None,
) -> dict:
    """The monitor's allowed unmodelled acceleration per position: accel + accel_per_speed |v| (m/s^2, 1/s).

    accel: the larger of the spec's declared disturbance and the worst persistent disturbance plus push over
    every set (an acceleration the spec declares is inside the envelope), plus MONITOR_SLACK of the
    full-action acceleration. accel_per_speed: for a damping the model includes (nominal N s/m
    per position, with its joint's `shield.model_ranges` entry), the largest relative damping
    error over the lightest moving mass. push_impulse (units/s, where a set pushes): the most speed one
    declared push gives, its acceleration over its duration. The monitor allows it on top of accel in any
    window: a push at a window's start fills a short window with its whole acceleration, which an `accel`
    measured over long windows (the push spread over them) does not cover.
    """
    k = len(full_accel)
    declared = disturbance or [0.0] * k
    # The spec's declared additive acceleration is inside the envelope: the monitor never flags it.
    accel = [
        max([declared[q]] + [e.persistent_accel[q] + e.push_accel[q] for e in envelopes])
        + MONITOR_SLACK * full_accel[q]
        for q in range(k)
    ]
    per_speed = []
    light = min(e.moving_mass_low for e in envelopes)
    for q, (c, joint) in enumerate(damping):
        lo, hi = model_ranges.get(f"joint_damping.{joint}", (1.0, 1.0))
        per_speed.append(max(1.0 - lo, hi - 1.0) * c / light if c > 0 and light > 0 else 0.0)
    impulse = [max((e.push_accel[q] * e.push_duration_s for e in envelopes), default=0.0) for q in range(k)]
    return {"accel": accel, "accel_per_speed": per_speed, **({"push_impulse": impulse} if any(impulse) else {})}


def assumptions(envelopes: list[SetEnvelope], obs_dim: int, monitor: dict) -> dict:
    """The spec's per-set record and the worst case over all sets (the monitor reads obs_noise_std and monitor)."""
    noise = [max(e.obs_noise_std[i] for e in envelopes) for i in range(obs_dim)] if envelopes else [0.0] * obs_dim
    return {
        "obs_noise_std": noise,
        "obs_noise_sigmas": NOISE_SIGMAS,
        "monitor": monitor,
        "sets": {
            e.name: {
                "latency_steps_max": e.latency_max,
                "gain_over_mass": list(e.ratio),
                "persistent_accel": e.persistent_accel,
                "push_accel": e.push_accel,
                "authority_accel": e.authority,
                "model_ranges": {k: list(v) for k, v in e.other.items()},
            }
            for e in envelopes
        },
    }
