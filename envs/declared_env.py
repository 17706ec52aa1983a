"""The env every declared task runs: observations, actions, reward, termination and cost read from a `plant:` section.

`bind(decl, model)` resolves every MuJoCo name once (and is the check `sim2real
config --check` runs); the env's hot path then reads plain index lists.
info["cost"] is 1.0 when a declared constraint is violated by the TRUE
observation (noise is added outside, by the wrappers). The reward terms and
termination read the float32 observation, or (`numerics.values: state`) the
float64 values it is rounded from.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import mujoco
import numpy as np

from envs.declaration import DeclarationError, PlantDeclaration, resolve_entry_point
from envs.linearization import NominalModel, apply_held_action, without_dry_friction
from envs.mujoco_task import MujocoTaskEnv
from envs.safety import constraint_values, cost_of
from shield.constraints import wrap_angle

_OBJ = {
    "joint": mujoco.mjtObj.mjOBJ_JOINT,
    "site": mujoco.mjtObj.mjOBJ_SITE,
    "sensor": mujoco.mjtObj.mjOBJ_SENSOR,
    "actuator": mujoco.mjtObj.mjOBJ_ACTUATOR,
}
_COUNT = {"joint": "njnt", "site": "nsite", "sensor": "nsensor", "actuator": "nu"}
_SCALAR_JOINTS = (int(mujoco.mjtJoint.mjJNT_HINGE), int(mujoco.mjtJoint.mjJNT_SLIDE))


def _element(model: mujoco.MjModel, kind: str, name: str, where: str, label: str) -> int:
    idx = mujoco.mj_name2id(model, _OBJ[kind], name)
    if idx < 0:
        names = [mujoco.mj_id2name(model, _OBJ[kind], i) for i in range(getattr(model, _COUNT[kind]))]
        raise DeclarationError(f"{where}: no {kind} named {name!r} in {label}; {kind}s are {[n for n in names if n]}")
    return idx


def _joint_address(model, name: str, where: str, label: str, quantity: str) -> int:
    j = _element(model, "joint", name, where, label)
    if int(model.jnt_type[j]) not in _SCALAR_JOINTS:
        raise DeclarationError(
            f"{where}: joint {name!r} is not a hinge or slide joint (free and ball joints "
            f"are observed through sites or sensors)"
        )
    return int(model.jnt_qposadr[j]) if quantity == "pos" else int(model.jnt_dofadr[j])


@dataclass(frozen=True)
class Binding:
    """A declaration's names resolved against one compiled model: where each number is read and written."""

    sources: list[
        tuple
    ]  # per observation: ("qpos"|"qvel", adr) | ("site", id, axis) | ("sensor", adr) | ("target", name, i)
    ctrl: list[int]  # actuator id per action element
    scale: np.ndarray  # ctrl per unit action
    substeps: int


def bind(decl: PlantDeclaration, model: mujoco.MjModel, label: str = "the MJCF") -> Binding:
    """Resolve every name in `decl` against `model`; DeclarationError naming the key path otherwise."""
    sources = []
    for i, o in enumerate(decl.observations):
        where = f"plant.observations[{i}]"
        if o.joint is not None:
            adr = _joint_address(model, o.joint, f"{where}.joint", label, o.quantity)
            sources.append(("qpos" if o.quantity == "pos" else "qvel", adr))
        elif o.site is not None:
            sources.append(("site", _element(model, "site", o.site, f"{where}.site", label), o.axis))
        elif o.sensor is not None:
            s = _element(model, "sensor", o.sensor, f"{where}.sensor", label)
            if o.index >= int(model.sensor_dim[s]):
                raise DeclarationError(f"{where}.index: sensor {o.sensor!r} has {int(model.sensor_dim[s])} elements")
            sources.append(("sensor", int(model.sensor_adr[s]) + o.index))
        else:
            sources.append(("target", o.target, o.index))
    ctrl = [
        _element(model, "actuator", a.name, f"plant.actuators[{i}].name", label) for i, a in enumerate(decl.actuators)
    ]
    for kind, ranges in decl.initial_state.items():
        for name in ranges:
            _joint_address(model, name, f"plant.initial_state.{kind}.{name}", label, "pos" if kind == "qpos" else "vel")
    for name in decl.shield_model.operating_point:
        _joint_address(model, name, f"plant.shield_model.operating_point.{name}", label, "pos")
    substeps = round(decl.control_period / model.opt.timestep)
    if substeps < 1 or not math.isclose(substeps * model.opt.timestep, decl.control_period, rel_tol=1e-6):
        raise DeclarationError(
            f"plant.control_period: {decl.control_period} s is not a whole number of the "
            f"MJCF's {model.opt.timestep} s physics steps"
        )
    _past_stops(decl, model, sources, label)
    return Binding(sources, ctrl, np.array([a.scale for a in decl.actuators]), substeps)


