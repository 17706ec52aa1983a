"""A task declared as data: the `plant:` section of a task YAML, beside its MJCF (schema, checks, compiling).

    plant:
      mjcf: my_plant.xml              # relative to the YAML (else found by name in the config folders)
      control_period: 0.02            # s
      episode_steps: 400
      actuators: [{name: shoulder_torque, scale: 1.0, units_per_action: 30.0}]
                                      # ctrl = scale x action, action in [-1, 1]; units_per_action (N, N m):
                                      # the task's action_scale (default: scale, i.e. ctrl units)
      targets: {reach: {low: [-1, -1], high: [1, 1], hold_s: [2, 3], speed: 1.0}}
      initial_state: {qpos: {shoulder: [-0.2, 0.2]}, qvel: {shoulder: [-0.05, 0.05]}}
      observations:                   # the observation vector, in order
        - {name: q1, joint: shoulder}               # qpos (rad or m); quantity: vel for qvel
        - {name: tip_x, site: tip, axis: 0}         # world position of a site (m)
        - {name: f, sensor: force_sensor, index: 0}
        - {name: q1_ref, target: reach, index: 0}   # the exogenous set-point
      reward:                         # the sum of weighted terms
        - {term: alive, weight: 1.0}
        - {term: tracking, observations: [q1], targets: [q1_ref], weight: -0.5, clip: 1.0}
        - {term: effort, weight: -0.01}             # weight x |action|^2
        - {term: progress, observations: [q1], targets: [q1_ref], weight: 5.0}
        - {term: violation, weight: -1.0}           # weight x info["cost"]
        - {function: "my_module:reward", weight: 1.0}   # f(obs, action, cost) -> float
      termination: [{observation: q1, abs_above: 3.0}]  # also: above, below; non-finite or diverged states always end
      numerics: {values: observation, effort: dot}      # floating-point details (defaults shown), below
      kinematics: {positions: [q1], velocities: [dq1]}   # for the shield's braking barriers
      constraints:                    # over named observations
        - {name: shoulder_range, type: box, observations: [q1], low: [-1.4], high: [1.4]}
        - {name: wall, type: halfspace, a: {q1: 1.0}, b: 1.2}          # sum a_i o_i <= b
        # - {name: keepout, type: cylinder, observations: [x, y], center: [0, 0], radius: 0.1}
        #   (keep out of a disc; a sphere: a ball over 3 observations)
      shield_model: {type: linear, operating_point: {shoulder: 0.0}}  # or double_integrator
                                      # linear: its state is the observed joints' qpos and qvel, so the
                                      # kinematics and the constraints read those (not a site or a sensor)
      legacy:                         # pid loops, lqr on the linearization, or a callable
        type: pid
        loops: [{action: 0, measured: q1, setpoint: q1_ref, rate: dq1, kp: 2.0, kd: 0.3}]
        # lqr: {type: lqr, q: [...], r: [...], setpoints: {x: x_ref}}: u = -K (x - x_op), the error of
        # a state with a set-point taken from its set-point observation
      steerable_setpoint: q1_ref      # optional: the target observation an adversary may steer the
                                      # legacy controller with (plants that fall under a plain push)

`numerics` fixes the floating-point evaluation, so a plant ported from code
reproduces its old env bit for bit. `values: observation` (default): reward
terms (a function term's obs too) and termination read the float32
observation vector; `values: state`: the float64 values it is rounded from
(qpos, qvel, site positions, sensor data, set-points). `effort: dot` (default) is weight x (a . a); `effort:
elementwise` is sum_i (weight x a_i) x a_i. The angle of a hinge without a
range is observed wrapped into (c - pi, c + pi] around the operating point c, as the linear shield model reads
it (where the shield model is linear); info["cost"] reads the float32 observation. A one-element tracking or
progress distance is |d|.
The reward is summed in the declared order, starting from 0.0.

Reset draws from the env's Generator in a fixed order: each initial_state
entry as written (one uniform each), then per target its first goal (one
uniform per element) and its hold (integers in [round(hold_s[0] / dt),
round(hold_s[1] / dt)]); the observed set-point starts at the middle of its
box when it ramps, at the goal when it jumps. A start outside a constraint
is drawn again, all of it, until one lies inside every constraint (a box
wholly inside them draws once; 1,000 draws with none inside is an error
naming plant.initial_state). A step clips the action, holds
ctrl over the physics substeps, ramps each set-point by at most speed x dt
toward its goal, counts the hold down (drawing the next goal and hold at 0),
then observes, costs, rewards and terminates.

Every error names its key path (`plant.observations[2].joint`). Names are
checked against the MJCF by `envs.declared_env.bind` (when the env is built and
by `sim2real config --check`); `module:function` entries by `resolve_entry_point`.
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class DeclarationError(ValueError):
    """A task declaration that cannot be used; the message names the key path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Actuator(_Strict):
    """One action element: the named MuJoCo actuator gets ctrl = scale x action."""

    name: str = Field(description="MuJoCo actuator name")
    scale: float = Field(1.0, gt=0, description="ctrl units per unit action")
    units_per_action: float | None = Field(
        None,
        gt=0,
        description="physical units (N, N m) per unit action, the task's action_scale; default: scale (ctrl units)",
    )
    unit: str | None = Field(
        None,
        description="the unit of units_per_action, for the bundle's I/O contract "
        "(default: N on a slide joint, N m on a hinge, else ctrl)",
    )


