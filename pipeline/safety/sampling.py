"""Sampling a config's envelope: its plants (every set's corners and random draws, each a MuJoCo model with the
domain applied, stepped one control period from any shield state) and the states and actions synthesis measures at.

`EnvelopeSampler` holds the nominal linear model, the plants per set and the box states are drawn from:
constrained coordinates within their constraint, the others as far as open-loop random bang-bang drove any set's
corners, and (`admit`) no state moving toward a bound faster than the braking known so far stops in the room left.
"""

from __future__ import annotations

import copy
import itertools
import math

import numpy as np

from envs.randomization import SCALE_GROUPS, RandomizationError
from pipeline.safety.envelope import NOISE_SIGMAS

MAX_CORNERS = 64  # per set: all 2^d corners up to this many, else this many sampled corners
# The most braking a synthesized barrier counts on, in units of the nominal full-action acceleration: states
# moving toward a bound faster than that can stop in the room left are outside every such barrier's safe set.
VIABLE_BRAKING = 1.5
ROLLOUT_EPISODES = 4  # per sampled corner: open-loop random bang-bang runs that find how fast the plant goes


# A position moved by its main input less than this share of what that input does to the position it moves most
# (each against its own speed range) is driven through the plant's coupling, not by the input (`driven_positions`).
DIRECT_SHARE = 0.1


class SynthesisError(ValueError):
    """The plant or config cannot be synthesized for (names the key or the task)."""


def range_parameters(rset) -> list[tuple[str, float, float]]:
    """(name, low, high) of every randomized physical scale of a set (the names `DomainRandomizer.apply` reads)."""
    out = []
    for group in SCALE_GROUPS:
        for element, r in getattr(rset, group).items():
            out.append((f"{group}.{element}", float(r.low), float(r.high)))
    if rset.gravity_scale is not None:
        out.append(("gravity_scale", float(rset.gravity_scale.low), float(rset.gravity_scale.high)))
    return out


def ranges(rset) -> dict[str, tuple[float, float]]:
    """`range_parameters` as a map: name -> (low, high)."""
    return {name: (lo, hi) for name, lo, hi in range_parameters(rset)}


def set_domains(rset, rng: np.random.Generator, draws: int) -> list[dict]:
    """The set's corners (all, or MAX_CORNERS sampled when 2^d is larger) and random draws."""
    from envs.randomization import sample_domain

    params = range_parameters(rset)
    d = len(params)
    if 2**d <= MAX_CORNERS:
        bits = list(itertools.product((0, 1), repeat=d))
    else:
        bits = [tuple(rng.integers(0, 2, d)) for _ in range(MAX_CORNERS)]
    out = [{n: (lo, hi)[b] for (n, lo, hi), b in zip(params, corner)} for corner in bits]
    for _ in range(draws):
        dom = sample_domain(rset, rng)
        dom.pop("latency_steps", None)
        out.append(dom)
    return out


class SteppedPlant:
    """The nominal MJCF with one domain applied, stepped one control period from any shield state."""

    def __init__(self, nominal, rset, qcols: dict, vcols: dict, n: int):
        import mujoco

        from envs.domain import DomainRandomizer

        self._mj = mujoco
        self.model = copy.copy(nominal.model)
        self.data = mujoco.MjData(self.model)
        self.substeps = nominal.substeps
        self._write_ctrl = nominal.write_ctrl
        self._randomizer = DomainRandomizer(self.model, rset)
        self._qcols, self._vcols, self._n = qcols, vcols, n

    def apply(self, domain: dict) -> None:
        self._randomizer.apply(domain)

    def step(self, x: np.ndarray, action: np.ndarray, force: tuple | None = None) -> np.ndarray:
        """The shield state one control period later under `action` (the policy's units, as the env applies it);
        `force`: (body id, world force N) held over it."""
        d = self.data
        for i, j in self._qcols.items():
            d.qpos[i] = x[j]
        for i, j in self._vcols.items():
            d.qvel[i] = x[j]
        self._write_ctrl(d.ctrl, action)
        d.act[:] = 0.0
        d.xfrc_applied[:] = 0.0
        if force is not None:
            d.xfrc_applied[force[0], :3] = force[1]
        for _ in range(self.substeps):
            self._mj.mj_step(self.model, d)
        out = np.empty(self._n)
        for i, j in self._qcols.items():
            out[j] = d.qpos[i]
        for i, j in self._vcols.items():
            out[j] = d.qvel[i]
        return out


