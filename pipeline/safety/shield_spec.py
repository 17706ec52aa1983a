"""Builds a task's shield spec (the bundle's shield.json) at bundle-build time.

The nominal model comes from the task: for ``model: linear`` tasks (the
cart-pole) MuJoCo's own finite-difference derivatives (`mjd_transitionFD`)
at the task's equilibrium, composed over the physics substeps of one control
period; for ``model: double_integrator`` tasks (the quadrotor's acceleration
set-points) the per-axis acceleration scale and inner-loop response time. The
edge box then needs no MuJoCo.

The robustness numbers (`margin`, braking, `disturbance_accel`, the input-gain
range) come from `pipeline.safety.synthesis`, which measures them on the MJCF over
every randomization set, wherever the config leaves one unset; a number the config
sets is then held to that measurement.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from pipeline.config import ConfigError
from pipeline.safety.barrier_checks import (
    barrier_compatibility_problem,
    barrier_holding_problem,
    barrier_sample_states,
    directly_driven,
)
from pipeline.safety.envelope import (
    NOISE_SIGMAS,
    assumptions,
    declared_model_problems,
    declared_push_accel,
    envelope_problems,
    model_range_problems,
    monitor_bounds,
    plant_weights,
    push_velocity,
    pushed_bodies,
    set_envelopes,
)
from shield.spec import (
    MAX_INPUT_GAIN_ERROR,
    ShieldSpec,
    ShieldSpecError,
    angles_to_dict,
    brake_pairs,
    pairs_to_list,
)

# How the shield's guarantee is phrased in every spec; the numbers beside it are per task.
_STATEMENT = (
    "From a start the shield admits (one outside is answered FALLBACK until the shield has brought the plant in: "
    "nothing is certified there), no constraint is violated while the actuation latency is at most max_latency_s, the "
    "plant's achievable deceleration is at least brake_accel (per position) despite mass, "
    "gain and disturbance errors up to max_accel_error, the input's effect is within "
    "(1 +- max_input_gain_error) x nominal, an unknown additive acceleration stays within "
    "max_disturbance_accel (per position) and a push adds at most max_push_velocity to a speed "
    "beyond it, and observation noise stays within "
    "max_obs_noise (absorbed by the margin)."
)


def operating_state(nominal, state_obs: list[int]) -> np.ndarray:
    """The shield state at the nominal model's operating point (its qpos and qvel, read as obs[state_obs] reads)."""
    return np.array(
        [
            float(nominal.qpos[i] if kind == "qpos" else nominal.qvel[i])
            for kind, i in map(nominal.obs_to_state.get, state_obs)
        ]
    )