class Target(_Strict):
    """An exogenous set-point: drawn uniformly in [low, high], held hold_s, the observed value ramps at speed."""

    low: list[float] = Field(description="lowest target, per element (the observed units)")
    high: list[float] = Field(description="highest target, per element (>= low)")
    hold_s: tuple[float, float] = Field((2.0, 3.0), description="s, how long each target is held (drawn uniformly)")
    speed: float | None = Field(
        None, gt=0, description="units/s the observed set-point ramps toward the target; None jumps"
    )

    @model_validator(mode="after")
    def _bounds(self):
        if len(self.low) != len(self.high) or any(lo > hi for lo, hi in zip(self.low, self.high)):
            raise ValueError("low and high need the same length and low <= high")
        if not 0 < self.hold_s[0] <= self.hold_s[1]:
            raise ValueError("hold_s needs 0 < first <= second")
        return self


class Observation(_Strict):
    """One observation element, from exactly one of joint, site, sensor or target."""

    name: str = Field(description="the observation's name, used by reward, termination, kinematics and constraints")
    joint: str | None = Field(None, description="MJCF joint: its qpos (quantity: pos) or qvel (quantity: vel)")
    site: str | None = Field(None, description="MJCF site: its world position along `axis` (m)")
    sensor: str | None = Field(None, description="MJCF sensor: its element `index` of sensordata")
    target: str | None = Field(None, description="a `targets` entry: its element `index`, the observed set-point")
    quantity: Literal["pos", "vel"] = Field("pos", description="joint: qpos or qvel")
    axis: int = Field(0, ge=0, le=2, description="site: world axis of its position, an integer (0 x, 1 y, 2 z)")
    index: int = Field(0, ge=0, description="sensor or target: element")
    unit: str | None = Field(
        None,
        description="its unit in the bundle's I/O contract, where the MJCF cannot say "
        "(a target, a sensor); joints and sites are m, rad, m/s, rad/s",
    )

    @model_validator(mode="after")
    def _one_source(self):
        given = [k for k in ("joint", "site", "sensor", "target") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"needs exactly one of joint, site, sensor, target; got {given or 'none'}")
        return self


class RewardTerm(_Strict):
    """One weighted reward term from the library, or a `module:function` f(obs, action, cost) -> float."""

    term: Literal["alive", "tracking", "effort", "progress", "violation"] | None = Field(
        None,
        description="a library term, added as weight x its value: alive 1 per step, tracking the distance to the "
        "targets (at most clip), effort |a|^2, progress the distance closed this step, violation info['cost'] "
        "(1 on a violating step); a penalty takes a negative weight",
    )
    function: str | None = Field(None, description="'module:function' f(obs, action, cost) -> float instead of a term")
    weight: float = Field(1.0, description="the term's weight in the sum")
    observations: list[str] = Field([], description="tracking, progress: the observations that track ...")
    targets: list[str] = Field([], description="... these target observations, in the same order")
    clip: float | None = Field(None, gt=0, description="tracking: the distance is clipped here")

    @model_validator(mode="after")
    def _shape(self):
        if (self.term is None) == (self.function is None):
            raise ValueError("needs exactly one of term or function")
        if self.term in ("tracking", "progress") and (
            not self.observations or len(self.observations) != len(self.targets)
        ):
            raise ValueError(f"term {self.term}: needs observations and targets of the same, non-zero length")
        if self.function is not None and ":" not in self.function:
            raise ValueError(f"function {self.function!r}: must be 'module:function'")
        return self


