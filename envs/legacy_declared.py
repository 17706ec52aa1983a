"""Legacy controllers declared in a task YAML: PID loops on named observations, or LQR on the MJCF's linearization.

Both are batch policies, obs float32[n, obs_dim] -> normalized action
float32[n, act_dim] clipped to [-1, 1], with `reset()`; `name` is what
`sim2real envs` and the shadow log show.
"""

from __future__ import annotations

import numpy as np

from envs.declaration import DeclarationError, PlantDeclaration
from envs.linearization import discrete_lqr, linearize_control_step


class PidLoops:
    """u[action] += feedforward + kp e + ki int(e) dt - kd rate, e = setpoint - measured (one row per declared loop)."""

    def __init__(self, decl: PlantDeclaration, name: str, trim: tuple[float, ...] | None = None):
        """`trim`: the action holding the operating point on the nominal MJCF, which `feedforward: hold` adds."""
        self.name = name
        self.dt = decl.control_period
        self.act_dim = len(decl.actuators)
        rows = []
        for loop in decl.legacy.loops:
            if loop.feedforward == "hold":
                loop = loop.model_copy(update={"feedforward": float((trim or (0.0,) * self.act_dim)[loop.action])})
            sp_ix = decl.index(loop.setpoint) if isinstance(loop.setpoint, str) else None
            sp_value = 0.0 if isinstance(loop.setpoint, str) else float(loop.setpoint)
            rate_ix = decl.index(loop.rate) if loop.rate else None
            rows.append((loop.action, decl.index(loop.measured), sp_ix, sp_value, rate_ix, loop))
        self._rows = rows
        self._integral: np.ndarray | None = None
        self._last_error: np.ndarray | None = None

    def reset(self) -> None:
        """Clear the integrators and the error memory."""
        self._integral = self._last_error = None

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        obs = np.asarray(obs, dtype=np.float64)
        if obs.ndim == 1:
            obs = obs[None, :]
        n = len(obs)
        if self._integral is None or self._integral.shape[0] != n:
            self._integral, self._last_error = np.zeros((n, len(self._rows))), None
        u = np.zeros((n, self.act_dim))
        errors = np.empty((n, len(self._rows)))
        for k, (action, m_ix, sp_ix, sp_value, rate_ix, loop) in enumerate(self._rows):
            e = (obs[:, sp_ix] if sp_ix is not None else sp_value) - obs[:, m_ix]
            errors[:, k] = e
            self._integral[:, k] = np.clip(
                self._integral[:, k] + loop.ki * e * self.dt, -loop.integral_limit, loop.integral_limit
            )
            if rate_ix is not None:
                derivative = -obs[:, rate_ix]
            elif self._last_error is not None:
                derivative = (e - self._last_error[:, k]) / self.dt
            else:
                derivative = np.zeros(n)
            u[:, action] += loop.feedforward + loop.kp * e + self._integral[:, k] + loop.kd * derivative
        self._last_error = errors
        return np.clip(u, -1.0, 1.0).astype(np.float32)


class DeclaredLqr:
    """u = u_trim - K (x - x_ref) on the linearization at the declared operating point (u_trim: the action that holds
    it, zero where it rests unpowered); x are the joint observations."""

    def __init__(self, decl: PlantDeclaration, nominal, name: str):
        self.name = name
        a, b = linearize_control_step(nominal)
        nv = nominal.model.nv
        states = sorted(nominal.obs_to_state)
        rows = [i if kind == "qpos" else nv + i for kind, i in (nominal.obs_to_state[o] for o in states)]
        a, b = a[np.ix_(rows, rows)], b[rows]
        legacy = decl.legacy
        if len(legacy.q) != len(states) or len(legacy.r) != b.shape[1]:
            raise DeclarationError(
                f"plant.legacy: lqr needs {len(states)} q weights (one per joint observation) "
                f"and {b.shape[1]} r weights"
            )
        try:
            names = [decl.observations[o].name for o in states]
            self.gain = discrete_lqr(a, b, np.diag(legacy.q), np.diag(legacy.r), names)
        except ValueError as exc:
            raise DeclarationError(f"plant.legacy: {exc}") from exc
        self._states = states
        self._x_op = np.array(
            [nominal.qpos[i] if kind == "qpos" else 0.0 for kind, i in (nominal.obs_to_state[o] for o in states)]
        )
        self._refs = [(states.index(decl.index(k)), decl.index(v)) for k, v in legacy.setpoints.items()]
        self._trim = nominal.trim_action(b.shape[1])  # what holds the operating point (a hoist's weight), else 0

    def reset(self) -> None:
        """Nothing to clear: the LQR is static."""

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        obs = np.asarray(obs, dtype=np.float64)
        if obs.ndim == 1:
            obs = obs[None, :]
        err = obs[:, self._states] - self._x_op
        for j, ref in self._refs:
            err[:, j] = obs[:, self._states[j]] - obs[:, ref]
        return np.clip(self._trim - err @ self.gain.T, -1.0, 1.0).astype(np.float32)