class EnvelopeSampler:
    """The plant's nominal model and everything sampled from: plants per set, the state box, the action box."""

    def __init__(self, cfg, rng: np.random.Generator, draws: int):
        import envs
        from pipeline.safety.shield_spec import _unlimited_angles, linearize_mujoco, operating_state

        self.cfg, self.rng = cfg, rng
        safety = envs.safety_spec(cfg.task.env_id)
        if safety["model"] != "linear":
            raise SynthesisError(
                f"task {cfg.task.name}: shield synthesis measures linear shield models "
                f"(plant.shield_model.type: linear), this task's is {safety['model']!r}: set "
                f"shield.margin, brake_accel (or brake_fraction), disturbance_accel and "
                f"input_gain_error"
            )
        self.safety = safety
        nominal = self._nominal = envs.nominal_model(cfg.task.env_id)
        self.state_index = sorted(nominal.obs_to_state)
        self.A, self.B, self.c = linearize_mujoco(nominal, self.state_index)
        self.dt = float(safety["dt"])
        self.pos = list(safety["kinematics"]["position_index"])
        vel = list(safety["kinematics"]["velocity_index"])
        col = {o: j for j, o in enumerate(self.state_index)}
        self.col = col
        self.ip, self.iv = [col[o] for o in self.pos], [col[o] for o in vel]
        self.n = n = len(self.state_index)
        self.low = np.asarray(safety["action_low"], np.float64)
        self.high = np.asarray(safety["action_high"], np.float64)
        self.full = np.maximum(np.abs(self.low), np.abs(self.high))
        self.angle_cols = [col[o] for o, _ in _unlimited_angles(nominal, self.state_index)]
        src = [nominal.obs_to_state[o] for o in self.state_index]
        qcols = {i: j for j, (kind, i) in enumerate(src) if kind == "qpos"}
        vcols = {i: j for j, (kind, i) in enumerate(src) if kind == "qvel"}
        if len(qcols) != nominal.model.nq or len(vcols) != nominal.model.nv:
            import mujoco

            model = nominal.model
            missing = [
                f"{mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_JOINT, j) or f'#{j}'}'s {what}"
                for j in range(model.njnt)
                for what, address, seen in (
                    ("position", model.jnt_qposadr[j], qcols),
                    ("velocity", model.jnt_dofadr[j], vcols),
                )
                if address not in seen
            ]
            raise SynthesisError(
                f"task {cfg.task.name}: synthesis needs every joint's position and velocity "
                f"observed (plant.observations), so a sampled shield state is a whole plant state; not observed: "
                f"{', '.join(missing)}"
            )
        self.box = _constraint_box(safety, col, n)
        self.halfspaces = _halfspace_rows(safety, col, n)
        self.x_op = operating_state(nominal, self.state_index)
        self.trim = nominal.trim_action(len(self.low))  # the action that holds x_op (zero: it rests unpowered)
        self.plants = {}
        for name, rset in cfg.randomization.items():
            try:
                self.plants[name] = SteppedPlant(nominal, rset, qcols, vcols, n)
            except RandomizationError as err:  # the element is named; say which set names it
                raise RandomizationError(f"randomization.{name}: {err}") from None
        self.domains = {name: set_domains(rset, rng, draws) for name, rset in cfg.randomization.items()}
        # Per set, the action noise's reach per input (NOISE_SIGMAS sigma of the half-range): the plant gets the
        # commanded action moved that far, clipped to the box, and the model is told only the command.
        half = 0.5 * (self.high - self.low)
        self.action_noise = {}
        for name, rset in cfg.randomization.items():
            std = list(rset.action_noise_std)
            std = (std * len(half))[: len(half)] if len(std) == 1 else (std + [0.0] * len(half))[: len(half)]
            self.action_noise[name] = NOISE_SIGMAS * np.asarray(std, np.float64) * half
        self.main_in = [int(np.argmax(np.abs(self.B[j]) * self.full)) for j in self.iv]
        self.nominal_full = [float(np.abs(self.B[j]) @ self.full / self.dt) for j in self.iv]
        self.lo_s, self.hi_s, self.speed = self.box[0].copy(), self.box[1].copy(), [0.0] * len(self.iv)
        # Until braking is measured, a state may approach a bound as fast as VIABLE_BRAKING x nominal stops it.
        self.braking = [(VIABLE_BRAKING * f, VIABLE_BRAKING * f) for f in self.nominal_full]

    def plant_models(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(A, B) of every sampled plant (every set's corners and draws), linearized at the operating point as the
        nominal model is (`linearize_mujoco`): what a gain chosen on the nominal model must also hold."""
        from dataclasses import replace

        from pipeline.safety.shield_spec import linearize_mujoco

        out = []
        for name, plant in self.plants.items():
            for dom in self.domains[name]:
                plant.apply(dom)
                A, B, _ = linearize_mujoco(replace(self._nominal, model=plant.model), self.state_index)
                out.append((A, B))
        return out

    def wrap(self, x: np.ndarray) -> np.ndarray:
        """`x` with every angle that turns without limit read within pi of the operating point."""
        if self.angle_cols:
            d = x[self.angle_cols] - self.x_op[self.angle_cols]
            x = x.copy()
            x[self.angle_cols] = self.x_op[self.angle_cols] + (d + np.pi) % (2 * np.pi) - np.pi
        return x

    def predict(self, x: np.ndarray, u: np.ndarray) -> np.ndarray:
        return self.A @ x + self.B @ u + self.c

    def reach_box(self) -> None:
        """The box states are drawn from: constrained coordinates within their constraint, the others (speeds,
        unconstrained angles) as far as open-loop random bang-bang drove any set's corners before a constrained
        coordinate left its bound."""
        rng, box, x_op = self.rng, self.box, self.x_op
        lo, hi = x_op.copy(), x_op.copy()
        steps = int(self.cfg.task.max_episode_steps or 250)
        for name, plant in self.plants.items():
            doms = self.domains[name]
            for dom in doms[:: max(1, len(doms) // 8)]:
                plant.apply(dom)
                for _ in range(ROLLOUT_EPISODES):
                    x = x_op + rng.uniform(-0.05, 0.05, self.n)
                    hold, u = 0, np.zeros(len(self.full))
                    for _t in range(steps):
                        if hold <= 0:
                            u, hold = rng.choice([-1.0, 1.0], len(self.full)) * self.full, int(rng.integers(1, 15))
                        hold -= 1
                        x = self.wrap(plant.step(x, u))
                        if not np.all(np.isfinite(x)) or np.any(x < box[0]) or np.any(x > box[1]):
                            break
                        if np.any(self.halfspaces[0] @ x > self.halfspaces[1]):
                            break
                        lo, hi = np.minimum(lo, x), np.maximum(hi, x)
        self.lo_s = np.where(np.isfinite(box[0]), box[0], lo)
        self.hi_s = np.where(np.isfinite(box[1]), box[1], hi)
        for j in self.angle_cols:  # an unbounded angle that turns without limit is anywhere on its circle
            if not np.isfinite(box[0][j]):
                self.lo_s[j] = x_op[j] - np.pi
            if not np.isfinite(box[1][j]):
                self.hi_s[j] = x_op[j] + np.pi
        self.speed = [float(max(abs(lo[j] - x_op[j]), abs(hi[j] - x_op[j]))) for j in self.iv]

    def driven_positions(self) -> list[int]:
        """The positions their main input drives directly: of the positions an input reaches, those it moves at
        least DIRECT_SHARE as much as the one it moves most, each measured against how fast that position goes
        (`speed`, from `reach_box`). A load that the drive reaches only through a spring within the period moves
        by a second-order sliver of what the nominal model says, so its response over that sliver says nothing
        about the input's gain (its error is the coupling's, measured as model error)."""
        speed = np.maximum(np.asarray(self.speed, np.float64), 1e-9)
        effect = np.array([abs(self.B[v, self.main_in[k]]) * self.full[self.main_in[k]] for k, v in enumerate(self.iv)])
        share = effect / speed
        most = {j: max(share[k] for k in range(len(self.iv)) if self.main_in[k] == j) for j in set(self.main_in)}
        return [k for k in range(len(self.iv)) if share[k] >= DIRECT_SHARE * most[self.main_in[k]]]

    def draw_state(self) -> np.ndarray:
        """A state inside the constraints that the braking barrier admits (a quarter of draws at range ends)."""
        rng = self.rng
        x = rng.uniform(self.lo_s, self.hi_s)
        ends = rng.random(self.n) < 0.25
        x[ends] = np.where(rng.random(int(ends.sum())) < 0.5, self.lo_s[ends], self.hi_s[ends])
        return self.admit(x)

    def within_halfspaces(self, x: np.ndarray) -> np.ndarray:
        """`x` with the coordinates the halfspace constraints read pulled toward the operating point until every
        one holds: a state the plant may be in. The box is drawn per coordinate, and a limit on a combination (a
        spring's stretch, x_load - x_motor) would otherwise admit states far outside it, whose forces no shield
        number needs to cover (a stretched spring pulling harder than the drive)."""
        W, b, cols = self.halfspaces
        if not len(b):
            return x
        d = np.zeros(self.n)
        d[cols] = x[cols] - self.x_op[cols]
        base = x - d  # the read coordinates at the operating point, the rest as drawn
        Wd, slack = W @ d, b - W @ base
        over = Wd > slack
        if not over.any():
            return x
        t = float(np.clip(np.min(np.where(over, slack / np.where(over, Wd, 1.0), 1.0)), 0.0, 1.0))
        return base + t * d

    def admit(self, x: np.ndarray) -> np.ndarray:
        """`x` inside the halfspace constraints (`within_halfspaces`), with each bounded position's speed toward a
        bound cut to what its braking stops in the room left."""
        x = self.within_halfspaces(x)
        for k, (p, v) in enumerate(zip(self.ip, self.iv)):
            if not (np.isfinite(self.box[0][p]) and np.isfinite(self.box[1][p])):
                continue
            up = x[v] > 0
            room = (self.hi_s[p] - x[p]) if up else (x[p] - self.lo_s[p])
            a = max(self.braking[k][0 if up else 1], 0.0)  # moving up, braking is toward -
            x[v] = math.copysign(min(abs(x[v]), math.sqrt(2.0 * a * max(room, 0.0))), x[v])
        return x

    def applied(self, name: str, u: np.ndarray) -> np.ndarray:
        """What set `name`'s plant may get for command `u`: moved within its action noise, in the box."""
        noise = self.action_noise[name]
        return np.clip(u + self.rng.uniform(-noise, noise), self.low, self.high) if noise.any() else u

    def draw_action(self) -> np.ndarray:
        if self.rng.random() < 0.5:
            return self.rng.choice([-1.0, 1.0], len(self.full)) * self.full
        return self.rng.uniform(self.low, self.high)


def _constraint_box(safety: dict, col: dict, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per shield-state column, the bounds box constraints put on it (+-inf where none)."""
    lo, hi = np.full(n, -np.inf), np.full(n, np.inf)
    for con in safety["constraints"]:
        if con["type"] != "box":
            continue
        for o, a, b in zip(con["index"], con["low"], con["high"]):
            if o in col:
                lo[col[o]], hi[col[o]] = max(lo[col[o]], a), min(hi[col[o]], b)
    return lo, hi


def _halfspace_rows(safety: dict, col: dict, n: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(W, b, columns read): the halfspace constraints as W x <= b over the shield state."""
    rows, bounds = [], []
    for con in safety["constraints"]:
        if con["type"] != "halfspace":
            continue
        w = np.zeros(n)
        for o, a in enumerate(con["a"]):
            if a != 0.0 and o in col:
                w[col[o]] = a
        rows.append(w)
        bounds.append(float(con["b"]))
    W = np.array(rows).reshape(len(rows), n)
    return W, np.array(bounds), sorted({int(j) for w in rows for j in np.flatnonzero(w)})


def constraint_obs(con: dict) -> list[int]:
    """The observation indices a constraint reads."""
    if con["type"] == "halfspace":
        return [i for i, a in enumerate(con["a"]) if a != 0.0]
    return list(con["index"])