# An operating point this share of a limited joint's range from a stop is at it: the linearization's finite
# differences step into the stop's contact, and its stiffness reads as the plant's (helper-65's hoist linearized at
# its bottom stop: a model error of 3,305 m/s^2, refused as a latency and ranges problem).
STOP_ROOM = 0.01


def _past_stops(decl: PlantDeclaration, model: mujoco.MjModel, sources: list[tuple], label: str) -> None:
    """DeclarationError where the shield's operating point sits at a joint's stop, or a box constraint admits a
    joint's position past its stop: at a stop the drive's effect is the contact's, and no shield keeps a limit the
    stop keeps first."""

    # The limited scalar joints, by their position's address: (joint, low stop, high stop).
    stops = {
        int(model.jnt_qposadr[j]): (
            mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_JOINT, j) or f"joint {j}",
            float(model.jnt_range[j][0]),
            float(model.jnt_range[j][1]),
        )
        for j in range(model.njnt)
        if int(model.jnt_type[j]) in _SCALAR_JOINTS and model.jnt_limited[j]
    }

    def units(joint: str) -> str:
        j = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_JOINT, joint)
        hinge = int(model.jnt_type[j]) == int(mujoco.mjtJoint.mjJNT_HINGE)
        # An outside user's hinge range="-1.2 1.2" meant radians and compiled to 1.2 degrees.
        return (
            ' (compiled to rad: an MJCF reads hinge ranges in degrees unless <compiler angle="radian"/>)'
            if hinge
            else ""
        )

    if decl.shield_model.type == "linear":
        for name, value in decl.shield_model.operating_point.items():
            found = stops.get(_joint_address(model, name, "", label, "pos"))
            if found is None:
                continue
            _, lo, hi = found
            room = STOP_ROOM * (hi - lo)
            if not lo + room < value < hi - room:
                raise DeclarationError(
                    f"plant.shield_model.operating_point.{name}: {value:g} is at or past a stop of joint {name!r} "
                    f"(its range in {label} is [{lo:g}, {hi:g}]{units(name)}): linearized there, the stop's contact "
                    f"reads as the plant's dynamics. Linearize inside the range, where the plant works (inside the "
                    f"constraints)"
                )
    names = [o.name for o in decl.observations]
    for i, c in enumerate(decl.constraints):
        if c.type != "box" or c.low is None or c.high is None:
            continue
        for obs, low, high in zip(c.observations, c.low, c.high):
            source = sources[names.index(obs)] if obs in names else None
            found = stops.get(source[1]) if source is not None and source[0] == "qpos" else None
            if found is None:
                continue
            joint, lo, hi = found
            if low < lo or high > hi:
                raise DeclarationError(
                    f"plant.constraints[{i}] ({c.name}): admits {obs} over [{low:g}, {high:g}], past a stop of "
                    f"joint {joint!r} (its range in {label} is [{lo:g}, {hi:g}]{units(joint)}): the stop keeps the "
                    f"plant there before any shield can, and at the stop the drive's effect is the contact's. Keep "
                    f"each limit inside the joint's range, where the plant must stay short of its stops"
                )


