"""Finite-difference linearization of a MuJoCo plant over one control period, and the discrete LQR.

Used by the legacy LQRs (envs) and by the shield's linear nominal model
(pipeline/safety/shield_spec.py), so both are designed on the same model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import mujoco
import numpy as np


@dataclass(frozen=True)
class NominalModel:
    """The nominal plant for linearization: model, operating point, obs-to-state map."""

    model: mujoco.MjModel
    qpos: np.ndarray  # operating point (an equilibrium under the `trim` action), rad / m
    qvel: np.ndarray
    substeps: int  # physics steps per control step (ctrl held constant)
    # obs index -> ("qpos" | "qvel", index); exogenous observations (set-points) are absent.
    obs_to_state: dict
    # Per action element: the actuator it drives and its ctrl per unit action (the declaration's order and
    # `scale`). None: the MJCF's actuators in their own order, one ctrl unit per action.
    actuators: tuple[int, ...] | None = None
    ctrl_per_action: tuple[float, ...] | None = None
    # The steady action that holds the operating point still (a hoist's or a raised arm's weight); None: zero.
    trim: tuple[float, ...] | None = None
    # obs index -> ("site", id, axis) | ("sensor", adr): observations MuJoCo computes from the state.
    derived: dict | None = None

    def write_ctrl(self, ctrl: np.ndarray, action) -> None:
        """Write one action into MjData.ctrl as the env applies it (ctrl[actuator] = scale x action, 0 elsewhere)."""
        write_ctrl(ctrl, self.actuators, self.ctrl_per_action, action)

    def trim_action(self, act_dim: int) -> np.ndarray:
        """The holding action as an array (zeros where the operating point rests under zero action)."""
        return np.zeros(act_dim) if self.trim is None else np.asarray(self.trim, np.float64)


def write_ctrl(ctrl: np.ndarray, actuators, ctrl_per_action, action) -> None:
    """Write one action into MjData.ctrl as the env applies it: ctrl[actuators[k]] = ctrl_per_action[k] x
    action[k], 0 on every actuator no action drives. `actuators` None: the MJCF's own order, one ctrl per action."""
    if actuators is None:
        ctrl[:] = action
        return
    ctrl[:] = 0.0
    ctrl[list(actuators)] = np.asarray(action, np.float64) * np.asarray(ctrl_per_action, np.float64)


def apply_held_action(model: mujoco.MjModel, data: mujoco.MjData, actuators, ctrl_per_action, action) -> None:
    """Load `action` into `data` as an action held for long leaves it: its ctrl (`write_ctrl`), and each
    actuator's own state (a filtered motor's lag) settled at its control. The one place the holding action, the
    measured response and the linearization put an action into a plant that is not being stepped."""
    write_ctrl(data.ctrl, actuators, ctrl_per_action, action)
    for i in range(model.nu):
        if model.actuator_actadr[i] >= 0:
            data.act[model.actuator_actadr[i]] = data.ctrl[i]


def hold_state(model: mujoco.MjModel, data: mujoco.MjData, nominal) -> None:
    """Load the trim into `data` as a held action (zero where the operating point rests under zero action)."""
    act_dim = model.nu if nominal.actuators is None else len(nominal.actuators)
    apply_held_action(model, data, nominal.actuators, nominal.ctrl_per_action, nominal.trim_action(act_dim))


@contextlib.contextmanager
def without_dry_friction(model: mujoco.MjModel) -> Iterator[mujoco.MjModel]:
    """`model` with its dry friction (frictionloss) off, restored after. The linear model, and the action holding
    the operating point, are taken without it: at rest it absorbs any force below its limit, so finite differences
    there see no input at all and an infinite damping (a 1 N frictionloss on a 30 N drive read as a drive 12 times
    weaker), and no action balances the load exactly (a hoist held still against 20 N of it left 0.4 N at best).
    What it does is model error, measured on the plant like any other."""
    saved = model.dof_frictionloss.copy(), model.tendon_frictionloss.copy()
    try:
        model.dof_frictionloss[:] = 0.0
        model.tendon_frictionloss[:] = 0.0
        yield model
    finally:
        model.dof_frictionloss[:], model.tendon_frictionloss[:] = saved


