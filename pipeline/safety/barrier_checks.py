"""Whether a braking barrier can act where it must: the checks that hand a plant to the predictive filter.

The braking barrier keeps each limit by braking the positions it reads, and is sound where an action meets every
condition at once. Three ways it cannot: at rest, where the model error it covers outruns its braking; over most
of its safe set, likewise (both asked of the filter itself, `barrier_holding_problem`); and where two limits close
together and the inputs move their positions together, so no action brakes both (`barrier_compatibility_problem`,
from the linear model: a body-frame thrust pushes x and y along one heading).
"""

from __future__ import annotations

import itertools

import numpy as np

# The braking barrier is picked only where it can act by its own conditions on at least this share of the states
# inside its safe set (BARRIER_SAMPLES drawn over the envelope). Where it cannot, its least-violation fallback keeps
# the plant, and nothing certifies that. A plant whose model error outruns its braking everywhere finds an action on
# about 1 % of them (a two-axis gantry with a weak drive; falsify then crossed its limits); the arm, whose barrier
# holds every corner swept, on 93 %, falling back only at speed near its joint limits. A lift arm whose motor barely
# outweighs gravity acted on 51 %, and its legacy controller behind it was answered by the fallback on 60 % of
# steps: a barrier that acts on only a few more than half is not what keeps the plant.
BARRIER_ACTS_SHARE = 0.8
BARRIER_SAMPLES = 2000


def barrier_holding_problem(spec: dict, rest: list[float], states: np.ndarray | None = None) -> str | None:
    """Why the braking barrier cannot hold the plant (None: it can): no action meets its conditions at rest at its
    operating point (`rest`, the shield state), or on most of the `states` (shield states sampled over the envelope)
    that lie inside its own safe set. Where its conditions cannot be met it falls back to least-violation braking,
    and nothing certifies that: the barrier is sound only where it can act by its conditions."""
    from shield.cbf import CbfShield

    shield = CbfShield(spec)
    fallback = np.asarray(spec["fallback_action"], np.float32)

    def ask(state) -> dict:
        shield.reset()
        obs = np.zeros(spec["obs_dim"], np.float32)
        obs[spec["state_index"]] = state
        return shield.filter(obs, fallback)[1]

    info = ask(rest)
    if info["fallback"]:
        worst = int(np.argmin(info["h"]))
        return (
            f"the braking barrier cannot hold the plant even at rest at its operating point: no action meets its "
            f"conditions on {spec['constraints'][worst]['name']!r} there (h {float(info['h'][worst]):.3g}): the "
            f"model error it must cover (disturbance_accel {spec['disturbance_accel']} units/s^2, {_covered(spec)}) "
            f"outruns the braking it has (brake_accel {spec['kinematics']['brake_accel']})"
        )
    if states is None:
        return None
    inside = stuck = 0
    for state in states:
        info = ask(state)
        if float(np.min(info["h"])) < 0.0:  # outside its safe set: braking back in is all it promises there
            continue
        inside += 1
        stuck += bool(info["fallback"])
    if inside and stuck > (1.0 - BARRIER_ACTS_SHARE) * inside:
        return (
            f"the braking barrier finds no action that meets its conditions on {stuck} of {inside} sampled states "
            f"inside its own safe set: the model error it must cover (disturbance_accel "
            f"{spec['disturbance_accel']} units/s^2, {_covered(spec)}) outruns the braking it has (brake_accel "
            f"{spec['kinematics']['brake_accel']}) over most of the "
            f"envelope, where only its uncertified least-violation fallback would act"
        )
    return None


def _covered(spec: dict) -> str:
    """What the barrier's model error is carried over: the latency, and the pushes where the plant declares any."""
    steps = int(spec.get("latency_steps", 0))
    said = f"over {steps} step{'s' if steps != 1 else ''} of latency" if steps else "with no latency"
    return said + (", and the pushes" if spec.get("push_velocity") else "")


def barrier_sample_states(cfg, samples: int = BARRIER_SAMPLES, seed: int = 0) -> np.ndarray:
    """Shield states drawn uniformly over the envelope's state box (constrained coordinates within their
    constraints, the rest as far as open-loop bang-bang drove them: `EnvelopeSampler.reach_box`)."""
    from pipeline.safety.sampling import EnvelopeSampler

    env = EnvelopeSampler(cfg, np.random.default_rng(seed), draws=1)
    env.reach_box()
    return env.rng.uniform(env.lo_s, env.hi_s, (samples, env.n))


def directly_driven(nominal) -> set[int]:
    """The position observations (joint angles and slides) on whose joint some action's actuator acts directly at
    the operating point: a nonzero moment (a thrust along a heading acts on x and on y), not only through the mass
    matrix's coupling (a trolley's force swings its payload, a cart's stretches the spring to its load)."""
    import mujoco

    model, data = nominal.model, mujoco.MjData(nominal.model)
    data.qpos[:] = nominal.qpos
    mujoco.mj_forward(model, data)
    moment = np.zeros((model.nu, model.nv))
    mujoco.mju_sparse2dense(moment, data.actuator_moment, data.moment_rownnz, data.moment_rowadr, data.moment_colind)
    acts = list(range(model.nu) if nominal.actuators is None else nominal.actuators)
    reach = np.abs(moment[acts]).max(axis=0) if acts else np.zeros(model.nv)
    floor = 1e-9 * max(float(reach.max(initial=0.0)), 1e-300)
    # A linear model's joints are hinges and slides: a position's qpos address is its dof.
    return {o for o, (kind, i) in nominal.obs_to_state.items() if kind == "qpos" and reach[i] > floor}


