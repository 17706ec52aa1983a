"""A crane-like shield spec with a `predictive` section, built in closed form (no MuJoCo): a trolley (M) on a rail
with a pendulum (m, l) hanging from it, linearized about hanging at rest; the force acts on the trolley only."""

from __future__ import annotations

import numpy as np

from envs.linearization import discrete_lqr
from pipeline.safety import predictive

M, MP, LEN, G, FORCE, DT = 5.0, 8.0, 0.8, 9.81, 60.0, 0.02  # kg, kg, m, m/s^2, N per unit action, s
X_MAX, THETA_MAX = 0.8, 0.35  # m, rad


def crane_model() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A, B, c) over [x, theta, x_dot, theta_dot], one period of semi-implicit Euler in 20 substeps."""
    a = np.zeros((4, 4))
    a[0, 2] = a[1, 3] = 1.0
    a[2, 1] = MP * G / M  # the swing pulls the trolley
    a[3, 1] = -(M + MP) * G / (M * LEN)
    b = np.array([0.0, 0.0, FORCE / M, -FORCE / (M * LEN)])
    h = DT / 20
    A1, B1 = np.eye(4), np.zeros(4)
    A1[2:] += h * a[2:]
    B1[2:] += h * b[2:]
    A1[:2] += h * A1[2:]
    B1[:2] += h * B1[2:]
    A, B = np.eye(4), np.zeros(4)
    for _ in range(20):
        A, B = A1 @ A, A1 @ B + B1
    return A, B[:, None], np.zeros(4)


def crane_spec(latency_steps: int = 0, latency_min_steps: int | None = None, tube_per_step: float = 1.0) -> dict:
    """The spec: both constraints kept by the predictive filter, a tube growing linearly with the step."""
    A, B, c = crane_model()
    half = np.array([X_MAX, THETA_MAX, 1.5, 3.0])
    K = discrete_lqr(A, B, np.diag([10.0, 20.0, 1.0, 1.0]), np.diag([1.0]))
    Acl, rho = predictive.closed_loop(A, B, K)
    P, _ = predictive.equilibrium_projection(A, B)
    horizon = int(np.ceil(np.log(predictive.HORIZON_DECAY) / np.log(rho)))
    constraints = [
        {"name": "rail", "type": "box", "index": [0], "low": [-X_MAX], "high": [X_MAX]},
        {"name": "swing", "type": "box", "index": [1], "low": [-THETA_MAX], "high": [THETA_MAX]},
    ]
    W = np.array([[1.0, 0, 0, 0], [-1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, -1.0, 0, 0]])
    box, reach = predictive.terminal(half, Acl, K, W, np.ones(1))
    step = tube_per_step * np.array([2e-4, 2e-4, 2e-3, 2e-3])
    spec = {
        "schema_version": 1,
        "task": "crane-closed-form",
        "obs_dim": 4,
        "act_dim": 1,
        "dt": DT,
        "action_low": [-1.0],
        "action_high": [1.0],
        "state_index": [0, 1, 2, 3],
        "model": {"type": "linear", "A": A.tolist(), "B": B.tolist(), "c": c.tolist()},
        "kinematics": {"position_index": [0, 1], "velocity_index": [2, 3], "brake_accel": [0.1, 0.1]},
        "constraints": constraints,
        "latency_steps": latency_steps,
        **({"latency_min_steps": latency_min_steps} if latency_min_steps is not None else {}),
        "fallback_action": [0.0],
        "predictive": {
            "horizon": horizon,
            "backup_gain": K.tolist(),
            "operating_point": [0.0] * 4,
            "hold_projection": P.tolist(),
            "tube": [(step * (j + 1)).tolist() for j in range(horizon)],
            "terminal_box": box.tolist(),
            "terminal_reach": reach.tolist(),
        },
    }
    return spec


def plan_slack(spec: dict, x: np.ndarray, u: float, tube: np.ndarray | None = None) -> float:
    """The least slack of every row of `spec`'s plan after `u` from `x` (latency 0), written out step by step: the
    constraints less the tube (`tube`, (horizon, states); default the spec's), the backup's actions in the box,
    the terminal box and the settled equilibrium."""
    A, B, C = crane_model()
    section = spec["predictive"]
    K, P = np.asarray(section["backup_gain"]), np.asarray(section["hold_projection"])
    box, reach = np.asarray(section["terminal_box"]), np.asarray(section["terminal_reach"])
    tube = np.asarray(section["tube"]) if tube is None else tube
    limit = np.array([X_MAX, THETA_MAX])
    worst = np.inf
    xj = A @ x + B[:, 0] * u + C
    hold = P @ xj  # the equilibrium nearest the next state: the trolley stopped, the payload hanging
    for j in range(len(tube)):
        worst = min(worst, float((limit - tube[j, :2] - np.abs(xj[:2])).min()))
        if j < len(tube) - 1:
            ub = float(-(K @ (xj - hold))[0])
            worst = min(worst, 1.0 - abs(ub))
            xj = A @ xj + B[:, 0] * ub + C
    worst = min(worst, float((box - np.abs(xj - hold)).min()))
    rows = np.array([X_MAX - hold[0], X_MAX + hold[0], THETA_MAX - hold[1], THETA_MAX + hold[1]])
    return min(worst, float((rows - reach - np.repeat(tube[-1, :2], 2)).min()))
