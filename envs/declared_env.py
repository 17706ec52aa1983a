"""The env every declared task runs: observations, actions, reward, termination and cost read from a `plant:` section.

`bind(decl, model)` resolves every MuJoCo name once (and is the check `sim2real
config --check` runs); the env's hot path then reads plain index lists.
info["cost"] is 1.0 when a declared constraint is violated by the TRUE
observation (noise is added outside, by the wrappers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import mujoco
import numpy as np

from envs.declaration import DeclarationError, PlantDeclaration, resolve_entry_point
from envs.linearization import NominalModel
from envs.mujoco_task import MujocoTaskEnv
from envs.safety import violated_constraints

_OBJ = {"joint": mujoco.mjtObj.mjOBJ_JOINT, "site": mujoco.mjtObj.mjOBJ_SITE,
        "sensor": mujoco.mjtObj.mjOBJ_SENSOR, "actuator": mujoco.mjtObj.mjOBJ_ACTUATOR}
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
        raise DeclarationError(f"{where}: joint {name!r} is not a hinge or slide joint (free and ball joints "
                               f"are observed through sites or sensors)")
    return int(model.jnt_qposadr[j]) if quantity == "pos" else int(model.jnt_dofadr[j])


@dataclass(frozen=True)
class Binding:
    """A declaration's names resolved against one compiled model: where each number is read and written."""

    sources: list[tuple]  # per observation: ("qpos"|"qvel", adr) | ("site", id, axis) | ("sensor", adr) | ("target", name, i)
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
    ctrl = [_element(model, "actuator", a.name, f"plant.actuators[{i}].name", label) for i, a in enumerate(decl.actuators)]
    for kind, ranges in decl.initial_state.items():
        for name in ranges:
            _joint_address(model, name, f"plant.initial_state.{kind}.{name}", label, "pos" if kind == "qpos" else "vel")
    for name in decl.shield_model.operating_point:
        _joint_address(model, name, f"plant.shield_model.operating_point.{name}", label, "pos")
    substeps = round(decl.control_period / model.opt.timestep)
    if substeps < 1 or not math.isclose(substeps * model.opt.timestep, decl.control_period, rel_tol=1e-6):
        raise DeclarationError(f"plant.control_period: {decl.control_period} s is not a whole number of the "
                               f"MJCF's {model.opt.timestep} s physics steps")
    return Binding(sources, ctrl, np.array([a.scale for a in decl.actuators]), substeps)