def barrier_compatibility_problem(spec: dict, names: list[str], driven: set[int]) -> str | None:
    """Why no action brakes every position limit that can close at once (None: one can): for each set of linear
    limit rows on different directions (no two of them the two sides of one band) over positions an actuator
    drives directly (`driven`, `directly_driven`), the action in the box that brakes them all together, in the
    weaker input-gain case, must reach the braking each row counts on. Where the inputs move the positions together
    (one thrust along a heading brakes +x only by pushing -y on), it cannot, and on that corner of the safe set
    the barrier would fall back to its uncertified least-violation brake. A position moved only through the
    coupling (a payload's swing) is left out: the corners where it and its driver close in opposite directions
    lie beyond what the coupling lets the plant reach, and where its braking falls short the predictive filter
    takes the plant anyway.

    `names`: observation names by index. A double-integrator model (input k drives position k alone) always can."""
    from scipy.optimize import linprog

    from shield.constraints import LinearRow
    from shield.spec import ShieldSpec

    if spec["model"]["type"] != "linear":
        return None
    parsed = ShieldSpec.from_dict(spec)
    B, dt = np.asarray(spec["model"]["B"], np.float64), float(spec["dt"])
    row_of = {o: i for i, o in enumerate(spec["state_index"])}
    brake = dict(zip(parsed.position_index, parsed.brake_accel_pairs))
    # Per position: its acceleration per unit action (the velocity's row of the discrete input matrix, per second).
    accel = {o: B[row_of[v]] / dt for o, v in zip(parsed.position_index, parsed.velocity_index)}
    rows = []  # (what, d'' per unit action (the gain's weaker case), braking counted on)
    weaker = 1.0 - float(spec["input_gain_error"])
    for con in parsed.constraint_objects():
        for row in con.rows():
            if not isinstance(row, LinearRow) or not all(o in brake and o in driven for o in row.weights):
                continue
            effect = weaker * sum(w * accel[o] for o, w in row.weights.items())
            counted = min(brake[o][w > 0] for o, w in row.weights.items())
            if len(row.weights) == 1:
                ((o, w),) = row.weights.items()  # the distance grows as the position moves away from the limit
                what = f"{names[o]} toward its {'upper' if w < 0 else 'lower'} limit ({con.name})"
            else:
                side = " ".join(f"{w:+.3g} {names[o]}" for o, w in sorted(row.weights.items())).lstrip("+")
                what = f"{con.name} toward its limit ({side} falling)"
            rows.append((what, np.asarray(effect), float(counted), row.weights))
    low, high = np.asarray(spec["action_low"], np.float64), np.asarray(spec["action_high"], np.float64)
    trim = np.clip(np.asarray(spec["fallback_action"], np.float64), low, high)  # what holds the operating point

    def sides_of_one_band(a: dict, b: dict) -> bool:
        keys = set(a) | set(b)
        va, vb = np.array([a.get(k, 0.0) for k in keys]), np.array([b.get(k, 0.0) for k in keys])
        return float(va @ vb) < -0.999 * float(np.linalg.norm(va) * np.linalg.norm(vb))

    worst = None
    # Sets of at most one row more than there are inputs: by Helly's theorem, convex sets in R^m (the rows'
    # halfspaces and the input box) meet if every m + 1 of them do, so a larger set that no action meets holds
    # such a subset (m + 1 rows with the box checks the subsets without it too).
    for size in range(2, min(len(rows), len(brake), len(low) + 1) + 1):
        for subset in itertools.combinations(rows, size):
            if any(sides_of_one_band(a[3], b[3]) for a, b in itertools.combinations(subset, 2)):
                continue
            # max t: every row's d'' = effect . (u - trim) >= t * braking, u in the box
            G = np.array([-np.append(r[1], -r[2]) for r in subset])
            res = linprog(
                np.append(np.zeros(len(low)), -1.0),
                A_ub=G,
                b_ub=-np.array([r[1] @ trim for r in subset]),
                bounds=[*zip(low, high), (0.0, None)],
                method="highs",
            )
            reach = max(float(res.x[-1]), 0.0) if res.status == 0 else 0.0
            if reach < 1.0 - 1e-6 and (worst is None or reach < worst[0]):
                worst = (reach, subset)
    if worst is None:
        return None
    reach, subset = worst
    share = f"at most {reach:.0%} of it" if reach > 0.0 else "none of it"
    effects = np.array([r[1] for r in subset])
    if np.linalg.matrix_rank(effects, tol=1e-9 * max(float(np.abs(effects).max()), 1e-300)) < len(subset):
        why = (
            "The inputs move these positions together (one thrust along a heading, say), so where those limits "
            "close at once the barrier could only fall back on its uncertified least-violation brake. Give each "
            "limited position an input of its own (a second thruster), or keep a limit on fewer of them"
        )
    else:  # every direction is reachable: the box is too small for all of them at once
        why = (
            "The inputs reach each of them, but not all at once that hard: braking one takes input the others "
            "need (an arm's joints share their torques through its inertia), so where those limits close at once "
            "the barrier could only fall back on its uncertified least-violation brake. A stronger drive, lower "
            "speeds near the limits (a speed limit: less braking to count on), or wider limits"
        )
    return (
        f"the braking barrier cannot brake {' and '.join(r[0] for r in subset)} at once: no action in the box "
        f"decelerates them together at the braking each counts on ({', '.join(f'{r[2]:.3g}' for r in subset)} "
        f"units/s^2; {share}, with the input's effect at its weakest). {why}"
    )