def nominal_model(decl: PlantDeclaration, path: Path) -> NominalModel:
    """The nominal plant at the declared operating point; DeclarationError unless it is an equilibrium there."""
    model = mujoco.MjModel.from_xml_path(str(path))
    binding = bind(decl, model, path.name)
    if model.opt.integrator == mujoco.mjtIntegrator.mjINT_RK4:
        raise DeclarationError(
            f'plant.mjcf: {path.name} sets <option integrator="RK4">: the linear shield model and an lqr legacy '
            f"controller are linearized by MuJoCo's finite differences (mjd_transitionFD), which RK4 does not "
            f"support; use Euler (the default), implicit or implicitfast"
        )
    data = mujoco.MjData(model)
    for name, value in decl.shield_model.operating_point.items():
        data.qpos[_joint_address(model, name, "", path.name, "pos")] = value
    # The shield's linear model x+ = A x + B u + c takes the operating point as a fixed point under the action that
    # holds it there: zero where the plant rests unpowered, else the steady action that carries its weight; both,
    # like the model, without dry friction.
    with without_dry_friction(model):
        mujoco.mj_forward(model, data)
        worst = float(np.max(np.abs(data.qacc))) if model.nv else 0.0
        trim = _holding_action(model, data, binding, worst) if worst > 1e-6 else None
    obs_to_state = {i: s for i, s in enumerate(binding.sources) if s[0] in ("qpos", "qvel")}
    return NominalModel(
        model=model,
        qpos=data.qpos.copy(),
        qvel=np.zeros(model.nv),
        substeps=binding.substeps,
        obs_to_state=obs_to_state,
        actuators=tuple(binding.ctrl),
        ctrl_per_action=tuple(float(x) for x in binding.scale),
        trim=None if trim is None else tuple(float(a) for a in trim),
        derived={i: s for i, s in enumerate(binding.sources) if s[0] in ("site", "sensor")},
    )


def _holding_action(model: mujoco.MjModel, data: mujoco.MjData, binding: Binding, worst: float) -> np.ndarray:
    """The action that holds the operating point (in `data`) still: a hoist's or a raised arm's weight carried by
    its drive. The accelerations are affine in the action (a motor's force is its gain times its control): a
    least-squares solve of the generalized forces over each action's effect gives it (refined once, for an
    actuator whose force is not exactly so), and what it leaves lies on the joints no actuator drives.
    DeclarationError where no action holds it (gravity on such a joint), or none within the action box."""
    qpos = data.qpos.copy()
    nu = len(binding.ctrl)

    def qacc(action: np.ndarray) -> np.ndarray:
        data.qpos[:], data.qvel[:] = qpos, 0.0
        apply_held_action(model, data, binding.ctrl, binding.scale, action)
        mujoco.mj_forward(model, data)
        return data.qacc.copy()

    base = qacc(np.zeros(nu))
    mass = np.zeros((model.nv, model.nv))
    mujoco.mj_fullM(model, data, mass)
    effect = mass @ np.column_stack([qacc(np.eye(nu)[j]) - base for j in range(nu)])  # force per unit action
    action = -np.linalg.lstsq(effect, mass @ base, rcond=None)[0]
    if float(np.abs(action).max()) <= 1.0:  # within the box (beyond it the control saturates): refine once
        action = action - np.linalg.lstsq(effect, mass @ qacc(action), rcond=None)[0]
    left = mass @ base + effect @ action  # the generalized force no action cancels
    data.qpos[:], data.qvel[:], data.ctrl[:], data.act[:] = qpos, 0.0, 0.0, 0.0
    mujoco.mj_forward(model, data)

    def joint_name(v: np.ndarray) -> str:
        dof = int(np.argmax(np.abs(v)))
        return mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_JOINT, int(model.dof_jntid[dof])) or f"dof {dof}"

    if float(np.abs(left).max()) > 1e-6 * max(1.0, float(np.abs(mass @ base).max())):
        raise DeclarationError(
            f"plant.shield_model.operating_point: not an equilibrium under any action (|qacc| up to {worst:.3g} "
            f"unpowered; {float(np.abs(left).max()):.3g} N or N m left on joint {joint_name(left)!r} at best): no "
            f"actuator holds that joint still there (gravity, or a spring, on a joint no actuator drives). "
            f"Linearize where it rests by itself, away from its stops: a hanging or upright pendulum, a level beam"
            + _nearby_rest(model, data, qpos, effect, left, joint_name(left))
        )
    if float(np.abs(action).max()) > 1.0:
        raise DeclarationError(
            f"plant.shield_model.operating_point: holding it still takes action {np.round(action, 3).tolist()} "
            f"(against the load on joint {joint_name(mass @ base)!r}: its weight or a spring), beyond the action "
            f"box [-1, 1]: the drive cannot carry it there. Give it a stronger drive (gear, units_per_action), or "
            f"linearize where it needs less"
        )
    return action