class Termination(_Strict):
    """The episode ends when the named observation crosses a bound."""

    observation: str = Field(description="the observation watched")
    above: float | None = Field(None, description="ends when the observation is above this")
    below: float | None = Field(None, description="ends when the observation is below this")
    abs_above: float | None = Field(None, description="ends when |observation| is above this")


class Numerics(_Strict):
    """The floating-point evaluation of the reward and termination (see the module docstring)."""

    values: Literal["observation", "state"] = Field(
        "observation",
        description="reward terms and termination read the float32 observation, or the float64 "
        "values it is rounded from",
    )
    effort: Literal["dot", "elementwise"] = Field(
        "dot", description="effort term: weight x (a . a), or sum_i (weight x a_i) x a_i"
    )


class Kinematics(_Strict):
    """Which observations are positions and which their velocities (same order)."""

    positions: list[str] = Field([], description="observations that are positions (m or rad) the shield brakes")
    velocities: list[str] = Field([], description="the observations that are their velocities, in the same order")

    @model_validator(mode="after")
    def _pairs(self):
        if len(self.positions) != len(self.velocities):
            raise ValueError("positions and velocities need the same length")
        return self


class Constraint(_Strict):
    """A safety constraint over named observations (box, halfspace, cylinder, sphere)."""

    name: str = Field(description="the constraint's name in reports, eval figures and the shield spec")
    type: Literal["box", "halfspace", "cylinder", "sphere"] = Field(
        description="box: low <= obs <= high; halfspace: sum a_i obs_i <= b; cylinder (2 observations) and "
        "sphere (3): keep out of the disc or ball"
    )
    observations: list[str] = Field([], description="box, cylinder, sphere: the observations constrained")
    low: list[float] | None = Field(None, description="box: lower bounds, one per observation")
    high: list[float] | None = Field(None, description="box: upper bounds, one per observation")
    a: dict[str, float] | None = Field(None, description="halfspace: weights by observation name")
    b: float | None = Field(None, description="halfspace: the bound")
    center: list[float] | None = Field(None, description="cylinder, sphere: the keep-out zone's center")
    radius: float | None = Field(None, gt=0, description="cylinder, sphere: the keep-out zone's radius")

    @model_validator(mode="after")
    def _fields(self):
        n = len(self.observations)
        if self.type == "box":
            if not n or self.low is None or self.high is None or len(self.low) != n or len(self.high) != n:
                raise ValueError("box: needs observations, low and high of one length")
            if any(lo > hi for lo, hi in zip(self.low, self.high)):
                raise ValueError("box: low must be <= high")
        elif self.type == "halfspace":
            if not self.a or self.b is None:
                raise ValueError("halfspace: needs a (weights by observation name) and b")
        elif not n or self.center is None or len(self.center) != n or self.radius is None:
            raise ValueError(f"{self.type}: needs observations, a center of the same length and a radius")
        elif n != {"cylinder": 2, "sphere": 3}[self.type]:
            shape, need = ("disc", 2) if self.type == "cylinder" else ("ball", 3)
            raise ValueError(f"{self.type}: keeps out of a {shape} over {need} position observations, got {n}")
        return self