def nominal_model(decl: PlantDeclaration, path: Path) -> NominalModel:
    """The nominal plant at the declared operating point; DeclarationError unless it is an equilibrium there."""
    model = mujoco.MjModel.from_xml_path(str(path))
    binding = bind(decl, model, path.name)
    data = mujoco.MjData(model)
    for name, value in decl.shield_model.operating_point.items():
        data.qpos[_joint_address(model, name, "", path.name, "pos")] = value
    mujoco.mj_forward(model, data)
    # The shield's linear model x+ = A x + B u + c takes the operating point as a fixed point under zero action.
    worst = float(np.max(np.abs(data.qacc))) if model.nv else 0.0
    if worst > 1e-6:
        raise DeclarationError(f"plant.shield_model.operating_point: not an equilibrium under zero action "
                               f"(|qacc| up to {worst:.3g}); linearize where the plant rests")
    obs_to_state = {i: s for i, s in enumerate(binding.sources) if s[0] in ("qpos", "qvel")}
    return NominalModel(model=model, qpos=data.qpos.copy(), qvel=np.zeros(model.nv), substeps=binding.substeps,
                        obs_to_state=obs_to_state)


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
        self._targets = {name: np.zeros(len(t.low)) for name, t in decl.targets.items()}
        self._goals = {name: np.zeros(len(t.low)) for name, t in decl.targets.items()}
        self._hold = {name: 0 for name in decl.targets}
        self._reward = [(t, [decl.index(n) for n in t.observations], [decl.index(n) for n in t.targets],
                         resolve_entry_point(t.function, f"plant.reward[{i}].function") if t.function else None)
                        for i, t in enumerate(decl.reward)]
        self._ends = [(decl.index(t.observation), t) for t in decl.termination]
        self._needs_before = any(t.term == "progress" for t in decl.reward)
        self._init = [(kind, _joint_address(self.model, name, "", "", "pos" if kind == "qpos" else "vel"), lo, hi)
                      for kind, ranges in decl.initial_state.items() for name, (lo, hi) in ranges.items()]

    def _obs(self) -> np.ndarray:
        d = self.data
        out = np.empty(len(self._binding.sources), np.float32)
        for i, s in enumerate(self._binding.sources):
            kind = s[0]
            if kind == "qpos":
                out[i] = d.qpos[s[1]]
            elif kind == "qvel":
                out[i] = d.qvel[s[1]]
            elif kind == "site":
                out[i] = d.site_xpos[s[1], s[2]]
            elif kind == "sensor":
                out[i] = d.sensordata[s[1]]
            else:
                out[i] = self._targets[s[1]][s[2]]
        return out

    def _new_goal(self, name: str) -> None:
        t, rng = self.decl.targets[name], self.np_random
        self._goals[name] = rng.uniform(t.low, t.high)
        lo, hi = t.hold_s
        dt = self.decl.control_period
        self._hold[name] = int(rng.integers(round(lo / dt), round(hi / dt) + 1))

    def _advance_targets(self) -> None:
        for name, t in self.decl.targets.items():
            if t.speed is None:
                self._targets[name] = self._goals[name].copy()
            else:
                ramp = t.speed * self.decl.control_period
                self._targets[name] += np.clip(self._goals[name] - self._targets[name], -ramp, ramp)
            self._hold[name] -= 1
            if self._hold[name] <= 0:
                self._new_goal(name)

    def _cost(self, obs) -> float:
        return 1.0 if violated_constraints(self._safety, obs) else 0.0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        rng = self.np_random
        mujoco.mj_resetData(self.model, self.data)
        for kind, adr, lo, hi in self._init:
            getattr(self.data, kind)[adr] = rng.uniform(lo, hi)
        mujoco.mj_forward(self.model, self.data)
        for name, t in self.decl.targets.items():
            self._new_goal(name)
            # The observed set-point starts at the goal when it jumps, else at the middle of its box.
            self._targets[name] = self._goals[name].copy() if t.speed is None else 0.5 * (np.asarray(t.low) + np.asarray(t.high))
        obs = self._obs()
        return obs, {"cost": self._cost(obs), "domain": {}}

    def step(self, action):
        a = np.clip(np.asarray(action, dtype=np.float64).reshape(-1), -1.0, 1.0)
        before = self._obs() if self._needs_before else None
        self.data.ctrl[self._binding.ctrl] = a * self._binding.scale
        mujoco.mj_step(self.model, self.data, nstep=self._binding.substeps)
        self._advance_targets()
        obs = self._obs()
        cost = self._cost(obs)
        reward = 0.0
        for term, obs_ix, ref_ix, fn in self._reward:
            reward += term.weight * self._term(term, obs_ix, ref_ix, fn, before, obs, a, cost)
        terminated = not bool(np.all(np.isfinite(obs)))
        for i, t in self._ends:
            v = float(obs[i])
            if (t.above is not None and v > t.above) or (t.below is not None and v < t.below) or \
                    (t.abs_above is not None and abs(v) > t.abs_above):
                terminated = True
        return obs, float(reward), terminated, False, {"cost": cost}

    @staticmethod
    def _term(term, obs_ix, ref_ix, fn, before, obs, a, cost) -> float:
        if fn is not None:
            return float(fn(obs, a, cost))
        kind = term.term
        if kind == "alive":
            return 1.0
        if kind == "effort":
            return float(a @ a)
        if kind == "violation":
            return cost
        dist = float(np.linalg.norm(obs[obs_ix].astype(np.float64) - obs[ref_ix]))
        if kind == "tracking":
            return min(dist, term.clip) if term.clip is not None else dist
        # progress: distance closed this step, toward the set-point observed before it
        return float(np.linalg.norm(before[obs_ix].astype(np.float64) - before[ref_ix])) - \
            float(np.linalg.norm(obs[obs_ix].astype(np.float64) - before[ref_ix]))