def _nearby_rest(model, data, qpos, effect, left, joint: str) -> str:
    """Where the joint left unheld would rest, one Newton step on its own position away (the others as declared):
    a spring that carries a weight is held at an angle given to more digits than a user rounds it to."""
    j = int(mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_JOINT, joint))
    if j < 0 or int(model.jnt_type[j]) not in (mujoco.mjtJoint.mjJNT_HINGE, mujoco.mjtJoint.mjJNT_SLIDE):
        return ""
    adr, dof, h = int(model.jnt_qposadr[j]), int(model.jnt_dofadr[j]), 1e-6
    moved = qpos.copy()
    moved[adr] += h
    qacc = _qacc_at(model, data, moved)
    full = np.zeros((model.nv, model.nv))
    mujoco.mj_fullM(model, data, full)  # at `moved`, where _qacc_at left the data
    base = full @ qacc
    action = -np.linalg.lstsq(effect, base, rcond=None)[0]
    slope = (float((base + effect @ action)[dof]) - float(left[dof])) / h
    data.qpos[:] = qpos
    mujoco.mj_forward(model, data)
    if not math.isfinite(slope) or abs(slope) < 1e-12:
        return ""
    rest = float(qpos[adr]) - float(left[dof]) / slope
    return (
        f"; with the other joints as declared, {joint!r} rests at about {rest:.6g}: declare that (a value rounded off "
        f"an equilibrium, a spring's angle under a weight say, leaves this much)"
    )


def _qacc_at(model, data, qpos) -> np.ndarray:
    """Unpowered qacc at rest at `qpos` (the data is left there)."""
    data.qpos[:], data.qvel[:], data.ctrl[:], data.act[:] = qpos, 0.0, 0.0, 0.0
    mujoco.mj_forward(model, data)
    return data.qacc.copy()


MAX_START_DRAWS = 1000  # draws of a start before a box with (almost) no start inside the limits is refused


class InitialStateError(ValueError):
    """plant.initial_state yields no start inside the constraints."""


def _outside(values: dict[str, float]) -> str:
    return ", ".join(f"{k} by {-v:.4g}" for k, v in values.items() if not v >= 0.0)


