"""The shield spec (`shield.json` in a policy bundle): what the CBF shield knows of the plant.

This module owns the schema. A spec holds:

- how the shield's state is read from the observation (`state_index`), and
  which of its entries are angles of joints that turn without limit
  (`angles`: each read wrapped into (center - pi, center + pi], the range the
  model was linearized over; a multi-turn encoder count or a fallen pole that
  spun round is then the plant state it is, not a linearization far outside it),
- a nominal control-affine model, either ``linear`` (discrete time,
  ``x+ = A x + B u + c`` over ``[obs[state_index], internal]``; the internal
  states are predicted only, e.g. an actuator lag) or ``double_integrator``
  (acceleration set-points through a first-order inner loop with response time
  ``response_time_s``; ``gain_scaled_accel``: an acceleration the inner loop adds
  to every set-point that scales with the plant's input gain like the action,
  e.g. gravity compensation computed for the nominal mass), converted to the
  linear form by `linear_model()`,
- which observation entries are positions and which their velocities, with the
  braking acceleration the shield may count on per position (units/s^2): one
  number for both directions, or ``[toward -, toward +]`` where the plant brakes
  harder one way (a quadrotor brakes a climb with gravity's help), and
  whether a keep-out zone's barrier credits passing it (``keepout_steering``:
  a plant moving sideways past a cylinder or sphere need not stop before it,
  see `shield.barrier`),
- constraints over the observation (halfspace, box, cylinder, sphere), each
  with its own class-K gain in (0, 1],
- the input box, the control latency (steps) predicted through (and, with
  ``latency_min_steps``, every latency from it up: one prediction case each), the margin
  (units of the constrained quantity) covering model error and sensor noise,
  the relative error of the input's effect (actuator gain over mass) the
  conditions are robust to (`input_gain_error`; with `input_gain_range`, the
  measured [low, high] of that effect over nominal, whose two ends are then the
  gain cases instead of 1 +- the error: an empty hook and a full load are not
  symmetric about nominal), and the bound on an unknown
  additive acceleration per position (`disturbance_accel`, units/s^2: wind,
  gravity-compensation error) the next-step prediction is robust to, the
  speed a push may add beyond that (`push_velocity`, units/s per position: a
  bounded shove that, while it lasts, takes more than the braking margin and the
  declared disturbance cover, per position a number or ``[toward -, toward +]``
  as the braking it falls short of; every barrier row brakes from its closing
  speed plus it), the constant fallback action (and per action whether it holds the last action sent instead:
  `fallback_hold`, true on a set-point actuator such as a position servo, where the constant commands a move),
  and the assumptions under which the guarantee
  holds (as data plus one human sentence).

Stdlib + numpy only: the edge box reads this file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shield.constraints import CONSTRAINT_TYPES, Constraint, ConstraintError, indices, parse_constraint  # noqa: F401

SCHEMA_VERSION = 1
MODEL_TYPES = ("linear", "double_integrator")
# The largest input gain error a spec takes: at 1 - 0.9 = 0.1x nominal the input hardly moves the plant at all.
MAX_INPUT_GAIN_ERROR = 0.9


class ShieldSpecError(ValueError):
    """A shield spec is malformed; the message names the bad key."""


def _fail(key: str, msg: str) -> None:
    raise ShieldSpecError(f"shield spec: {key}: {msg}")


def _need(d: dict, key: str, where: str) -> Any:
    if not isinstance(d, dict):
        _fail(where, f"must be a mapping, got {type(d).__name__}")
    if key not in d:
        _fail(f"{where}.{key}" if where else key, "missing")
    return d[key]


def _floats(value: Any, key: str, length: int | None = None) -> list[float]:
    if not isinstance(value, (list, tuple)):
        _fail(key, f"must be a list of numbers, got {type(value).__name__}")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(float(v)):
            _fail(f"{key}[{i}]", f"must be a number, got {v!r}")
        out.append(float(v))
    if length is not None and len(out) != length:
        _fail(key, f"must have {length} entries, got {len(out)}")
    return out


def _finite(value: Any, key: str, length: int | None = None) -> list[float]:
    out = _floats(value, key, length)
    for i, v in enumerate(out):
        if not math.isfinite(v):
            _fail(f"{key}[{i}]", f"must be finite, got {v!r}")
    return out


def _number(value: Any, key: str, low: float | None = None, high: float | None = None, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        _fail(key, f"must be a finite number, got {value!r}")
    v = float(value)
    if low is not None and (v < low or (low_open and v == low)):
        _fail(key, f"must be {'>' if low_open else '>='} {low}, got {v}")
    if high is not None and v > high:
        _fail(key, f"must be <= {high}, got {v}")
    return v


def _indices(value: Any, key: str, dim: int) -> list[int]:
    try:
        return indices(value, key, dim)
    except ConstraintError as err:
        raise ShieldSpecError(f"shield spec: {err}") from None


def _matrix(value: Any, key: str, rows: int, cols: int) -> np.ndarray:
    if not isinstance(value, (list, tuple)) or len(value) != rows:
        _fail(key, f"must be a {rows}x{cols} list of rows")
    return np.array([_finite(r, f"{key}[{i}]", cols) for i, r in enumerate(value)], dtype=np.float64).reshape(
        rows, cols
    )


@dataclass
class LinearModel:
    """Discrete-time nominal model ``x+ = A x + B u + c`` over ``[obs[state_index], internal]``."""

    A: np.ndarray
    B: np.ndarray
    c: np.ndarray
    internal_dim: int
    internal_init: np.ndarray | None = None  # value of the internal states after reset
    # The parts of c and internal_init that scale with the input's gain: an input-gain case
    # with scale s has offset c + (s - 1) c_gain (see `offset`), e.g. gravity compensation
    # for the nominal mass, which a light or strong plant over-delivers.
    c_gain: np.ndarray | None = None
    internal_init_gain: np.ndarray | None = None

    def offset(self, scale: float) -> np.ndarray:
        """The affine term of the input-gain case with the input's effect at `scale` x nominal."""
        return self.c if self.c_gain is None else self.c + (scale - 1.0) * self.c_gain

    def initial_internal(self, scale: float) -> np.ndarray:
        """The internal states after reset in the input-gain case `scale` (zeros without internal states)."""
        z0 = np.zeros(self.internal_dim) if self.internal_init is None else np.asarray(self.internal_init, np.float64)
        return z0 if self.internal_init_gain is None else z0 + (scale - 1.0) * self.internal_init_gain