def linearize_mujoco(nominal, state_obs: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Discrete model over one control period, x = obs[state_obs], from mujoco.mjd_transitionFD at the equilibrium."""
    from envs.linearization import linearize_control_step

    model = nominal.model
    nv = model.nv
    _refuse_unmodelled_state(model)
    A, B = linearize_control_step(nominal)  # the same linearization the legacy LQR is designed on
    if model.nq != nv:
        raise ShieldSpecError("linear shield model: only plants with nq == nv (no free/ball joints) are supported")
    rows = []
    for o in state_obs:
        kind, i = nominal.obs_to_state[o]
        rows.append(i if kind == "qpos" else nv + i)
    P = np.zeros((len(state_obs), len(A)))
    P[np.arange(len(state_obs)), rows] = 1.0
    A_obs, B_obs = P @ A @ P.T, P @ B
    x_eq = P @ np.concatenate([nominal.qpos, nominal.qvel, np.zeros(model.na)])
    # The equilibrium is a fixed point under the action that holds it (zero where the plant rests unpowered).
    c = x_eq - A_obs @ x_eq - B_obs @ nominal.trim_action(B_obs.shape[1])
    return A_obs, B_obs, c


_DYNTYPES = {1: "integrator", 2: "filter", 3: "filterexact", 4: "muscle", 5: "user"}
_EQUALITIES = {0: "connect", 1: "weld", 2: "joint", 3: "tendon", 4: "flex"}


def _refuse_unmodelled_state(model) -> None:
    """ShieldSpecError for a plant whose state the shield cannot read from its joints: an actuator with dynamics of
    its own (its force lags or integrates the command: the linear model, on joint positions and velocities, would
    take the drive for one many times weaker and its lag for model error), or an equality constraint tying joints
    together (the envelope is sampled joint by joint, in states the plant can never be in)."""
    import mujoco

    for i in range(model.nu):
        if int(model.actuator_dyntype[i]) != 0:
            name = mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_ACTUATOR, i) or f"#{i}"
            kind = _DYNTYPES.get(int(model.actuator_dyntype[i]), str(int(model.actuator_dyntype[i])))
            lag = f", time constant {model.actuator_dynprm[i][0]:g} s" if kind.startswith("filter") else ""
            raise ShieldSpecError(
                f"actuator {name!r} has dynamics of its own (dyntype={kind!r}{lag}): its force follows the command "
                f"through a state the shield cannot observe, and shield synthesis "
                f"models a drive whose force is the command. Declare the drive without dyntype and its lag as "
                f"latency (randomization latency_steps: a lag of tau acts much as a delay of tau; an intvelocity "
                f"drive as a <position> servo), or serve without the shield: nothing certifies it for this drive"
            )
    for i in range(model.neq):
        if bool(model.eq_active0[i]):
            name = mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_EQUALITY, i) or f"#{i}"
            raise ShieldSpecError(
                f"equality constraint {name!r} ({_EQUALITIES.get(int(model.eq_type[i]), 'equality')}) ties the "
                f"plant's bodies or joints together: shield synthesis samples every joint on its own, in states "
                f"the coupled plant can never be in. Model the coupling into one joint (a belt or screw drive: "
                f"the motor's inertia as the driven joint's armature, the drive's force on the driven joint)"
            )


def _latency_range(cfg, envelopes) -> tuple[int, int]:
    """(fewest, most) control steps of actuation latency the shield predicts for: `shield.latency_min_steps` and
    `shield.latency_steps`, each by default what the randomization sets admit (`envelopes`: every set, not only
    reality, is a promise about where the plant may be)."""
    most = cfg.shield.latency_steps
    if most is None:
        most = max((e.latency_max for e in envelopes), default=0)
    fewest = cfg.shield.latency_min_steps
    if fewest is None:
        fewest = min(min((e.latency_min for e in envelopes), default=most), most)
    return fewest, most


# Where the predictive filter keeps the constraints, the braking figures are not used: a measured figure at or
# below zero is written as this share of the nominal full-action acceleration (the schema reads positive ones).
_PREDICTIVE_BRAKE_FLOOR = 0.01
PREDICTIVE_TOO = "; and the predictive filter cannot keep it either: "  # where both filters refused


class EnvelopeError(ConfigError):
    """A set admits plants outside the shield's assumptions; the message names set, parameter, range, limit.
    `next_step`, where set, is the command that says more ({config}: the config's path); the CLI prints it."""

    next_step: str | None = None


# Where a refusal names no range: `config --check`, `eval` and `run` build the spec once, so they cannot say what
# would certify; synthesis tries (helper-65's hoist: these commands named nothing, synthesize named two ways).
SYNTHESIZE_NEXT = (
    "`sim2real shield synthesize --config {config}` looks for a range, and the longest latency, that can be "
    "certified (a synthesis per try: minutes)"
)


def needs_synthesis(shield_cfg) -> bool:
    """True when the config leaves a shield number to synthesis (margin, braking, disturbance or input gain)."""
    return (
        shield_cfg.margin is None
        or shield_cfg.input_gain_error is None
        or shield_cfg.disturbance_accel is None
        or (shield_cfg.brake_fraction is None and shield_cfg.brake_accel is None)
    )


def build_shield_spec(cfg, check_envelope: bool = True, measurement=None, *, bare: bool = False) -> dict:
    """The shield.json content for `cfg.task.env_id`, from envs.safety_spec, the nominal model and cfg.shield.

    With `check_envelope` (always, except to build a deliberately faulty spec in tests) every
    randomization set is checked against the spec's assumptions (pipeline.safety.envelope). A number the
    config leaves unset comes from `measurement` (`pipeline.safety.synthesis.measure`, run here when none is
    given), and every number it sets is then held to that measurement.

    `bare`: a spec no filter will run, for what reads only its limits, model and action bounds (an adversary
    steering a plant evaluated without the shield). Nothing is certified: the envelope is not checked, and
    braking the plant lacks is written floored (as where the predictive filter keeps the constraints) instead
    of refused, with no predictive section.
    """
    import envs

    try:
        safety = envs.safety_spec(cfg.task.env_id)
    except envs.UnknownTaskError as err:  # e.g. a plain gymnasium env: trainable by id, no shield without a declaration
        from pipeline.config import ConfigError

        raise ConfigError(f"task.env_id: {err}") from None
    sc = cfg.shield
    obs_dim, act_dim, dt = int(safety["obs_dim"]), int(safety["act_dim"]), float(safety["dt"])
    pos = list(safety["kinematics"]["position_index"])
    vel = list(safety["kinematics"]["velocity_index"])
    names = [c["name"] for c in safety["constraints"]]
    unknown = sorted(set(sc.gains) - set(names))
    if unknown:
        raise ShieldSpecError(f"shield.gains: unknown constraint name(s) {unknown}; the task's constraints are {names}")
    # A constraint on an observation the shield's model does not carry is one it cannot predict, so it cannot
    # keep it: the plant would pass its checks while that limit is left to luck.
    modeled = set(pos) | set(vel)
    for con in safety["constraints"]:
        unseen = sorted(_reads(con) - modeled)
        if unseen:
            raise ShieldSpecError(
                f"constraint {con['name']}: reads {', '.join(f'obs[{i}]' for i in unseen)}, which the shield's model "
                f"does not carry (plant.kinematics: positions obs{pos}, velocities obs{vel}); declare that coordinate "
                f"and its velocity in plant.kinematics, so the shield predicts it and keeps the limit"
            )
    constraints = []
    for con in safety["constraints"]:
        con = dict(con)
        con["gain"] = float(sc.gains.get(con["name"], sc.gain))
        constraints.append(con)
    plant = plant_weights(cfg.task.env_id)  # nominal masses, gears, moving mass, gravity
    # A declared plant's double integrator has no inner loop that compensates gravity: its drift is measured
    # from the MJCF and must be covered like a linear model's error (declared_model_problems).
    compensated = bool(safety.get("gravity_compensated", True))
    low = np.asarray(safety["action_low"], np.float64)
    high = np.asarray(safety["action_high"], np.float64)
    full = np.maximum(np.abs(low), np.abs(high))  # largest action magnitude per input
    rest = None  # the operating point's shield state, where there is one
    trim = np.zeros(len(low))  # the action that holds it
    hold = [False] * len(low)  # per action: a set-point actuator, whose fallback holds the last action sent
    driven: set[int] = set()  # positions an actuator acts on directly at the operating point
    if safety["model"] == "linear":
        nominal = envs.nominal_model(cfg.task.env_id)  # the task registry's, linearized at its operating point
        driven = directly_driven(nominal)
        state_index = sorted(nominal.obs_to_state)
        A, B, c = linearize_mujoco(nominal, state_index)
        trim = nominal.trim_action(len(low))
        hold = setpoint_actions(nominal.model, nominal.actuators, len(low))
        if not bare:  # a bare spec keeps no limit: an uncontrollable one is the shield's refusal, not the adversary's
            _uncontrolled_limits(safety["constraints"], state_index, A, B, nominal, cfg.observation_names(state_index))
        rest = operating_state(nominal, state_index).tolist()
        model = {"type": "linear", "A": A.tolist(), "B": B.tolist(), "c": c.tolist()}
        # Nominal full-action acceleration of each position: velocity change per period / dt. What braking can
        # count on is the input that moves the position most, less what every other input can do to it at
        # full action (another joint braking at the same time pushes through the coupling).
        rows = [np.abs(B[state_index.index(v)]) * full / dt for v in vel]
        full_accel = [float(r.sum()) for r in rows]
        cross_accel = [float(r.sum() - r.max()) for r in rows]
        damping = [_joint_damping(nominal, o) for o in pos]  # the model's own damping of each position
        angles = _unlimited_angles(nominal, state_index)
    elif safety["model"] == "double_integrator":
        scale = np.asarray(safety["action_scale"], np.float64)
        state_index = pos + vel
        model = {
            "type": "double_integrator",
            "accel_per_action": np.diag(scale).tolist(),
            "response_time_s": float(safety.get("response_time_constant", 0.0)),
        }
        if compensated:
            # The inner loop compensates gravity for the nominal mass (envs: acceleration set-points, gravity
            # excluded), so a plant with gain/mass r feels r (u + g_c) - g: the compensation g_c scales with
            # the input's gain like the action, and each input-gain case predicts with its own drift.
            model["gain_scaled_accel"] = [0.0 - float(g) for g in plant[3][: len(pos)]]  # 0.0 - : no -0.0 in JSON
        full_accel = [float(scale[i] * full[i]) for i in range(len(pos))]
        cross_accel = [0.0] * len(pos)  # one input per axis
        damping = [(0.0, "")] * len(pos)
        angles = []
    else:
        raise ShieldSpecError(f"task {cfg.task.env_id}: unsupported shield model {safety['model']!r}")
    synthesized = needs_synthesis(sc) or measurement is not None
    predictive_reasons: list[str] = []
    braking_refused: list = []  # what the braking barrier could not keep, where the predictive filter must
    if synthesized:
        from pipeline.safety import synthesis

        measurement = measurement or synthesis.cached_measure(cfg)
        # A drive too weak for any shield model is refused first, whichever filter would keep the constraints.
        weak = synthesis.gain_problems(measurement) if sc.input_gain_error is None and not bare else []
        if weak:
            from pipeline.safety.certificate import refusal

            raise EnvelopeError(refusal(cfg, measurement, weak, bisect=False)["message"])
        refused = synthesis.authority_problems(measurement)
        derived = synthesis.derived_numbers(measurement)
        if refused and sc.brake_accel is None and sc.brake_fraction is None:
            # The braking barrier cannot keep these constraints: the predictive filter keeps every constraint
            # instead (its section is added below; a bare spec has none); the braking figures stay in the spec
            # as measured, floored to what the schema reads, and no barrier row uses them.
            if not bare:
                if safety["model"] != "linear" or any(c["type"] not in ("box", "halfspace") for c in constraints):
                    from pipeline.safety.certificate import refusal

                    raise EnvelopeError(refusal(cfg, measurement, refused, bisect=False)["message"])
                predictive_reasons = [r for _, _, r in refused]
                braking_refused = refused
            floor = [_PREDICTIVE_BRAKE_FLOOR * a for a in measurement.full_accel]
            derived["brake_accel"] = [[max(a, fl) for a in pair] for pair, fl in zip(derived["brake_accel"], floor)]
    margin = float(sc.margin if sc.margin is not None else derived["margin"])
    gain_error = float(sc.input_gain_error if sc.input_gain_error is not None else derived["input_gain_error"])
    gain_lo, gain_hi = derived["input_gain_range"] if synthesized else (1.0, 1.0)
    if synthesized and sc.input_gain_error is None and gain_error > MAX_INPUT_GAIN_ERROR:
        # The measured range's ends are the gain cases; past what the symmetric number can say, it states only how
        # weak the drive gets, so a light load that doubles the input's effect is kept as measured, not refused.
        gain_error = round(1.0 - gain_lo, 6)
    if bare:  # no filter runs on a bare spec: the schema's bounds are all that read these numbers
        gain_error = min(gain_error, MAX_INPUT_GAIN_ERROR)
    if sc.brake_fraction is not None:
        brake = [sc.brake_fraction * a for a in full_accel]
    elif sc.brake_accel is None:
        brake = [pair if pair[0] != pair[1] else pair[0] for pair in derived["brake_accel"]]
    if sc.brake_accel is not None:
        if len(sc.brake_accel) != len(pos):
            raise ShieldSpecError(
                f"shield.brake_accel: needs {len(pos)} values (one per position), got {len(sc.brake_accel)}"
            )
        brake = [[float(v) for v in a] if isinstance(a, list) else float(a) for a in sc.brake_accel]
    if bare:  # a coordinate no input moves has no braking at all; no filter reads it, the schema wants it > 0
        brake = [[max(v, 1e-6) for v in b] if isinstance(b, list) else max(b, 1e-6) for b in brake]
    _unkept_positions(cfg, pos, vel, constraints, brake)
    brake_min = [min(pair) for pair in brake_pairs(brake, len(pos))]
    disturbance = (
        derived["disturbance_accel"] if sc.disturbance_accel is None else [float(w) for w in sc.disturbance_accel]
    )
    if len(disturbance) != len(pos):
        raise ShieldSpecError(
            f"shield.disturbance_accel: needs {len(pos)} values (one per position), got {len(disturbance)}"
        )
    push_accel_of = None
    if safety["model"] == "double_integrator" and not compensated:
        measured = envs.measured_response(cfg.task.env_id, pushes=pushed_bodies(cfg))
        problems = declared_model_problems(cfg, pos, list(scale), disturbance, model["response_time_s"], measured)
        if problems:
            raise EnvelopeError(
                "the double_integrator shield model does not describe the plant the MJCF "
                "declares:\n  " + "\n  ".join(problems)
            )
        push_accel_of = partial(declared_push_accel, measured, positions=pos)
    ratio_of = None
    if synthesized:
        # Measured where the plant goes, not derived from its masses: a push on a payload moves the swing, and
        # a payload's mass is in the model's coupling, not in the input's effect.
        measured_push = {id(rset): measurement.push_accel[name] for name, rset in cfg.randomization.items()}
        push_accel_of = partial(_by_id, measured_push)
        ratio_of = _measured_ratio(measurement)
    envelopes = set_envelopes(
        cfg,
        pos,
        obs_dim,
        safety["model"] == "double_integrator" and compensated,
        full_accel,
        plant,
        cross_accel,
        disturbance,
        dt,
        push_accel_of,
        ratio_of,
    )
    if synthesized:  # the braking measured on the plant (its model error, couplings and pulls included) is what it has
        for e in envelopes:
            e.authority = [tuple(pair) for pair in measurement.authority]
    latency_min, latency = _latency_range(cfg, envelopes)
    kick = push_velocity(envelopes, brake)
    spec = {
        "schema_version": 1,
        "task": cfg.task.name,
        "obs_dim": obs_dim,
        "act_dim": act_dim,
        "dt": dt,
        "action_low": low.tolist(),
        "action_high": high.tolist(),
        "state_index": state_index,
        "model": model,
        "kinematics": {
            "position_index": pos,
            "velocity_index": vel,
            "brake_accel": brake,
            **({"keepout_steering": True} if sc.keepout_steering else {}),
        },
        "constraints": constraints,
        "latency_steps": latency,
        # A plant with fewer steps applies each action sooner than a prediction through `latency_steps` says:
        # each admitted latency is a case of its own (absent when there is only one: the same spec as before).
        **(
            {"latency_min_steps": int(latency_min)} if sc.latency_min_steps is not None or latency_min < latency else {}
        ),
        "margin": margin,
        "input_gain_error": gain_error,
        # The measured range as it is, when synthesis set the error: its ends are the gain cases.
        **(
            {"input_gain_range": [max(gain_lo, 1.0 - gain_error), gain_hi]}
            if synthesized and sc.input_gain_error is None
            else {}
        ),
        "disturbance_accel": disturbance,
        # Absent where every push fits inside the braking margin and the declared disturbance (the same spec as
        # before the key existed).
        **({"push_velocity": pairs_to_list(kick)} if any(map(any, kick)) else {}),
        # The angles of hinges without a range, wrapped around the operating point (absent where there are none).
        **({"angles": angles_to_dict(angles)} if angles else {}),
        # The constant action a refusal sends: zero, or where the operating point needs one, the action that holds
        # it (a hoist's drive letting go drops its load).
        "fallback_action": np.clip(trim, low, high).tolist(),
        # Where an action is a set-point (a position servo), the constant commands a move to it (three periods of 0
        # slewed a jib to its middle and swung its load past the limit): that action's fallback holds the last one.
        **({"fallback_hold": hold} if any(hold) else {}),
        "assumptions": {
            "max_latency_s": latency * dt,
            "max_accel_error": [a - b for a, b in zip(full_accel, brake_min)],
            "max_input_gain_error": gain_error,
            "max_disturbance_accel": disturbance,
            "max_push_velocity": pairs_to_list(kick),
            "max_obs_noise": max([NOISE_SIGMAS * e.obs_noise_std[o] for e in envelopes for o in pos], default=0.0),
            "statement": _STATEMENT,
            **assumptions(
                envelopes, obs_dim, monitor_bounds(envelopes, full_accel, damping, sc.model_ranges, disturbance)
            ),
            # What synthesis measured, and how (absent where the config sets every number).
            # Without its wall time: shield.json's content decides whether a hot reload keeps a plant's shield.
            **({"synthesis": {k: v for k, v in measurement.record().items() if k != "wall_s"}} if synthesized else {}),
        },
    }
    braking_synthesized = sc.brake_accel is None and sc.brake_fraction is None
    obs_names = cfg.observation_names(range(obs_dim))
    problem = None
    if synthesized and braking_synthesized and not bare and not predictive_reasons:
        # Braking each position is not braking them together: where one input moves two limited positions at
        # once, the corner where both close has no braking action. And braking that exists is not yet braking
        # that suffices: where the model error the barrier must cover over the latency outruns it, no action meets
        # the barrier's conditions anywhere, and it would fall back on every step. The predictive filter keeps
        # such a plant, or nothing does.
        problem = barrier_compatibility_problem(spec, obs_names, driven)
        if problem is None and rest is not None:
            problem = barrier_holding_problem(spec, rest, barrier_sample_states(cfg))
    if problem:
        if any(c["type"] not in ("box", "halfspace") for c in constraints):
            raise EnvelopeError(f"cannot certify {cfg.task.name}: {problem}")
        predictive_reasons = [problem]
    if predictive_reasons:
        from pipeline.safety import predictive
        from pipeline.safety.certificate import refusal

        def neither(why: str) -> EnvelopeError:
            # Both filters refused: the braking refusal names the parameter, its range and the physical reason.
            if braking_refused:
                braking = refusal(cfg, measurement, braking_refused, bisect=False)["message"]
            else:
                braking = f"cannot certify {cfg.task.name}: {predictive_reasons[0]}"
            err = EnvelopeError(f"{braking}{PREDICTIVE_TOO}{why}")
            if not braking_refused:  # the braking refusal's message already sends the user to synthesize
                err.next_step = SYNTHESIZE_NEXT
            return err

        try:
            spec["predictive"] = predictive.cached_section(cfg, spec)
        except ValueError as err:  # no backup, or no plan it admits, or a tail that needs the whole input box
            raise neither(f"it cannot be built: {err}") from None
        spec["predictive"]["measured"]["why"] = predictive_reasons
        problem = predictive.holding_problem(spec)
        if problem:
            raise neither(problem)
    ShieldSpec.from_dict(spec)  # fail here, at build time, rather than on the edge box
    if check_envelope and not bare and predictive_reasons:
        # The predictive filter's tube was measured over every set: only the ranges the config states the
        # guarantee for are left to hold the sets to.
        problems = model_range_problems(cfg, envelopes, measured_ranges=synthesized)
        if synthesized:
            # Hand-set numbers are held to the measurement here too: the predictive filter's tube does not read
            # them, but shield.json, the certificate and the monitor's bounds do (helper-49: a margin of 0.0001
            # against a measured 0.018 was certified as set, the monitor's bounds shrunk to a fifth).
            problems += synthesis.override_problems(cfg, measurement, spec)
        if problems:
            raise EnvelopeError("the config admits plants the shield cannot keep safe:\n  " + "\n  ".join(problems))
    if check_envelope and not bare and not predictive_reasons:
        # Synthesis measured the model's error over every randomized range (damping, friction included).
        problems = envelope_problems(cfg, spec, envelopes, full_accel, measured_ranges=synthesized)
        if synthesized:
            problems += synthesis.override_problems(cfg, measurement, spec)
        if not braking_synthesized and (together := barrier_compatibility_problem(spec, obs_names, driven)):
            problems.append(f"shield.brake_accel / brake_fraction (set by hand): {together}")
        if problems:
            raise EnvelopeError("the config admits plants the shield cannot keep safe:\n  " + "\n  ".join(problems))
    return spec


def _unkept_positions(cfg, pos: list[int], vel: list[int], constraints: list[dict], brake) -> None:
    """ShieldSpecError for a position in plant.kinematics that no constraint reads and the drive cannot brake (a
    hoist's swing under a vertical force): the barrier has nothing to keep there, and no braking figure to write."""
    for k, b in enumerate(brake):  # read as it is: the schema's reader refuses a figure at or below 0
        pair = [float(a) for a in b] if isinstance(b, (list, tuple)) else [float(b)] * 2
        if min(pair) > 0.0 or any({pos[k], vel[k]} & _reads(con) for con in constraints):
            continue
        name = cfg.observation_names([pos[k]])[0]
        raise ShieldSpecError(
            f"plant.kinematics.positions[{k}] ({name}): no constraint reads it, and the drive cannot brake it (braking "
            f"measured {[round(a, 3) for a in pair]} units/s^2): the braking barrier has nothing to keep there. Leave "
            f"it and its velocity out of plant.kinematics: the linear model carries every observed joint anyway"
        )


def _reads(con: dict) -> set[int]:
    """The observation indices a constraint reads: a box's `index`, a halfspace's non-zero weights `a`."""
    return {int(i) for i in con.get("index", [])} | {i for i, w in enumerate(con.get("a", [])) if w}


def _uncontrolled_limits(
    constraints: list, state_index: list[int], A: np.ndarray, B: np.ndarray, nominal, names: list[str]
) -> None:
    """ShieldSpecError naming a constraint on a coordinate no input moves at the operating point, over any number of
    steps (its row of the controllability matrix [B, AB, ..., A^(n-1) B] is zero): a hoist's sideways swing under a
    vertical lift. No filter keeps a limit the actuators cannot act on; the linear model says so exactly."""
    n = len(A)
    blocks, M = [], B
    for _ in range(n):
        blocks.append(M)
        M = A @ M
    reach = np.abs(np.hstack(blocks)).max(axis=1)
    scale = float(reach.max()) if reach.size else 0.0
    col = {o: j for j, o in enumerate(state_index)}
    for con in constraints:
        for o in sorted(_reads(con)):
            if o in col and reach[col[o]] <= 1e-9 * max(scale, 1e-300):
                kind, i = nominal.obs_to_state[o]
                raise ShieldSpecError(
                    f"constraint {con['name']}: no actuator moves {names[col[o]]} (obs[{o}], {kind}[{i}]) at the "
                    f"operating point, "
                    f"over any number of steps (the linearized plant is not controllable there: e.g. a swing that a "
                    f"force along its hinge axis cannot excite), so no shield can keep that limit; drop the "
                    f"constraint, or add an actuator (or a geometry) that moves it"
                )


def _by_id(table: dict, rset) -> list[float]:
    """A set's entry of `table` (keyed by the set object's id: sets are unhashable models)."""
    return table[id(rset)]


def _measured_ratio(measurement) -> tuple[float, float]:
    """The measured input effect over nominal, (lowest, highest) over every position, for the envelope check."""
    return (min(lo for lo, _ in measurement.gain_range), max(hi for _, hi in measurement.gain_range))


def setpoint_actions(model, actuators, act_dim: int) -> list[bool]:
    """Per action, whether its actuator takes a position set-point: MuJoCo's `<position>` servo (an affine bias
    with a position term, force = kp (ctrl - q) - kv qdot), whose ctrl is where the joint goes, not a force. A
    velocity servo's 0 stops it and a motor's 0 lets go: those keep the constant fallback."""
    import mujoco

    rows = list(actuators) if actuators is not None else list(range(min(act_dim, model.nu)))
    return [
        int(model.actuator_biastype[a]) == mujoco.mjtBias.mjBIAS_AFFINE and float(model.actuator_biasprm[a, 1]) != 0.0
        for a in rows
    ] + [False] * (act_dim - len(rows))


def _unlimited_angles(nominal, state_index: list[int]) -> list[tuple[int, float]]:
    """(observation index, operating-point angle) of each state's hinge angle without a range (the env's
    violation count reads the same list: `envs.declared_env.unlimited_angles`)."""
    from envs.declared_env import unlimited_angles

    return unlimited_angles(nominal.model, {o: nominal.obs_to_state[o] for o in state_index}, nominal.qpos)


def _joint_damping(nominal, obs_index: int) -> tuple[float, str]:
    """(nominal damping N s/m or N m s/rad, joint name) of the dof an observed position reads."""
    import mujoco

    kind, i = nominal.obs_to_state[obs_index]
    model = nominal.model
    joint = int(model.dof_jntid[i])
    return float(model.dof_damping[i]), mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_JOINT, joint) or ""