class DeclaredTaskEnv(MujocoTaskEnv):
    """A task from its declaration: reset draws, set-points, the reward terms, termination and the true-state cost."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 50}

    def __init__(self, decl: PlantDeclaration, mjcf: Path, render_mode: str | None = None):
        self.decl = decl
        self._load(mjcf, len(decl.observations), len(decl.actuators), decl.control_period, render_mode)
        self.metadata = {**self.metadata, "render_fps": int(round(1 / decl.control_period))}
        b = bind(decl, self.model, Path(mjcf).name)
        self._binding = b
        self._safety = decl.safety()
        # Set-points and goals are Python floats: the same IEEE arithmetic as numpy's, without its per-call cost.
        self._targets = {name: [0.0] * len(t.low) for name, t in decl.targets.items()}
        self._goals = {name: [0.0] * len(t.low) for name, t in decl.targets.items()}
        self._hold = {name: 0 for name in decl.targets}
        self._ramps = [
            (name, None if t.speed is None else t.speed * decl.control_period) for name, t in decl.targets.items()
        ]
        dt = decl.control_period
        self._draws = {
            name: (list(zip(t.low, t.high)), round(t.hold_s[0] / dt), round(t.hold_s[1] / dt) + 1)
            for name, t in decl.targets.items()
        }
        self._reward = [
            (
                t.term or "function",
                t.weight,
                [decl.index(n) for n in t.observations],
                [decl.index(n) for n in t.targets],
                t.clip,
                resolve_entry_point(t.function, f"plant.reward[{i}].function") if t.function else None,
            )
            for i, t in enumerate(decl.reward)
        ]
        self._ends = [(decl.index(t.observation), t.above, t.below, t.abs_above) for t in decl.termination]
        self._needs_before = any(t.term == "progress" for t in decl.reward)
        self._state_values = decl.numerics.values == "state"
        self._elementwise_effort = decl.numerics.effort == "elementwise"
        self._init = [
            (kind, _joint_address(self.model, name, "", "", "pos" if kind == "qpos" else "vel"), lo, hi)
            for kind, ranges in decl.initial_state.items()
            for name, (lo, hi) in ranges.items()
        ]
        self._gather = _gathers(b.sources)
        # An observed angle of a hinge without a range is observed wrapped into (c - pi, c + pi] around the
        # operating point c, as the linear shield model reads it (`pipeline.safety.shield_spec`): a heading started
        # at 2 pi is the heading 0 it is, to the policy, the legacy controller, the reward, the violation count and
        # the shield alike. A reaction wheel's angle turns many times a minute on a real plant; read as its encoder
        # counts it, it left the range a 5 s training episode showed, and a trained policy changed 6.1 % of its
        # steps at 16 turns against 0.03 % at 0. The edge wraps what the plant sends the same way (the contract's
        # `wraps_around`, `shield.policy.OnnxPolicy`).
        self._wrap = observed_wraps(decl, self.model, b)
        # mj_step computes site positions and sensor data before it integrates: an observation read from them
        # after the step would be one physics step older than the joints'. Refreshed where the plant reads them.
        self._refresh = any(src[0] in ("site", "sensor") for src in b.sources)
        self._ctrl = _index(b.ctrl)
        self._scale = None if bool(np.all(b.scale == 1.0)) else b.scale  # x 1.0 is exact: skipped
        self._from_targets = [(i, s[1], s[2]) for i, s in enumerate(b.sources) if s[0] == "target"]

    def _obs(self) -> np.ndarray:
        """The observation (float32)."""
        return self._values().astype(np.float32)

    def _values(self) -> np.ndarray:
        """The observation's float64 values, before rounding to float32."""
        d = self.data
        out = np.empty(len(self._binding.sources))
        for field, dst, src in self._gather:
            out[dst] = getattr(d, field)[src]
        for i, name, k in self._from_targets:
            out[i] = self._targets[name][k]
        for i, center in self._wrap:
            out[i] = wrap_angle(out[i], center)
        return out

    def _new_goal(self, name: str) -> None:
        # One scalar uniform per element: the same draws and values as one vector call, at a fraction of its cost.
        box, hold_lo, hold_end = self._draws[name]
        rng = self.np_random
        self._goals[name] = [rng.uniform(lo, hi) for lo, hi in box]
        self._hold[name] = int(rng.integers(hold_lo, hold_end))

    def _advance_targets(self) -> None:
        for name, ramp in self._ramps:
            goal = self._goals[name]
            if ramp is None:
                self._targets[name] = list(goal)
            else:
                cur = self._targets[name]
                for i, g in enumerate(goal):
                    cur[i] += min(max(g - cur[i], -ramp), ramp)
            self._hold[name] -= 1
            if self._hold[name] <= 0:
                self._new_goal(name)

    def _cost(self, obs) -> float:
        if self._wrap:  # observed wrapped already, but float32 may round c + pi just past it: as the shield reads it
            obs = obs.tolist()
            for i, center in self._wrap:
                obs[i] = wrap_angle(obs[i], center)
        self._constraint_values = constraint_values(self._safety, obs)
        return cost_of(self._constraint_values)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        # A start past a limit is a violation before any action, which no shield can prevent: the start is drawn
        # again until it lies inside every constraint. A box wholly inside them draws once, as it always did.
        for _ in range(MAX_START_DRAWS):
            obs = self._draw_start()
            cost = self._cost(obs)
            if not cost:
                break
        else:
            raise InitialStateError(
                f"plant.initial_state: none of {MAX_START_DRAWS} starts drawn from it lies inside every constraint "
                f"(the last one is outside {_outside(self._constraint_values)}): narrow it to starts inside the limits"
            )
        return obs, {"cost": cost, "constraint_values": self._constraint_values, "domain": {}}

    def _draw_start(self) -> np.ndarray:
        """One start as `reset` draws it (the initial state, then each target's first goal): its observation."""
        rng = self.np_random
        mujoco.mj_resetData(self.model, self.data)
        for kind, adr, lo, hi in self._init:
            getattr(self.data, kind)[adr] = rng.uniform(lo, hi)
        mujoco.mj_forward(self.model, self.data)
        for name, t in self.decl.targets.items():
            self._new_goal(name)
            # The observed set-point starts at the goal when it jumps, else at the middle of its box.
            self._targets[name] = (
                list(self._goals[name]) if t.speed is None else [0.5 * (lo + hi) for lo, hi in zip(t.low, t.high)]
            )
        return self._obs()

    def start_corners(self, scale: float = 1.0, limit: int = 4096, seed: int = 0) -> list[np.ndarray]:
        """The observations at the corners of plant.initial_state's box shrunk about its middle by `scale` (every
        corner, or `limit` of them drawn with `seed` where there are more), each set-point at the middle of its
        box: the extreme starts an episode can have. Leaves the env's own Generator untouched."""
        entries = [(kind, adr, 0.5 * (lo + hi), 0.5 * (hi - lo) * scale) for kind, adr, lo, hi in self._init]
        k = len(entries)
        if 2**k <= limit:
            signs = list(itertools.product((-1.0, 1.0), repeat=k))
        else:
            signs = [tuple(s) for s in np.random.default_rng(seed).choice((-1.0, 1.0), size=(limit, k))]
        saved = {name: list(v) for name, v in self._targets.items()}
        out = []
        try:
            for name, t in self.decl.targets.items():
                self._targets[name] = [0.5 * (lo + hi) for lo, hi in zip(t.low, t.high)]
            for corner in signs:
                mujoco.mj_resetData(self.model, self.data)
                for (kind, adr, mid, half), sign in zip(entries, corner):
                    getattr(self.data, kind)[adr] = mid + sign * half
                mujoco.mj_forward(self.model, self.data)
                out.append(self._obs())
        finally:
            self._targets.update(saved)
        return out

    def starts_outside(self, draws: int = 1000, seed: int = 0) -> tuple[int, dict[str, float]]:
        """Of `draws` starts drawn from plant.initial_state (each a first draw, none drawn again), how many lie outside
        a constraint, and per constraint the farthest one lies past it: what `sim2real config --check` reports."""
        self.reset(seed=seed)
        outside, worst = 0, {}
        for _ in range(draws):
            self._cost(self._draw_start())
            past = {k: -v for k, v in self._constraint_values.items() if not v >= 0.0}
            outside += bool(past)
            for k, v in past.items():
                worst[k] = max(worst.get(k, 0.0), v)
        self.reset(seed=seed)
        return outside, worst

    def _read(self) -> np.ndarray:
        """What the reward terms and termination read: the float32 observation or its float64 values."""
        return self._values() if self._state_values else self._obs()

    def step(self, action):
        a = np.minimum(np.maximum(np.asarray(action, dtype=np.float64).reshape(-1), -1.0), 1.0)  # np.clip, faster
        before = self._read() if self._needs_before else None
        self.data.ctrl[self._ctrl] = a if self._scale is None else a * self._scale
        mujoco.mj_step(self.model, self.data, nstep=self._binding.substeps)
        if self._refresh:
            mujoco.mj_forward(self.model, self.data)
        self._advance_targets()
        values = self._values()
        obs = values.astype(np.float32)
        cost = self._cost(obs)
        read = values if self._state_values else obs
        listed = read.tolist()
        reward = 0.0
        for term in self._reward:
            reward += self._term(term, before, read, listed, a, cost, self._elementwise_effort)
        terminated = not all(map(math.isfinite, listed))
        info = {"cost": cost, "constraint_values": self._constraint_values}
        if self.diverged():
            terminated = True
            info["diverged"] = True
        for i, above, below, abs_above in self._ends:
            v = listed[i]
            if (
                (above is not None and v > above)
                or (below is not None and v < below)
                or (abs_above is not None and abs(v) > abs_above)
            ):
                terminated = True
        return obs, float(reward), terminated, False, info

    @staticmethod
    def _term(term, before, obs, listed, a, cost, elementwise_effort: bool) -> float:
        """One term times its weight (`obs` and `before` are what `_read` gives, `listed` is obs.tolist())."""
        kind, w, obs_ix, ref_ix, clip, fn = term
        if kind == "alive":
            return w * 1.0
        if kind == "tracking" and len(obs_ix) == 1:  # |d|, from Python floats (the same values)
            dist = abs(listed[obs_ix[0]] - listed[ref_ix[0]])
            return w * (min(dist, clip) if clip is not None else dist)
        if kind == "effort":
            if elementwise_effort:
                total = 0.0
                for ai in a.tolist():
                    total += w * ai * ai
                return total
            return w * float(a @ a)
        if kind == "violation":
            return w * cost
        if kind == "function":
            return w * float(fn(obs, a, cost))
        dist = _distance(obs, obs_ix, obs, ref_ix)
        if kind == "tracking":
            return w * (min(dist, clip) if clip is not None else dist)
        # progress: distance closed this step, toward the set-point observed before it
        return w * (_distance(before, obs_ix, before, ref_ix) - _distance(obs, obs_ix, before, ref_ix))