class ShieldModel(_Strict):
    """The shield's nominal model: linearized from the MJCF at an operating point, or a double integrator.

    A double integrator says input k accelerates position k (`kinematics.positions` in actuator order) by
    `accel_per_action[k]` per unit action, through a first-order lag `response_time_s`, and that nothing
    else moves it: a declared plant's motors drive the MJCF directly, so gravity or a spring is a drift the
    shield must be told of (`shield.disturbance_accel`). The shield-spec build holds it to the MJCF
    (`envs.measured_response`, `pipeline.safety.envelope.declared_model_problems`)."""

    type: Literal["linear", "double_integrator"] = Field(
        description="linear: MuJoCo's linearization at operating_point; double_integrator: position k is driven "
        "by input k"
    )
    operating_point: dict[str, float] = Field({}, description="linear: qpos by joint name (others at the MJCF's qpos0)")
    response_time_s: float = Field(0.0, ge=0, description="double_integrator: inner-loop response time (s)")
    accel_per_action: list[float] | None = Field(None, description="double_integrator: units/s^2 per unit action")


class PidLoop(_Strict):
    """u[action] = feedforward + kp e + ki int(e) - kd rate (or + kd de/dt without rate), e = setpoint - measured."""

    action: int = Field(ge=0, description="the action element this loop drives (an integer index)")
    measured: str = Field(description="the observation controlled")
    setpoint: str | float = Field(0.0, description="an observation name (a target) or a constant")
    rate: str | None = Field(None, description="observation of d(measured)/dt: damping on the measurement")
    kp: float = Field(0.0, description="proportional gain (normalized action per unit error)")
    ki: float = Field(0.0, description="integral gain (per unit error and second)")
    kd: float = Field(0.0, description="derivative gain (per unit rate)")
    integral_limit: float = Field(1.0, gt=0, description="normalized action units")
    feedforward: float | Literal["hold"] = Field(
        0.0,
        description="a constant action added (normalized, within [-1, 1]): the steady action that carries a load, a "
        "hoist's weight say, so the loop holds its set-point from the first step instead of sagging while the "
        "integral builds up; `hold`: the action that holds the shield model's operating point still on the nominal "
        "MJCF (its trim, as the lqr legacy and the shield take it), computed rather than worked out by hand",
    )

    @field_validator("feedforward")
    @classmethod
    def _feedforward_in_box(cls, value):
        if value != "hold" and not -1.0 <= value <= 1.0:
            raise ValueError(f"must lie in the action box [-1, 1] (or be `hold`), got {value}")
        return value


class Legacy(_Strict):
    """The controller the plant runs today."""

    type: Literal["pid", "lqr", "callable"] = Field(
        description="pid: loops; lqr: on the linearization (q, r, setpoints); callable: your own controller"
    )
    name: str | None = Field(None, description="shown by `sim2real envs` (default: the type)")
    loops: list[PidLoop] = Field([], description="pid: one loop per driven action")
    q: list[float] | None = Field(
        None,
        description="lqr: state weights, one per joint observation, in the order the observations are declared",
    )
    r: list[float] | None = Field(None, description="lqr: action weights")
    setpoints: dict[str, str] = Field({}, description="lqr: state observation -> observation of its set-point")
    callable: str | None = Field(None, description="'module:callable' returning the controller")

    @model_validator(mode="after")
    def _fields(self):
        if self.type == "pid" and not self.loops:
            raise ValueError("pid: needs loops")
        if self.type == "lqr" and (self.q is None or self.r is None):
            raise ValueError("lqr: needs q and r")
        if self.type == "callable" and (not self.callable or ":" not in self.callable):
            raise ValueError("callable: needs callable: 'module:callable'")
        # A key of another type's is never read: accepted, it would look as if it did something.
        owner = {"loops": "pid", "q": "lqr", "r": "lqr", "setpoints": "lqr", "callable": "callable"}
        stray = [k for k, t in owner.items() if t != self.type and k in self.model_fields_set]
        if stray:
            raise ValueError(
                f"{', '.join(stray)}: only read for a type {owner[stray[0]]} controller, not {self.type}"
                + (
                    " (the predictive filter's backup takes an lqr legacy's q and r; for another legacy it weighs "
                    "each state by the room its limits and ranges leave, Bryson's rule)"
                    if {"q", "r"} & set(stray)
                    else ""
                )
            )
        return self