@dataclass
class ShieldSpec:
    """Validated content of `shield.json` (see the module docstring for the meaning of each field)."""

    obs_dim: int
    act_dim: int
    dt: float
    action_low: list[float]
    action_high: list[float]
    state_index: list[int]
    model: dict
    position_index: list[int]
    velocity_index: list[int]
    brake_accel: list[float]  # per position, the smaller of its two directions
    constraints: list[dict]
    latency_steps: int = 0
    margin: float = 0.0
    input_gain_error: float = 0.0
    disturbance_accel: list[float] | None = None
    fallback_action: list[float] | None = None
    # Per action, True where the actuator takes a set-point (a position servo): its fallback is the last action sent,
    # which holds the set-point, not the constant, which commands a move there. None: the constant everywhere.
    fallback_hold: list[bool] | None = None
    assumptions: dict = field(default_factory=dict)
    task: str = ""
    # Per position: (acceleration the plant can brake with toward -, toward +); default (empty) both brake_accel.
    brake_accel_pairs: list[tuple[float, float]] = field(default_factory=list)
    # Keep-out rows credit the plant's sideways speed (it may pass the zone, not only stop before it).
    keepout_steering: bool = False
    # The fewest latency steps the plant may have (None: exactly latency_steps). Each latency from it to
    # latency_steps is a case of its own in the prediction, as each end of the input-gain error is.
    latency_min_steps: int | None = None
    # Per position, (toward -, toward +): the speed (units/s) a push may leave that the braking toward that side
    # cannot take off while it lasts (None: zero); every barrier row brakes from its closing speed plus it.
    push_velocity: list[tuple[float, float]] | None = None
    # Observation entries that are angles of joints that turn without limit, with the angle each is wrapped
    # around: the shield reads each in (center - pi, center + pi]. None: no entry is wrapped.
    angles: list[tuple[int, float]] | None = None
    # The input's effect over nominal as measured, (low, high); None: 1 +- input_gain_error.
    input_gain_range: tuple[float, float] | None = None
    # The predictive safety filter's numbers (`shield.predictive`); None: the braking barrier filters.
    predictive: dict | None = None

    def __post_init__(self):
        if not self.brake_accel_pairs:
            self.brake_accel_pairs = [(float(a), float(a)) for a in self.brake_accel]

    # ---- (de)serialization -------------------------------------------------
    @classmethod
    def from_dict(cls, d: Any) -> ShieldSpec:
        """Validate a parsed shield.json mapping; raise ShieldSpecError naming the bad key."""
        if not isinstance(d, dict):
            _fail("<root>", f"must be a mapping, got {type(d).__name__}")
        known = {
            "schema_version",
            "task",
            "obs_dim",
            "act_dim",
            "dt",
            "action_low",
            "action_high",
            "state_index",
            "model",
            "kinematics",
            "constraints",
            "latency_steps",
            "latency_min_steps",
            "margin",
            "input_gain_error",
            "input_gain_range",
            "disturbance_accel",
            "push_velocity",
            "angles",
            "fallback_action",
            "fallback_hold",
            "assumptions",
            "predictive",
        }
        for k in d:
            if k not in known:
                _fail(str(k), "unknown key")
        version = _need(d, "schema_version", "")
        if version != SCHEMA_VERSION:
            _fail("schema_version", f"unsupported version {version!r} (this shield reads {SCHEMA_VERSION})")
        obs_dim, act_dim = _need(d, "obs_dim", ""), _need(d, "act_dim", "")
        for k, v in (("obs_dim", obs_dim), ("act_dim", act_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                _fail(k, f"must be a positive integer, got {v!r}")
        dt = _number(_need(d, "dt", ""), "dt", 0.0, low_open=True)
        low = _finite(_need(d, "action_low", ""), "action_low", act_dim)
        high = _finite(_need(d, "action_high", ""), "action_high", act_dim)
        for i, (lo, hi) in enumerate(zip(low, high)):
            if lo > hi:
                _fail(f"action_low[{i}]", f"{lo} exceeds action_high[{i}] = {hi}")
        state_index = _indices(_need(d, "state_index", ""), "state_index", obs_dim)
        kin = _need(d, "kinematics", "")
        pos = _indices(_need(kin, "position_index", "kinematics"), "kinematics.position_index", obs_dim)
        vel = _indices(_need(kin, "velocity_index", "kinematics"), "kinematics.velocity_index", obs_dim)
        if len(pos) != len(vel):
            _fail("kinematics.velocity_index", f"must pair with position_index ({len(pos)} entries), got {len(vel)}")
        for k, idx in (("kinematics.position_index", pos), ("kinematics.velocity_index", vel)):
            for i in idx:
                if i not in state_index:
                    _fail(k, f"observation index {i} is not in state_index")
        pairs = brake_pairs(_need(kin, "brake_accel", "kinematics"), len(pos))
        brake = [min(p) for p in pairs]
        for k in kin:
            if k not in ("position_index", "velocity_index", "brake_accel", "keepout_steering"):
                _fail(f"kinematics.{k}", "unknown key")
        steering = kin.get("keepout_steering", False)
        if not isinstance(steering, bool):
            _fail("kinematics.keepout_steering", f"must be true or false, got {steering!r}")
        model = _need(d, "model", "")
        cls._check_model(model, len(state_index), act_dim, state_index, pos, vel)
        constraints = _need(d, "constraints", "")
        if not isinstance(constraints, list):
            _fail("constraints", "must be a list")
        names = set()
        for i, con in enumerate(constraints):
            cls._check_constraint(con, f"constraints[{i}]", obs_dim, state_index)
            if con["name"] in names:
                _fail(f"constraints[{i}].name", f"duplicate name {con['name']!r}")
            names.add(con["name"])
        latency = d.get("latency_steps", 0)
        if isinstance(latency, bool) or not isinstance(latency, int) or latency < 0:
            _fail("latency_steps", f"must be a non-negative integer, got {latency!r}")
        latency_min = d.get("latency_min_steps")
        if latency_min is not None and (
            isinstance(latency_min, bool) or not isinstance(latency_min, int) or not 0 <= latency_min <= latency
        ):
            _fail("latency_min_steps", f"must be an integer from 0 to latency_steps ({latency}), got {latency_min!r}")
        margin = _number(d.get("margin", 0.0), "margin", 0.0)
        gain_error = _number(d.get("input_gain_error", 0.0), "input_gain_error", 0.0, MAX_INPUT_GAIN_ERROR)
        gain_range = d.get("input_gain_range")
        if gain_range is not None:
            lo_g, hi_g = _finite(gain_range, "input_gain_range", 2)
            if not 0.0 < lo_g <= 1.0 <= hi_g:
                _fail("input_gain_range", f"must be [low, high] with 0 < low <= 1 <= high, got {gain_range!r}")
            # The range's ends are the gain cases; input_gain_error bounds how weak the input gets (its low end),
            # while the high end may pass 1 + input_gain_error (a light load can more than double the effect).
            if lo_g < 1.0 - gain_error - 1e-9:
                _fail("input_gain_range", f"{gain_range!r}: its low end is below 1 - input_gain_error ({gain_error})")
            gain_range = (lo_g, hi_g)
        disturbance = _finite(d.get("disturbance_accel", [0.0] * len(pos)), "disturbance_accel", len(pos))
        for i, w in enumerate(disturbance):
            if w < 0:
                _fail(f"disturbance_accel[{i}]", f"must be >= 0, got {w}")
        kick = d.get("push_velocity")
        if kick is not None:
            kick = direction_pairs(kick, len(pos), "push_velocity", zero_ok=True)
        angles = d.get("angles")
        if angles is not None:
            angles = _angles(angles, obs_dim, state_index)
        fallback = d.get("fallback_action")
        if fallback is not None:
            fallback = _finite(fallback, "fallback_action", act_dim)
            for i, v in enumerate(fallback):
                if not low[i] <= v <= high[i]:
                    _fail(f"fallback_action[{i}]", f"{v} is outside the action box [{low[i]}, {high[i]}]")
        hold = d.get("fallback_hold")
        if hold is not None and (
            not isinstance(hold, list) or len(hold) != act_dim or not all(isinstance(h, bool) for h in hold)
        ):
            _fail("fallback_hold", f"must be a list of {act_dim} booleans (true: hold the last action sent)")
        assumptions = d.get("assumptions", {})
        if not isinstance(assumptions, dict):
            _fail("assumptions", "must be a mapping")
        task = d.get("task", "")
        if not isinstance(task, str):
            _fail("task", "must be a string")
        predictive = d.get("predictive")
        if predictive is not None:
            if model["type"] != "linear":
                _fail("predictive", "needs model.type: linear")
            n_state = len(state_index) + int(model.get("internal_dim", 0))
            n_rows = sum(len(parse_constraint(c, "constraints", obs_dim).rows()) for c in constraints)
            predictive = _predictive(predictive, n_state, act_dim, n_rows, latency)
        return cls(
            obs_dim=obs_dim,
            act_dim=act_dim,
            dt=dt,
            action_low=low,
            action_high=high,
            state_index=state_index,
            model=model,
            position_index=pos,
            velocity_index=vel,
            brake_accel=brake,
            brake_accel_pairs=pairs,
            constraints=constraints,
            latency_steps=latency,
            margin=margin,
            input_gain_error=gain_error,
            disturbance_accel=disturbance,
            fallback_action=fallback,
            fallback_hold=hold,
            assumptions=assumptions,
            task=task,
            keepout_steering=steering,
            latency_min_steps=latency_min,
            push_velocity=kick,
            angles=angles,
            input_gain_range=gain_range,
            predictive=predictive,
        )

    @staticmethod
    def _check_model(model: Any, n: int, m: int, state_index: list[int], pos: list[int], vel: list[int]) -> None:
        mtype = _need(model, "type", "model")
        if mtype not in MODEL_TYPES:
            _fail("model.type", f"must be one of {MODEL_TYPES}, got {mtype!r}")
        if mtype == "linear":
            nz = model.get("internal_dim", 0)
            if isinstance(nz, bool) or not isinstance(nz, int) or nz < 0:
                _fail("model.internal_dim", f"must be a non-negative integer, got {nz!r}")
            _matrix(_need(model, "A", "model"), "model.A", n + nz, n + nz)
            _matrix(_need(model, "B", "model"), "model.B", n + nz, m)
            _finite(_need(model, "c", "model"), "model.c", n + nz)
            for k in model:
                if k not in ("type", "A", "B", "c", "internal_dim"):
                    _fail(f"model.{k}", "unknown key")
        else:
            k_axes = len(pos)
            _matrix(_need(model, "accel_per_action", "model"), "model.accel_per_action", k_axes, m)
            _finite(model.get("accel_offset", [0.0] * k_axes), "model.accel_offset", k_axes)
            _finite(model.get("gain_scaled_accel", [0.0] * k_axes), "model.gain_scaled_accel", k_axes)
            _number(model.get("response_time_s", 0.0), "model.response_time_s", 0.0)
            if sorted(state_index) != sorted(pos + vel):
                _fail("state_index", "a double_integrator state is exactly the positions and velocities")
            for k in model:
                if k not in ("type", "accel_per_action", "accel_offset", "gain_scaled_accel", "response_time_s"):
                    _fail(f"model.{k}", "unknown key")

    @staticmethod
    def _check_constraint(con: Any, key: str, obs_dim: int, state_index: list[int]) -> None:
        try:
            used = parse_constraint(con, key, obs_dim).used
        except ConstraintError as err:
            raise ShieldSpecError(f"shield spec: {err}") from None
        for i in used:
            if i not in state_index:
                _fail(key, f"observation index {i} is not in state_index")

    def constraint_objects(self) -> list[Constraint]:
        """The constraints as `shield.constraints` objects (value, violation, barrier rows)."""
        return [parse_constraint(c, f"constraints[{i}]", self.obs_dim) for i, c in enumerate(self.constraints)]

    def action_box32(self) -> tuple[np.ndarray, np.ndarray]:
        """(low, high) as float32: the widest box of float32 values inside the declared one, so every float32
        action in it is inside the declared bounds (a bound like 0.3 has no float32: rounding it would land
        1e-8 outside). Where a degenerate [c, c] holds no float32, the float32 nearest c."""
        low, high = np.asarray(self.action_low, np.float64), np.asarray(self.action_high, np.float64)
        nearest_low, nearest_high = low.astype(np.float32), high.astype(np.float32)
        low32 = np.where(nearest_low < low, np.nextafter(nearest_low, np.float32(np.inf)), nearest_low)
        high32 = np.where(nearest_high > high, np.nextafter(nearest_high, np.float32(-np.inf)), nearest_high)
        empty = low32 > high32
        return np.where(empty, nearest_low, low32), np.where(empty, nearest_low, high32)

    def to_dict(self) -> dict:
        """The JSON-ready mapping (inverse of `from_dict`)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "task": self.task,
            "obs_dim": self.obs_dim,
            "act_dim": self.act_dim,
            "dt": self.dt,
            "action_low": list(self.action_low),
            "action_high": list(self.action_high),
            "state_index": list(self.state_index),
            "model": self.model,
            "kinematics": {
                "position_index": list(self.position_index),
                "velocity_index": list(self.velocity_index),
                "brake_accel": pairs_to_list(self.brake_accel_pairs),
                **({"keepout_steering": True} if self.keepout_steering else {}),
            },
            "constraints": self.constraints,
            "latency_steps": self.latency_steps,
            **({"latency_min_steps": self.latency_min_steps} if self.latency_min_steps is not None else {}),
            "margin": self.margin,
            "input_gain_error": self.input_gain_error,
            **({"input_gain_range": list(self.input_gain_range)} if self.input_gain_range is not None else {}),
            "disturbance_accel": list(self.disturbance_accel or [0.0] * len(self.position_index)),
            **({"push_velocity": pairs_to_list(self.push_velocity)} if self.push_velocity is not None else {}),
            **({"angles": angles_to_dict(self.angles)} if self.angles is not None else {}),
            "fallback_action": self.fallback_action,
            **({"fallback_hold": list(self.fallback_hold)} if self.fallback_hold is not None else {}),
            "assumptions": self.assumptions,
            **({"predictive": self.predictive} if self.predictive is not None else {}),
        }

    @classmethod
    def load(cls, path: str | Path) -> ShieldSpec:
        """Read and validate a shield.json file."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as err:
            raise ShieldSpecError(f"cannot read shield spec {path}: {err.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ShieldSpecError(f"shield spec {path} is not valid JSON: {err}") from None
        try:
            return cls.from_dict(data)
        except ShieldSpecError as err:
            raise ShieldSpecError(f"{path}: {err}") from None

    def save(self, path: str | Path) -> None:
        """Write the spec as indented JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    # ---- derived quantities -------------------------------------------------
    def gain_scales(self) -> list[float]:
        """The input's effect over nominal in each gain case: the measured range's ends, else 1 +- the error."""
        if self.input_gain_range is not None:
            lo, hi = self.input_gain_range
            return [lo] if lo == hi else [lo, hi]
        err = self.input_gain_error
        return [1.0] if err == 0.0 else [1.0 - err, 1.0 + err]

    def linear_model(self) -> LinearModel:
        """The nominal model in discrete linear form over ``[obs[state_index], internal]``."""
        m = self.model
        if m["type"] == "linear":
            nz = int(m.get("internal_dim", 0))
            return LinearModel(
                np.asarray(m["A"], np.float64), np.asarray(m["B"], np.float64), np.asarray(m["c"], np.float64), nz
            )
        k = len(self.position_index)
        args = (
            self.state_index,
            self.position_index,
            self.velocity_index,
            np.asarray(m["accel_per_action"], np.float64),
        )
        offset = np.asarray(m.get("accel_offset", [0.0] * k), np.float64)
        tau = float(m.get("response_time_s", 0.0))
        model = double_integrator_model(*args, offset, tau, self.dt)
        scaled = np.asarray(m.get("gain_scaled_accel", [0.0] * k), np.float64)
        if np.any(scaled != 0.0):  # the model is affine in the offset: its gain-scaled part is a difference
            with_scaled = double_integrator_model(*args, offset + scaled, tau, self.dt)
            model.c_gain = with_scaled.c - model.c
            model.internal_init_gain = scaled.copy() if model.internal_dim else None
        return model


PREDICTIVE_KEYS = (
    "horizon",
    "backup_gain",
    "operating_point",
    "hold_projection",
    "hold_action",
    "hold_trim",
    "tube",
    "tube_slope",
    "tube_action_slope",
    "tube_floor",
    "terminal_box",
    "terminal_reach",
    "free_states",
    "measured",
)


def _predictive(value: Any, n: int, m: int, rows: int, latency: int) -> dict:
    """The `predictive` section (see `shield.predictive`): every number checked for shape and sign."""
    if not isinstance(value, dict):
        _fail("predictive", f"must be a mapping, got {type(value).__name__}")
    for k in value:
        if k not in PREDICTIVE_KEYS:
            _fail(f"predictive.{k}", "unknown key")
    horizon = _need(value, "horizon", "predictive")
    if isinstance(horizon, bool) or not isinstance(horizon, int) or not 1 <= horizon <= 1000:
        _fail("predictive.horizon", f"must be an integer from 1 to 1000 (control steps), got {horizon!r}")
    _matrix(_need(value, "backup_gain", "predictive"), "predictive.backup_gain", m, n)
    _finite(_need(value, "operating_point", "predictive"), "predictive.operating_point", n)
    _matrix(_need(value, "hold_projection", "predictive"), "predictive.hold_projection", n, n)
    if "hold_action" in value:
        _matrix(value["hold_action"], "predictive.hold_action", m, n)
    if "hold_trim" in value:  # the action that holds the operating point itself (a hoist's weight)
        _finite(value["hold_trim"], "predictive.hold_trim", m)
    tube = _matrix(_need(value, "tube", "predictive"), "predictive.tube", horizon, n)
    floor = value.get("tube_floor")
    floor_vals = [] if floor is None else _matrix(floor, "predictive.tube_floor", horizon, n).reshape(-1).tolist()
    box = _finite(_need(value, "terminal_box", "predictive"), "predictive.terminal_box", n)
    reach = _finite(_need(value, "terminal_reach", "predictive"), "predictive.terminal_reach", rows)
    if "free_states" in value:  # states the model says move nothing (checked against it by the filter)
        _indices(value["free_states"], "predictive.free_states", n)
    slope = value.get("tube_slope")
    if slope is not None and (not isinstance(slope, (list, tuple)) or len(slope) != horizon):
        _fail("predictive.tube_slope", f"must be {horizon} {n}x{n} matrices (one per step of the horizon)")
    slope_vals = [v for j, s in enumerate(slope or []) for v in _matrix(s, f"predictive.tube_slope[{j}]", n, n).flat]
    # Per step, state and action in flight (the pending ones oldest first, then the candidate): the growth per unit
    # of |action|.
    acts = (latency + 1) * m
    act_slope = value.get("tube_action_slope")
    if act_slope is not None and (not isinstance(act_slope, (list, tuple)) or len(act_slope) != horizon):
        _fail("predictive.tube_action_slope", f"must be {horizon} {n}x{acts} matrices (one per step of the horizon)")
    act_vals = [
        v for j, s in enumerate(act_slope or []) for v in _matrix(s, f"predictive.tube_action_slope[{j}]", n, acts).flat
    ]
    for key, vals in (
        ("tube", tube.reshape(-1).tolist()),
        ("tube_slope", slope_vals),
        ("tube_action_slope", act_vals),
        ("tube_floor", floor_vals),
        ("terminal_box", box),
        ("terminal_reach", reach),
    ):
        if min(vals, default=0.0) < 0.0:
            _fail(f"predictive.{key}", "must be >= 0 everywhere")
    measured = value.get("measured", {})
    if not isinstance(measured, dict):
        _fail("predictive.measured", "must be a mapping")
    return dict(value)


def _angles(value: Any, obs_dim: int, state_index: list[int]) -> list[tuple[int, float]]:
    """`angles`: {"index": observation entries in state_index, "center": the angle each is wrapped around
    (default 0 each)}, as (index, center) pairs."""
    if not isinstance(value, dict):
        _fail("angles", f"must be a mapping with index (and center), got {value!r}")
    for k in value:
        if k not in ("index", "center"):
            _fail(f"angles.{k}", "unknown key")
    index = _indices(_need(value, "index", "angles"), "angles.index", obs_dim)
    for i in index:
        if i not in state_index:
            _fail("angles.index", f"observation index {i} is not in state_index")
    center = _finite(value.get("center", [0.0] * len(index)), "angles.center", len(index))
    return list(zip(index, center))


def angles_to_dict(angles: list[tuple[int, float]]) -> dict:
    """(observation index, center) pairs as the spec writes them: {"index": [...], "center": [...]}."""
    return {"index": [i for i, _ in angles], "center": [c for _, c in angles]}


def brake_pairs(value: Any, k: int) -> list[tuple[float, float]]:
    """`kinematics.brake_accel` as (toward -, toward +) per position: each entry a number (both directions) or
    [toward -, toward +], each > 0 (the one parser of the form: the spec builder and the envelope check use it too)."""
    return direction_pairs(value, k, "kinematics.brake_accel", zero_ok=False)


def direction_pairs(value: Any, k: int, key: str, zero_ok: bool) -> list[tuple[float, float]]:
    """A per-position figure as (toward -, toward +): each entry a number (both directions) or [toward -, toward +],
    each > 0 (>= 0 with `zero_ok`); a bad entry fails naming `key` and its index."""
    if not isinstance(value, (list, tuple)) or len(value) != k:
        _fail(key, f"must be a list of {k} entries (a number, or [toward -, toward +]), got {value!r}")
    out = []
    for i, v in enumerate(value):
        pair = _finite(v, f"{key}[{i}]", 2) if isinstance(v, (list, tuple)) else _finite([v], f"{key}[{i}]")
        for a in pair:
            if a < 0 or (a == 0 and not zero_ok):
                _fail(f"{key}[{i}]", f"must be {'>=' if zero_ok else '>'} 0, got {v!r}")
        out.append((pair[0], pair[-1]))
    return out


def pairs_to_list(pairs: list[tuple[float, float]]) -> list:
    """(toward -, toward +) per position back to the spec's form: a number where both are equal."""
    return [lo if lo == hi else [lo, hi] for lo, hi in pairs]


def double_integrator_model(
    state_index: list[int],
    pos: list[int],
    vel: list[int],
    accel_per_action: np.ndarray,
    accel_offset: np.ndarray,
    response_time_s: float,
    dt: float,
    substeps: int = 50,
) -> LinearModel:
    """Discretize p'' = a, a' = (M u + a0 - a) / tau (tau = response_time_s, s) over one period dt (s).

    With tau > 0 the realized acceleration is an internal (predicted, not observed)
    state. The step is composed from `substeps` semi-implicit Euler substeps, which
    is linear, so the result is exact for that integrator and close to the ODE.
    """
    k = len(pos)
    n = len(state_index)
    lag = response_time_s > 0.0
    nz = k if lag else 0
    N = n + nz
    ip = [state_index.index(i) for i in pos]
    iv = [state_index.index(i) for i in vel]
    h = dt / substeps
    # One substep as an affine map of [x, u, 1].
    A1 = np.eye(N)
    B1 = np.zeros((N, accel_per_action.shape[1]))
    c1 = np.zeros(N)
    if lag:
        iz = list(range(n, n + k))
        alpha = 1.0 - math.exp(-h / response_time_s)
        # z+ = (1-alpha) z + alpha (M u + a0); v+ = v + h z+; p+ = p + h v+
        A1[iz, iz] = 1.0 - alpha
        B1[iz, :] = alpha * accel_per_action
        c1[iz] = alpha * accel_offset
        Az, Bz, cz = A1[iz, :].copy(), B1[iz, :].copy(), c1[iz].copy()
        A1[iv, :] += h * Az
        B1[iv, :] += h * Bz
        c1[iv] += h * cz
    else:
        B1[iv, :] = h * accel_per_action
        c1[iv] = h * accel_offset
    Av, Bv, cv = A1[iv, :].copy(), B1[iv, :].copy(), c1[iv].copy()
    A1[ip, :] += h * Av
    B1[ip, :] += h * Bv
    c1[ip] += h * cv
    A, B, c = np.eye(N), np.zeros_like(B1), np.zeros(N)
    for _ in range(substeps):
        A, B, c = A1 @ A, A1 @ B + B1, A1 @ c + c1
    # After reset the plant hovers/rests: realized acceleration = the offset.
    return LinearModel(A, B, c, nz, np.asarray(accel_offset, np.float64).copy() if lag else None)


def same_spec(a: ShieldSpec | None, b: ShieldSpec | None) -> bool:
    """True when two specs are the same by content (a shield.json written again with other whitespace or key
    order is the same spec), or when neither is given."""
    if a is None or b is None:
        return a is b
    return a is b or a.to_dict() == b.to_dict()