def _index(ix: list[int]):
    """A slice for consecutive indices (slices read and assign in a fraction of the time), else the array."""
    return slice(ix[0], ix[0] + len(ix)) if ix == list(range(ix[0], ix[0] + len(ix))) else np.array(ix)


def unlimited_angles(model: mujoco.MjModel, obs_to_state: dict[int, tuple], qpos) -> list[tuple[int, float]]:
    """(observation index, its angle at `qpos`) of each observed position of a hinge without a range: such a joint
    turns without limit (a pole that falls spins round), and the shield and the violation count read it wrapped
    around the operating point. A hinge with a range stays inside it: read as it is."""
    free = {
        int(model.jnt_qposadr[j])
        for j in range(model.njnt)
        if int(model.jnt_type[j]) == mujoco.mjtJoint.mjJNT_HINGE and not model.jnt_limited[j]
    }
    return [(o, float(qpos[adr])) for o, (kind, adr) in sorted(obs_to_state.items()) if kind == "qpos" and adr in free]


def observed_wraps(decl: PlantDeclaration, model: mujoco.MjModel, binding: Binding) -> list[tuple[int, float]]:
    """(observation index, operating-point angle) of each observed angle of a hinge without a range, where the
    shield's model is linear (its operating point is where it was linearized): what the env observes wrapped
    into (c - pi, c + pi], and the contract states as `wraps_around`; [] for a model of another type."""
    if decl.shield_model.type != "linear":
        return []
    at = model.qpos0.copy()
    for name, value in decl.shield_model.operating_point.items():
        at[_joint_address(model, name, "", "", "pos")] = value
    joints = {i: src for i, src in enumerate(binding.sources) if src[0] in ("qpos", "qvel")}
    return unlimited_angles(model, joints, at)


def _gathers(sources: list[tuple]) -> list[tuple]:
    """(MjData field, observation indices, field indices) for each kind of MuJoCo source, read in one go."""
    out = []
    for kind, field in (("qpos", "qpos"), ("qvel", "qvel"), ("sensor", "sensordata"), ("site", "site_xpos")):
        rows = [(i, s[1:]) for i, s in enumerate(sources) if s[0] == kind]
        if rows:
            dst = _index([i for i, _ in rows])
            src = [r for _, r in rows]
            index = _index([r[0] for r in src]) if kind != "site" else tuple(np.array(k) for k in zip(*src))
            out.append((field, dst, index))
    return out


def _distance(x: np.ndarray, x_ix: list[int], y: np.ndarray, y_ix: list[int]) -> float:
    """Euclidean distance of x[x_ix] from y[y_ix] in float64; |d| for one element."""
    if len(x_ix) == 1:
        return abs(float(x[x_ix[0]]) - float(y[y_ix[0]]))
    return float(np.linalg.norm(x[x_ix].astype(np.float64) - y[y_ix]))
