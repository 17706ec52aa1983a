"""`CbfShield`: a discrete-time control-barrier-function safety filter solved as a small QP.

Each step, for the observation ``o`` and the policy's action ``u_p``:

1. The shield state ``x = [o[state_index], z]`` (``z``: predicted-only internal
   states such as the realized acceleration of a lagged inner loop) is predicted
   through the ``latency_steps`` actions already sent but not yet applied. With
   ``input_gain_error`` > 0 there are two cases, the input's effect at
   (1 - err) and (1 + err) x nominal, each with its own internal states and
   prediction, and every condition below must hold in both.
2. Every constraint gives barrier rows ``h_r(x) >= 0``. For a constraint on
   positions (relative degree 2 under force/acceleration input) the barrier is
   the braking-distance form ``h = d - margin - max(0, closing_speed)^2 / (2 a_brake)``,
   so a plant driven at full speed toward a wall is braked in time; for other
   quantities ``h = d - margin``. Cylinders and spheres (keep-out zones) are
   linearized at the predicted position, which under-estimates the true
   distance, so the linear cut is conservative.
3. The action solves ``min ||u - u_p||^2`` s.t. ``h_r(x+(u)) >= (1 - gain_r) h_r(x)``
   and the input box, in both gain cases (h is concave along the gain scaling, so
   the two ends bound the gains between, to first order) and for the worst additive
   acceleration within `disturbance_accel` (per row, each axis at the bound
   that lowers it). ``h(x+(u))`` is concave in ``u``; it is linearized and the
   QP re-solved at the new point until the true conditions hold (a few
   iterations at most), with a closed-form projection when provably optimal and
   daqp otherwise.
4. If the QP is infeasible the shield falls back to least-violation braking:
   the input in the box minimizing the summed squared (normalized) shortfalls,
   i.e. maximal braking away from the most-violated constraint, and away from
   all of them at once in a corner. It never passes the raw action through.
5. A NaN/Inf observation or action is flagged (``bad_input``) and answered with
   the fallback: with a NaN action, the fallback action filtered at the observed
   state; with a NaN observation, the fallback action filtered at the state
   predicted from the last good observation through the actions since, or the
   spec's constant `fallback_action` if there was none.

When the policy's action satisfies every condition it is returned unchanged (bitwise).
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any, Callable

import numpy as np

from shield.fallback import BoxHalfspaceProjection, least_violation_brake
from shield.spec import ShieldSpec

_SQP_ITERS = 8
_SQP_TOL = 1e-9  # barrier units: how far the true condition may miss after the SQP (the margin covers it)


class CbfShield:
    """CBF-QP safety filter for one plant instance: `filter(obs, action) -> (safe_action, info)`."""

    def __init__(self, spec: ShieldSpec | dict):
        if isinstance(spec, dict):
            spec = ShieldSpec.from_dict(spec)
        self.spec = spec
        model = spec.linear_model()
        self._A, self._B, self._c = model.A, model.B, model.c
        # Robust to the input's effect being (1 +- input_gain_error) x nominal: each end is a case
        # with its own predicted state (pending actions and lagged internal states scale with the
        # gain too); h is concave along that scaling, so both ends bound every gain between.
        err = spec.input_gain_error
        self._B_cases = [self._B] if err == 0.0 else [(1.0 - err) * self._B, (1.0 + err) * self._B]
        self._B_stack = np.stack(self._B_cases)  # (cases, state, inputs)
        # Hot-path layouts: contiguous transposes and the cases' B stacked as one matrix, so each
        # prediction is one plain matmul (small batched matmuls cost more than the arithmetic).
        self._AT = np.ascontiguousarray(self._A.T)
        self._B_flat = self._B_stack.reshape(-1, self._B.shape[1])
        self._X_shape = (len(self._B_cases), self._A.shape[0])
        self._n = len(spec.state_index)
        self._nz = model.internal_dim
        self._z0 = (np.zeros(self._nz) if model.internal_init is None
                    else np.asarray(model.internal_init, np.float64))
        self._state_index = np.asarray(spec.state_index, dtype=np.intp)
        self._m = spec.act_dim
        self._low = np.asarray(spec.action_low, np.float64)
        self._high = np.asarray(spec.action_high, np.float64)
        self._low32 = self._low.astype(np.float32)
        self._high32 = self._high.astype(np.float32)
        fb = spec.fallback_action if spec.fallback_action is not None else np.clip(np.zeros(self._m), self._low, self._high)
        self._fallback = np.asarray(fb, np.float64)
        self._margin = spec.margin
        self.constraint_names = [c["name"] for c in spec.constraints]
        self._w_max = np.asarray(spec.disturbance_accel or [0.0] * len(spec.position_index), np.float64)
        self._build_rows()
        self._E0 = self._E1 = None
        if np.any(self._w_max > 0):
            cols = {o: j for j, o in enumerate(spec.state_index)}
            self._E0, self._E1 = (np.zeros((self._n + self._nz, len(spec.position_index))) for _ in range(2))
            for E, T in ((self._E0, spec.latency_steps * spec.dt), (self._E1, (spec.latency_steps + 1) * spec.dt)):
                for k, (p, v) in enumerate(zip(spec.position_index, spec.velocity_index)):
                    E[cols[p], k] = 0.5 * T * T
                    E[cols[v], k] = T
        self._disturbance_offsets()
        self._projection = BoxHalfspaceProjection(self._low, self._high, self._R * len(self._B_cases))
        self.reset()

    # ---- construction ---------------------------------------------------------
    def _build_rows(self) -> None:
        """Barrier rows: d = W x + f (distance), closing speed = -(Wv x), per-row gain and braking."""
        spec = self.spec
        col = {o: j for j, o in enumerate(spec.state_index)}
        vel_of = dict(zip(spec.position_index, spec.velocity_index))
        brake_of = dict(zip(spec.position_index, spec.brake_accel))
        N = self._n + self._nz
        W, Wv, f, brake, gain, owner, closing0 = [], [], [], [], [], [], []
        # With a lagged inner loop (response time tau) the realized acceleration z is an internal
        # state; braking starts ~tau late, so the closing speed the barrier brakes from is
        # s + tau (z_n + a_brake + w_n): the speed reached before the commanded deceleration takes
        # hold, with the worst disturbance w pushing meanwhile.
        w_of = dict(zip(spec.position_index, self._w_max))
        tau = float(spec.model.get("response_time_s", 0.0)) if spec.model["type"] == "double_integrator" else 0.0
        accel_col = {o: self._n + k for k, o in enumerate(spec.position_index)} if self._nz else {}
        dynamic = []  # (row, state cols, velocity cols or None, center, radius)

        def add_row(weights: dict[int, float], offset: float, g: float, k: int) -> int:
            w, wv = np.zeros(N), np.zeros(N)
            for o, v in weights.items():
                w[col[o]] = v
            positional = all(o in vel_of for o in weights)
            if positional:
                for o, v in weights.items():
                    wv[col[vel_of[o]]] = v
                    if o in accel_col:
                        wv[accel_col[o]] = tau * v
            a_brake = min(brake_of[o] for o in weights) if positional else math.inf
            # |n . w| <= sum |n_i| w_i bounds the disturbance along any unit normal n.
            w_n = sum(abs(v) * w_of[o] for o, v in weights.items()) if positional else 0.0
            closing0.append(tau * (a_brake + w_n) if positional else 0.0)
            W.append(w)
            Wv.append(wv)
            f.append(offset)
            brake.append(a_brake)
            gain.append(g)
            owner.append(k)
            return len(W) - 1

        for k, con in enumerate(spec.constraints):
            g = float(con.get("gain", 0.5))
            if con["type"] == "halfspace":
                a = np.asarray(con["a"], np.float64)
                norm = float(np.linalg.norm(a))
                # a.o <= b  <=>  d = (b - a.o)/|a| >= 0
                add_row({i: -a[i] / norm for i in np.flatnonzero(a)}, float(con["b"]) / norm, g, k)
            elif con["type"] == "box":
                for i, lo, hi in zip(con["index"], con["low"], con["high"]):
                    if math.isfinite(hi):
                        add_row({i: -1.0}, float(hi), g, k)
                    if math.isfinite(lo):
                        add_row({i: 1.0}, -float(lo), g, k)
            else:
                idx = list(con["index"])
                r = add_row({i: 1.0 for i in idx}, 0.0, g, k)  # weights filled per step
                cols = [col[i] for i in idx]
                vcols = [col[vel_of[i]] for i in idx] if all(i in vel_of for i in idx) else None
                dynamic.append((r, cols, vcols, np.asarray(con["center"], np.float64), float(con["radius"])))
        self._R = len(W)
        self._W = np.array(W).reshape(self._R, N)
        self._Wv = np.array(Wv).reshape(self._R, N)
        self._f = np.array(f, dtype=np.float64)
        self._closing0 = np.array(closing0, dtype=np.float64)
        self._tau = tau
        self._accel_col = accel_col
        self._brake_accel = np.array(brake, dtype=np.float64)
        self._positional = np.isfinite(self._brake_accel)
        self._inv2a = np.where(self._positional, 0.5 / np.where(self._positional, self._brake_accel, 1.0), 0.0)
        self._inva = 2.0 * self._inv2a
        self._gain = np.array(gain, dtype=np.float64)
        self._owner = np.array(owner, dtype=np.intp)
        self._dynamic = dynamic
        self._n_constraints = len(spec.constraints)
        self._row_start = np.searchsorted(self._owner, np.arange(self._n_constraints))
        if self._R and len(set(self._owner.tolist())) != self._n_constraints:
            raise ValueError("shield spec: every constraint needs at least one finite bound")
        # Flat indices into W / Wv for the keep-out rows, so one linearization is a few stores.
        self._dyn_flat = [(r, r * N + np.asarray(cols), None if vc is None else r * N + np.asarray(vc),
                           None if vc is None or not accel_col else
                           r * N + np.asarray([accel_col[i] for i in spec.constraints[owner[r]]["index"]]),
                           c, rad) for r, cols, vc, c, rad in dynamic]

    def reset(self) -> None:
        """Forget pending actions and predicted state (call at episode start)."""
        L = self.spec.latency_steps
        self._pending: deque[np.ndarray] = deque([self._fallback.copy() for _ in range(L)], maxlen=max(L, 1))
        self._x_next: np.ndarray | None = None  # (cases, state): predicted state at the next call

    # ---- barrier algebra ------------------------------------------------------
    def _linearize_dynamic(self, x: np.ndarray) -> None:
        """Replace each keep-out zone's row by the tangent halfspace at the position in x."""
        Wf, Wvf = self._W.reshape(-1), self._Wv.reshape(-1)
        N = self._n + self._nz
        for r, wcols, vcols, acols, center, radius in self._dyn_flat:
            diff = x[wcols - r * N] - center
            dist = math.sqrt(float(diff @ diff))
            n = diff / dist if dist > 1e-9 else np.eye(len(diff))[0]
            Wf[wcols] = n
            self._f[r] = -float(n @ center) - radius
            if vcols is not None:
                Wvf[vcols] = n
                if acols is not None:
                    Wvf[acols] = self._tau * n

    def _disturbance_offsets(self) -> None:
        """Refresh the row transposes; per row, shift the next-state barrier by the worst additive acceleration.

        A constant acceleration w moves a position by w T^2 / 2 and its velocity by w T over
        T seconds. It acts over the latency (T0 = L dt) on the predicted state and one period
        more (T1 = T0 + dt) on the next one, so to first order the condition
        h(x_{L+1}) >= (1 - gain) h(x_L) loses grad h . (E(T1) - (1 - gain) E(T0)) w;
        the worst sign per axis is the one lowering the row.
        """
        self._WT, self._WvT = np.ascontiguousarray(self._W.T), np.ascontiguousarray(self._Wv.T)
        if self._E1 is None:
            self._f_next, self._closing0_next = self._f, self._closing0
            return
        S = (self._W + self._Wv) @ self._E1  # (rows, axes): how each axis's push raises each row
        w = -self._w_max * np.sign(S)
        e = w @ self._E1.T - (1.0 - self._gain)[:, None] * (w @ self._E0.T)  # (rows, state)
        self._f_next = self._f + np.einsum("ij,ij->i", self._W, e)
        self._closing0_next = self._closing0 - np.einsum("ij,ij->i", self._Wv, e)

    def _predict(self, X: np.ndarray) -> np.ndarray:
        """Each case's state (rows of X) carried through the pending actions."""
        for a in self._pending if self.spec.latency_steps else ():
            X = X @ self._AT + (self._B_flat @ a).reshape(self._X_shape) + self._c
        return X

    def _prepare(self, X0: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per gain case: free next state (zero action) and required next barrier; and h per constraint now."""
        XL = self._predict(X0)
        if self._dyn_flat:
            self._linearize_dynamic(XL[0])
            self._disturbance_offsets()
        hL = self._next_barrier(XL, nxt=False)  # (cases, rows)
        h_now = self._per_constraint(hL.min(axis=0))
        return XL @ self._AT + self._c, (1.0 - self._gain) * hL, h_now

    def _next_barrier(self, X: np.ndarray, nxt: bool = True) -> np.ndarray:
        """h for every case's state (rows of X) and every barrier row: (cases, rows)."""
        f, c0 = (self._f_next, self._closing0_next) if nxt else (self._f, self._closing0)
        closing = np.maximum(c0 - X @ self._WvT, 0.0)
        return X @ self._WT + f - self._margin - closing * closing * self._inv2a

    def cbf_conditions(self, obs: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        """For tests and diagnostics: u -> h_r(x+(u)) - (1 - gain_r) h_r(x) per row (>= 0 is safe); no state change."""
        obs = np.asarray(obs, np.float64)
        F, Req, _ = self._prepare(self._state_from(obs))
        frees, requireds = list(F), list(Req)
        W, Wv, f, c0 = self._W.copy(), self._Wv.copy(), self._f_next.copy(), self._closing0_next.copy()

        def conditions(u: np.ndarray) -> np.ndarray:
            out = []
            for free, required, B in zip(frees, requireds, self._B_cases):
                x = free + B @ np.asarray(u, np.float64)
                closing = np.maximum(c0 - Wv @ x, 0.0)
                out.append(W @ x + f - self._margin - closing * closing * self._inv2a - required)
            return np.concatenate(out)

        return conditions

    def _state_from(self, obs: np.ndarray) -> np.ndarray:
        """(cases, state): the observed state with each case's predicted internal states."""
        X = np.empty((len(self._B_cases), self._n + self._nz))
        X[:, :self._n] = obs[self._state_index]
        X[:, self._n:] = self._x_next[:, self._n:] if self._x_next is not None else self._z0
        return X

    # ---- the filter -----------------------------------------------------------
    def filter(self, obs: np.ndarray, action: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        """Return the safe action (float32[act_dim], normalized units) for one observation and the shield info."""
        t0 = time.perf_counter()
        obs = np.asarray(obs)
        action = np.asarray(action, dtype=np.float32).reshape(-1)
        obs_ok = obs.shape == (self.spec.obs_dim,) and bool(np.isfinite(obs).all())
        act_ok = action.shape == (self._m,) and bool(np.isfinite(action).all())
        bad = not (obs_ok and act_ok)
        if obs_ok:
            o = obs.astype(np.float64)
            x0s = self._state_from(o)
        elif self._x_next is not None:
            x0s = self._x_next  # no state observed: trust the prediction from the last good one
        else:
            u = self._fallback.astype(np.float32)
            self._commit(None, u)
            return u, self._info(True, True, True, np.full(self._n_constraints, np.nan), 0.0, t0)
        free, required, h_now = self._prepare(x0s)
        if bad:
            u_p = self._fallback
        else:
            u_p = action.astype(np.float64)
            in_box = bool(np.all(action >= self._low32) and np.all(action <= self._high32))
            if in_box and self._meets(free, u_p, required, 0.0):
                self._commit(x0s, u_p)
                return action.copy(), self._info(False, False, False, h_now, 0.0, t0)
        u, feasible, slack = self._solve(free, required, u_p)
        out = u.astype(np.float32)
        self._commit(x0s, u)
        intervened = bad or not np.array_equal(out, action)
        return out, self._info(intervened, bad or not feasible, bad, h_now, slack, t0)

    def _solve(self, free: list[np.ndarray], required: list[np.ndarray], u_p: np.ndarray) -> tuple[np.ndarray, bool, float]:
        """Sequential linearization of the concave barrier conditions; QP each time. Returns (u, feasible, slack)."""
        u = np.clip(u_p, self._low, self._high)
        for it in range(_SQP_ITERS):
            if it == 0 and self._meets(free, u, required, 0.0):
                return u, True, 0.0  # the box projection already meets every condition: it is the optimum
            G, lb = self._linearized_rows(free, u, required)
            u_new = self._qp(G, lb, u_p)
            if u_new is None:
                return self._brake(G, lb)
            step = float(np.max(np.abs(u_new - u)))
            u = u_new
            # The tangent cuts contain the true safe set, so a solution that meets the true
            # conditions is also the projection onto the true set.
            if step < 1e-12 or self._meets(free, u, required, -_SQP_TOL):
                break
        return u, True, 0.0

    def _meets(self, F: np.ndarray, u: np.ndarray, Req: np.ndarray, tol: float) -> bool:
        """True when h(x+(u)) >= required - |tol| for every row and every input-gain case."""
        return bool((self._next_barrier(F + (self._B_flat @ u).reshape(self._X_shape)) - Req >= tol).all())

    def _linearized_rows(self, F: np.ndarray, u: np.ndarray, Req: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tangent cuts G v >= lb of the conditions at u, stacked over the input-gain cases."""
        X = F + (self._B_flat @ u).reshape(self._X_shape)  # (cases, state)
        closing = np.maximum(self._closing0_next - X @ self._WvT, 0.0)  # (cases, rows)
        h = X @ self._WT + self._f_next - self._margin - closing * closing * self._inv2a
        # d h / d u = (W + closing / a Wv) B, per case
        G = self._W @ self._B_stack + (closing * self._inva)[:, :, None] * (self._Wv @ self._B_stack)
        G = G.reshape(-1, self._m)
        return G, (Req - h).reshape(-1) + G @ u

    def _qp(self, G: np.ndarray, lb: np.ndarray, u_p: np.ndarray) -> np.ndarray | None:
        """argmin ||u - u_p||^2 s.t. G u >= lb, low <= u <= high; None if infeasible."""
        return self._projection.solve(G, lb, u_p)

    def _brake(self, G: np.ndarray, lb: np.ndarray) -> tuple[np.ndarray, bool, float]:
        """Infeasible QP: least-violation braking (see shield.fallback)."""
        u = least_violation_brake(G, lb, self._low, self._high, self._fallback)
        return u, False, float(max(0.0, np.max(lb - G @ u)))

    def _commit(self, x0s: np.ndarray | None, u: np.ndarray) -> None:
        """Remember the sent action and predict each case's state at the next call."""
        L = self.spec.latency_steps
        u = np.asarray(u, np.float64)
        applied = self._pending[0] if L else u
        if L:
            self._pending.append(u.copy())
        self._x_next = None if x0s is None else x0s @ self._AT + (self._B_flat @ applied).reshape(self._X_shape) + self._c

    def _per_constraint(self, h_rows: np.ndarray) -> np.ndarray:
        if not self._R:
            return np.zeros(0)
        # Rows are contiguous per constraint, so reduceat gives each constraint's worst row.
        return np.minimum.reduceat(h_rows, self._row_start)

    @staticmethod
    def _info(intervened: bool, fallback: bool, bad: bool, h: np.ndarray, slack: float, t0: float) -> dict[str, Any]:
        return {"intervened": intervened, "fallback": fallback, "bad_input": bad, "h": h,
                "slack": slack, "solve_us": (time.perf_counter() - t0) * 1e6}


class ShieldedPolicy:
    """Batch policy interface (obs float32[n, obs_dim] -> float32[n, act_dim]) with one CbfShield per row."""

    def __init__(self, policy: Callable[[np.ndarray], np.ndarray], spec: ShieldSpec | dict):
        self.policy = policy
        self.spec = spec if isinstance(spec, ShieldSpec) else ShieldSpec.from_dict(spec)
        self.shields: list[CbfShield] = []
        self.last_infos: list[dict[str, Any]] = []

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        obs = np.asarray(obs, np.float32)
        while len(self.shields) < len(obs):
            self.shields.append(CbfShield(self.spec))
        raw = np.asarray(self.policy(obs), np.float32)
        out = np.empty_like(raw)
        self.last_infos = []
        for i in range(len(obs)):
            out[i], info = self.shields[i].filter(obs[i], raw[i])
            self.last_infos.append(info)
        return out

    def reset(self, index: int | None = None) -> None:
        """Reset every row's shield (and the policy), or only row `index` (one env's episode ended)."""
        if index is not None:
            if index < len(self.shields):
                self.shields[index].reset()
            return
        for s in self.shields:
            s.reset()
        if hasattr(self.policy, "reset"):
            self.policy.reset()