class PlantDeclaration(_Strict):
    """The `plant:` section: the whole task as data (see the module docstring)."""

    mjcf: str = Field(description="MJCF file, relative to the task YAML")
    control_period: float = Field(gt=0, description="s")
    episode_steps: int = Field(gt=0, description="control steps per episode")
    actuators: list[Actuator] = Field(min_length=1, description="the action vector, in order: one entry per element")
    observations: list[Observation] = Field(min_length=1, description="the observation vector, in order")
    targets: dict[str, Target] = Field({}, description="exogenous set-points by name")
    initial_state: dict[Literal["qpos", "qvel"], dict[str, tuple[float, float]]] = Field(
        {},
        description="reset: {qpos|qvel: {joint: [low, high]}}, each drawn uniformly (other joints at the MJCF's "
        "qpos0, at rest)",
    )
    reward: list[RewardTerm] = Field(min_length=1, description="the reward: a sum of weighted terms")
    termination: list[Termination] = Field([], description="bounds whose crossing ends the episode")
    numerics: Numerics = Field(Numerics(), description="floating-point details of reward and termination")
    kinematics: Kinematics = Field(Kinematics(), description="positions and velocities for the shield's barriers")
    constraints: list[Constraint] = Field([], description="the safety constraints: info['cost'] and the shield")
    shield_model: ShieldModel = Field(description="the shield's nominal model of the plant")
    legacy: Legacy = Field(description="the controller the plant runs today (the gate's baseline)")
    steerable_setpoint: str | None = Field(
        None, description="target observation the adversary may steer the legacy controller with"
    )

    @model_validator(mode="after")
    def _names(self):
        for kind, ranges in self.initial_state.items():
            for joint, (lo, hi) in ranges.items():
                if not lo <= hi:
                    raise ValueError(f"initial_state.{kind}.{joint}: [{lo}, {hi}]: low must be <= high")
        names = [o.name for o in self.observations]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"observations: duplicate names {dup}")
        known = set(names)

        def need(name: str, where: str) -> None:
            if name not in known:
                raise ValueError(f"{where}: no observation named {name!r}; observations are {names}")

        for i, o in enumerate(self.observations):
            if o.target is not None:
                if o.target not in self.targets:
                    raise ValueError(
                        f"observations[{i}].target: no target named {o.target!r}; targets are {sorted(self.targets)}"
                    )
                if o.index >= len(self.targets[o.target].low):
                    raise ValueError(
                        f"observations[{i}].index: target {o.target!r} has {len(self.targets[o.target].low)} elements"
                    )
        for i, t in enumerate(self.reward):
            for n in t.observations + t.targets:
                need(n, f"reward[{i}]")
        for i, t in enumerate(self.termination):
            need(t.observation, f"termination[{i}].observation")
        for n in self.kinematics.positions + self.kinematics.velocities:
            need(n, "kinematics")
        for i, c in enumerate(self.constraints):
            for n in c.observations + list(c.a or {}):
                need(n, f"constraints[{i}]")
        for i, loop in enumerate(self.legacy.loops):
            if loop.action >= len(self.actuators):
                raise ValueError(
                    f"legacy.loops[{i}].action: {loop.action} but there are {len(self.actuators)} actuators"
                )
            for n in [loop.measured, loop.rate] + ([loop.setpoint] if isinstance(loop.setpoint, str) else []):
                if n is not None:
                    need(n, f"legacy.loops[{i}]")
        for k, v in self.legacy.setpoints.items():
            need(k, "legacy.setpoints")
            need(v, "legacy.setpoints")
        if self.steerable_setpoint is not None:
            need(self.steerable_setpoint, "steerable_setpoint")
            if self.observations[names.index(self.steerable_setpoint)].target is None:
                raise ValueError(f"steerable_setpoint: {self.steerable_setpoint!r} is not a target observation")
        return self

    def index(self, name: str) -> int:
        """Observation index of a named observation."""
        return [o.name for o in self.observations].index(name)

    def targets_past_limits(self) -> list[str]:
        """Each set-point range that reaches past a box constraint on the observation that tracks it (a tracking or
        progress term's pair, a pid loop's measured and setpoint): the shield holds the plant short of such
        set-points, and a policy or controller driving at them ends episodes held at the limit."""
        by_name = {o.name: o for o in self.observations}
        pairs = [(m, t) for r in self.reward for m, t in zip(r.observations, r.targets)]
        pairs += [(loop.measured, loop.setpoint) for loop in self.legacy.loops if isinstance(loop.setpoint, str)]
        out = []
        for measured, ref in dict.fromkeys(pairs):
            o = by_name.get(ref)
            if o is None or o.target not in self.targets:
                continue
            target = self.targets[o.target]
            lo, hi = target.low[o.index], target.high[o.index]
            for c in self.constraints:
                if c.type != "box" or measured not in c.observations or c.low is None or c.high is None:
                    continue
                k = c.observations.index(measured)
                if lo < c.low[k] or hi > c.high[k]:
                    out.append(
                        f"plant.targets.{o.target} sets {ref} over [{lo:g}, {hi:g}], past the limits "
                        f"[{c.low[k]:g}, {c.high[k]:g}] of constraint {c.name!r} on {measured}: the shield holds the "
                        f"plant short of those set-points, so a policy or controller chasing them is held at the "
                        f"limit, and where being held ends an episode (a pole that falls) the gate counts it lost. "
                        f"Keep the targets inside the limits, with room to stop"
                    )
        return out

    def safety(self) -> dict:
        """The constraints and kinematics over observation indices (the shield spec's schema)."""
        ix, dim = self.index, len(self.observations)
        out = []
        for c in self.constraints:
            if c.type == "box":
                out.append(
                    {
                        "name": c.name,
                        "type": "box",
                        "index": [ix(n) for n in c.observations],
                        "low": list(c.low),
                        "high": list(c.high),
                    }
                )
            elif c.type == "halfspace":
                a = [0.0] * dim
                for n, w in c.a.items():
                    a[ix(n)] = float(w)
                out.append({"name": c.name, "type": "halfspace", "a": a, "b": float(c.b)})
            else:
                out.append(
                    {
                        "name": c.name,
                        "type": c.type,
                        "index": [ix(n) for n in c.observations],
                        "center": list(c.center),
                        "radius": float(c.radius),
                    }
                )
        return {
            "kinematics": {
                "position_index": [ix(n) for n in self.kinematics.positions],
                "velocity_index": [ix(n) for n in self.kinematics.velocities],
            },
            "constraints": out,
        }