def linearize_control_step(nominal) -> tuple[np.ndarray, np.ndarray]:
    """Return (A, B) of one control period (ctrl held over the substeps) about the nominal equilibrium.

    B's columns are the plant's action elements, as the env applies them (ctrl[actuator] = scale x action): an
    MJCF listing its actuators in another order than the declaration, one with actuators no action drives, or a
    `scale` other than 1 would otherwise give the LQR and the shield a model of other inputs than the policy's.
    """
    model = nominal.model
    nx = 2 * model.nv + model.na
    a1 = np.zeros((nx, nx))
    b1 = np.zeros((nx, model.nu))
    with without_dry_friction(model):
        data = mujoco.MjData(model)
        data.qpos[:] = nominal.qpos
        data.qvel[:] = nominal.qvel
        hold_state(model, data, nominal)  # linearized about the operating point under the action that holds it
        mujoco.mj_forward(model, data)
        mujoco.mjd_transitionFD(model, data, 1e-6, True, a1, b1, None, None)
    # Zero-order hold over the substeps: x_{k+n} = A1^n x_k + (sum_i A1^i) B1 u.
    a, b = np.eye(nx), np.zeros_like(b1)
    for _ in range(nominal.substeps):
        b = a1 @ b + b1
        a = a1 @ a
    actuators, per_action = getattr(nominal, "actuators", None), getattr(nominal, "ctrl_per_action", None)
    if actuators is not None:
        b = b[:, list(actuators)]
    if per_action is not None:
        b = b * np.asarray(per_action, np.float64)
    return a, b


def unreachable_modes(a: np.ndarray, b: np.ndarray, names: list[str] | None = None) -> list[str]:
    """The modes of x' = A x + B u that no input reaches and that do not decay by themselves (|eigenvalue| >= 1), in
    words: the states each one moves (its left eigenvector's main weights) and its eigenvalue. The PBH test: w with
    w^H [A - lambda I, B] = 0 (a thrust along one heading never moves x - y, whatever it does)."""
    from scipy import linalg

    n = len(a)
    label = names if names is not None and len(names) == n else [f"state[{i}]" for i in range(n)]
    out = []
    for lam in sorted({complex(round(v.real, 9), round(v.imag, 9)) for v in np.linalg.eigvals(a)}, key=abs):
        if abs(lam) < 1.0 - 1e-9:
            continue
        stacked = np.hstack([a - lam * np.eye(n), b]).conj().T
        for w in linalg.null_space(stacked, rcond=1e-9).T:  # structurally unreached, not merely weakly
            weights = np.abs(w) / np.abs(w).max()
            moved = ", ".join(label[i] for i in np.flatnonzero(weights > 0.1))
            out.append(f"the mode of {moved} (eigenvalue {lam.real:.4g}{f'{lam.imag:+.3g}j' if lam.imag else ''})")
    return out


def discrete_lqr(
    a: np.ndarray, b: np.ndarray, q: np.ndarray, r: np.ndarray, names: list[str] | None = None
) -> np.ndarray:
    """The infinite-horizon discrete LQR gain K (u = -K x) for x' = A x + B u, cost x'Qx + u'Ru.

    The Riccati equation is solved by SciPy's `solve_discrete_are` (a QZ-based Schur method): it
    reaches the solution to round-off, where a fixed-point iteration stops short of it at its
    tolerance, and it fails loudly instead of returning an unconverged gain.
    Its last bits still follow the CPU's LAPACK kernels: compare gains to a
    tolerance, never bit for bit. Raises ValueError when no stabilizing gain exists, naming the unreachable modes
    (`names`: the states' names, in order) where there are any.
    """
    from scipy import linalg

    unreachable = unreachable_modes(a, b, names)
    if unreachable:
        raise ValueError(
            f"no LQR can stabilize the linearized plant: no input reaches {'; '.join(unreachable)} at the operating "
            "point, and that mode does not decay by itself (a coordinate no input pushes there, or two that one "
            "input moves only together, like one thrust along a heading). Give it an input that does, or linearize "
            "where the inputs reach it"
        )
    try:
        p = linalg.solve_discrete_are(a, b, q, r)
    except (np.linalg.LinAlgError, ValueError) as exc:
        raise ValueError(
            f"the discrete Riccati equation has no stabilizing solution ({exc}); is every unstable mode reachable "
            "from the inputs, and does q weigh every state the dynamics do not pull back by themselves (a free "
            "wheel's angle, a cart's position)? A zero weight there leaves that mode unseen: give it a small one"
        ) from exc
    bt_p = b.T @ p
    k = np.linalg.solve(r + bt_p @ b, bt_p @ a)
    if not np.all(np.abs(np.linalg.eigvals(a - b @ k)) < 1.0):
        raise ValueError(
            "the LQR gain does not stabilize the linearized plant; is every unstable mode reachable from the inputs?"
        )
    return k