def _format(err: ValidationError, prefix: str) -> str:
    lines = []
    for e in err.errors():
        path = prefix + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"])
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        # The cross-reference checks of the whole section start their message with the key they found.
        lines.append(f"{path}.{msg}" if not e["loc"] else f"{path}: {msg}")
    return "\n  ".join(lines)


def parse_declaration(raw, where: str = "plant") -> PlantDeclaration:
    """Validate the `plant:` mapping; DeclarationError naming every bad key path."""
    try:
        return PlantDeclaration.model_validate(raw)
    except ValidationError as err:
        raise DeclarationError(_format(err, where)) from None


def resolve_entry_point(spec: str, where: str):
    """Import 'module:attribute'; DeclarationError naming `where` when it does not resolve."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise DeclarationError(f"{where}: cannot import module {module_name!r} ({err})") from None
    try:
        found = getattr(module, attr)
    except AttributeError:
        raise DeclarationError(f"{where}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(found):
        raise DeclarationError(f"{where}: {spec!r} is a {type(found).__name__}, not a callable")
    return found


def mjcf_identity(path: str | Path) -> str:
    """The MJCF as it identifies a task: its file name and the sha256 of its bytes, not where it lies, so two
    checkouts (or a copy of a shipped YAML beside a copy of its MJCF) agree; an unreadable file: its name."""
    path = Path(path)
    try:
        return f"{path.name}#sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"
    except OSError:
        return path.name


def mjcf_path(decl: PlantDeclaration, yaml_path: Path, search=()) -> Path:
    """The MJCF file, relative to the YAML that declares it; when it is not there, the first file of its name
    in the `search` folders (so a copy of a shipped task YAML, edited elsewhere, still finds the shipped MJCF)."""
    path = (Path(yaml_path).parent / decl.mjcf).resolve()
    if not path.is_file():
        for folder in search:
            found = Path(folder) / Path(decl.mjcf).name
            if found.is_file():
                return found.resolve()
    return path
