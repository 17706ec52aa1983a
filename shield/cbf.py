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
from typing import Any, Callable

import numpy as np

from shield.fallback import BoxHalfspaceProjection, LeastViolationBrake
from shield.prediction import LatencyPredictor
from shield.spec import ShieldSpec

_SQP_ITERS = 8
_SQP_TOL = 1e-9  # barrier units: how far the true condition may miss after the SQP (the margin covers it)


class CbfShield:
    """CBF-QP safety filter for one plant instance: `filter(obs, action) -> (safe_action, info)`.

    The hot path runs at 1 kHz on the edge box, where a numpy call costs about a
    microsecond whatever its size: everything that depends only on the spec is
    built here once, per-call work reuses preallocated buffers, and a safe action
    costs one validity check, one prediction product and one condition check.
    """

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
        scales = [1.0] if err == 0.0 else [1.0 - err, 1.0 + err]
        self._cases = len(scales)
        self._scales = np.array(scales)[:, None]  # (cases, 1): broadcasts over barrier rows
        self._n = len(spec.state_index)
        self._nz = model.internal_dim
        self._z0 = (np.zeros(self._nz) if model.internal_init is None
                    else np.asarray(model.internal_init, np.float64))
        self._state_index = np.asarray(spec.state_index, dtype=np.intp)
        self._m = spec.act_dim
        self._low = np.asarray(spec.action_low, np.float64)
        self._high = np.asarray(spec.action_high, np.float64)
        low32, high32 = self._low.astype(np.float32), self._high.astype(np.float32)
        self._low32_list, self._high32_list = low32.tolist(), high32.tolist()  # 1-3 entries: floats beat arrays
        # When the box is exact in float32, "action32 in the float32 box" is "action64 in the box".
        self._box_exact = bool(np.array_equal(low32, self._low) and np.array_equal(high32, self._high))
        self._obs_shape, self._act_shape = (spec.obs_dim,), (self._m,)
        fb = spec.fallback_action if spec.fallback_action is not None else np.clip(np.zeros(self._m), self._low, self._high)
        self._fallback = np.asarray(fb, np.float64)
        self._fallback32 = self._fallback.astype(np.float32)
        self._margin = spec.margin
        self.constraint_names = [c["name"] for c in spec.constraints]
        self._w_max = np.asarray(spec.disturbance_accel or [0.0] * len(spec.position_index), np.float64)
        self._w_list = self._w_max.tolist()
        self._obs_src = np.tile(self._state_index, self._cases)  # obs entries of every case's state
        self._build_rows()
        self._build_offsets()
        self._predictor = LatencyPredictor(self._A, self._B, self._c, scales, spec.latency_steps, self._n,
                                           self._z0, self._fallback)
        self._projection = BoxHalfspaceProjection(self._low, self._high, self._R * self._cases)
        self._least_violation_brake = LeastViolationBrake(self._low, self._high, self._fallback, self._R * self._cases)
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
        R = self._R = len(W)
        W, Wv = np.array(W).reshape(R, N), np.array(Wv).reshape(R, N)
        # Both barrier parts in one matrix, so a batch of states costs one product:
        # M x = [distance part W x, minus the closing-speed part (Wv x)].
        self._M = np.vstack([W, -Wv])
        self._f = np.array(f, dtype=np.float64)
        self._closing0 = np.array(closing0, dtype=np.float64)
        self._closing0_list = list(closing0)
        self._tau = tau
        positional = np.isfinite(np.array(brake, dtype=np.float64))
        self._inv2a = np.where(positional, 0.5 / np.where(positional, brake, 1.0), 0.0)
        self._inva = 2.0 * self._inv2a
        self._keep = 1.0 - np.array(gain, dtype=np.float64)  # the share of h the next step must keep
        owner = np.array(owner, dtype=np.intp)
        self._n_constraints = len(spec.constraints)
        self._row_start = np.searchsorted(owner, np.arange(self._n_constraints))
        if R and len(set(owner.tolist())) != self._n_constraints:
            raise ValueError("shield spec: every constraint needs at least one finite bound")
        # Keep-out rows as plain lists: (row, position cols, velocity cols, acceleration cols, center, radius).
        self._dynamic = [(r, cols, vc, None if vc is None or not accel_col else
                          [accel_col[i] for i in spec.constraints[owner[r]]["index"]],
                          [float(v) for v in center], radius) for r, cols, vc, center, radius in dynamic]

    def _build_offsets(self) -> None:
        """Per row, shift the next-state barrier by the worst additive acceleration; allocate the hot-path buffers.

        A constant acceleration w moves a position by w T^2 / 2 and its velocity by w T over
        T seconds. It acts over the latency (T0 = L dt) on the predicted state and one period
        more (T1 = T0 + dt) on the next one, so to first order the condition
        h(x_{L+1}) >= (1 - gain) h(x_L) loses grad h . (E(T1) - (1 - gain) E(T0)) w;
        the worst sign per axis is the one lowering the row. A keep-out row's normal n changes
        every call, so for it this keeps the maps n -> grad h . E(T1) (for the sign) and
        n -> shift per axis, used in `_linearize_keepouts`.
        """
        spec, R, N, C = self.spec, self._R, self._n + self._nz, self._cases
        W, Wv = self._M[:R], -self._M[R:]
        f_next, closing0_next = self._f.copy(), self._closing0.copy()
        self._dyn_offsets = [None] * len(self._dynamic)
        if np.any(self._w_max > 0):
            cols = {o: j for j, o in enumerate(spec.state_index)}
            E0, E1 = (np.zeros((N, len(spec.position_index))) for _ in range(2))
            for E, T in ((E0, spec.latency_steps * spec.dt), (E1, (spec.latency_steps + 1) * spec.dt)):
                for k, (p, v) in enumerate(zip(spec.position_index, spec.velocity_index)):
                    E[cols[p], k] = 0.5 * T * T
                    E[cols[v], k] = T
            S = (W + Wv) @ E1  # (rows, axes): how each axis's push raises each row
            w = -self._w_max * np.sign(S)
            e = w @ E1.T - self._keep[:, None] * (w @ E0.T)  # (rows, state)
            f_next += np.einsum("ij,ij->i", W, e)
            closing0_next -= np.einsum("ij,ij->i", Wv, e)
            for i, (r, pcols, vcols, acols, _, _) in enumerate(self._dynamic):
                Pw, Pv = np.zeros((len(pcols), N)), np.zeros((len(pcols), N))  # W_r = n Pw, Wv_r = n Pv
                Pw[range(len(pcols)), pcols] = 1.0
                if vcols is not None:
                    Pv[range(len(pcols)), vcols] = 1.0
                if acols is not None:
                    Pv[range(len(pcols)), acols] = self._tau
                Er = E1 - self._keep[r] * E0
                self._dyn_offsets[i] = tuple([(int(a), int(k), float(X[a, k])) for a, k in zip(*np.nonzero(X))]
                                             for X in ((Pw + Pv) @ E1, Pw @ Er, Pv @ Er))
        # Per-row constants of [distance part | closing part]: rows 0..C-1 of Y (states x_L), then C..2C-1 (next states).
        C = self._cases
        self._off = np.vstack([np.tile(np.concatenate([self._f - self._margin, self._closing0]), (C, 1)),
                               np.tile(np.concatenate([f_next - self._margin, closing0_next]), (C, 1))])
        self._MB = self._M @ self._B  # (2 rows, inputs): [W B; -Wv B], refreshed when keep-out rows move
        self._Y, self._Q, self._H = np.empty((2 * C, 2 * R)), np.empty((2 * C, R)), np.empty((2 * C, R))
        self._mu, self._V, self._Z = np.empty(2 * R), np.empty((C, 2 * R)), np.empty((C, 2 * R))
        self._req, self._t, self._t2, self._cond = (np.empty((C, R)) for _ in range(4))

    def reset(self) -> None:
        """Forget pending actions and predicted state (call at episode start)."""
        self._predictor.reset()

    # ---- barrier algebra ------------------------------------------------------
    def _linearize_keepouts(self, x: np.ndarray) -> None:
        """Replace each keep-out zone's row by the tangent halfspace at the position in x (plain floats: 2-3 entries)."""
        M, R, C, off = self._M, self._R, self._cases, self._off
        for (r, pcols, vcols, acols, center, radius), maps in zip(self._dynamic, self._dyn_offsets):
            xs = x.tolist()
            diff = [xs[j] - c for j, c in zip(pcols, center)]
            dist = math.sqrt(sum([d * d for d in diff]))
            n = [d / dist for d in diff] if dist > 1e-9 else [1.0] + [0.0] * (len(diff) - 1)
            f = -sum([a * c for a, c in zip(n, center)]) - radius
            for j, a in zip(pcols, n):
                M[r, j] = a
            for j, a in zip(vcols or (), n):
                M[R + r, j] = -a
            for j, a in zip(acols or (), n):
                M[R + r, j] = -self._tau * a
            shift_f = shift_closing = 0.0
            if maps is not None:  # the worst disturbance for this normal (see `_build_offsets`)
                Q, Fw, Fv = maps  # nonzero entries (i, axis, value) of the maps from n
                S = [0.0] * len(self._w_list)
                for i, k, q in Q:
                    S[k] += n[i] * q
                w = [-wm if s > 0.0 else (wm if s < 0.0 else 0.0) for s, wm in zip(S, self._w_list)]
                shift_f = sum([n[i] * v * w[k] for i, k, v in Fw])
                shift_closing = sum([n[i] * v * w[k] for i, k, v in Fv])
            for k in range(C):  # item stores: cheaper than slice stores at this size
                off[k, r] = f - self._margin
                off[C + k, r] = f + shift_f - self._margin
                off[C + k, R + r] = self._closing0_list[r] - shift_closing
        np.dot(M, self._B, out=self._MB)

    def _prepare(self) -> np.ndarray:
        """h at x_L and at the next state under the loaded action, per case and row (self._H); h per constraint now."""
        C, R = self._cases, self._R
        P = self._predictor.predict()  # rows: each case's x_L, then each case's next state
        if self._dynamic:
            self._linearize_keepouts(P[0])
        Y = np.dot(P, self._M.T, out=self._Y)  # [distance - offset | closing speed - offset]
        Y += self._off
        closing = np.maximum(Y[:, R:], 0.0, out=self._Q)
        closing *= closing
        closing *= self._inv2a
        np.subtract(Y[:, :R], closing, out=self._H)
        np.multiply(self._keep, self._H[:C], out=self._req)  # the condition asks h(x+) >= (1 - gain) h(x_L)
        return self._per_constraint(self._H[:C].min(axis=0)) if R else np.zeros(0)

    def _loaded_action_is_safe(self) -> bool:
        """True when the loaded action meets every condition in every case (from `_prepare`, no more products)."""
        return not self._R or float(np.subtract(self._H[self._cases:], self._req, out=self._cond).min()) >= 0.0

    def _free_part(self, u_loaded: np.ndarray) -> None:
        """self._Z: the conditions' part that does not depend on the action, so `_conditions(u)` is cheap for any u."""
        C, R = self._cases, self._R
        np.dot(self._MB, u_loaded, out=self._mu)
        np.multiply(self._scales, self._mu, out=self._V)
        np.subtract(self._Y[C:], self._V, out=self._Z)
        self._Z[:, :R] -= self._req

    def _conditions(self, u: np.ndarray) -> np.ndarray:
        """h_r(x+(u)) - (1 - gain_r) h_r(x_L) per case and row (>= 0 is safe); leaves the closing speeds in self._t."""
        R = self._R
        np.dot(self._MB, u, out=self._mu)
        V = np.multiply(self._scales, self._mu, out=self._V)  # the input's effect, per gain case
        V += self._Z
        closing = np.maximum(V[:, R:], 0.0, out=self._t)
        np.multiply(closing, closing, out=self._t2)
        self._t2 *= self._inv2a
        return np.subtract(V[:, :R], self._t2, out=self._cond)

    def _meets(self, u: np.ndarray, tol: float) -> bool:
        """True when h(x+(u)) >= required - |tol| for every row and every input-gain case."""
        return not self._R or float(self._conditions(u).min()) >= tol  # a NaN fails the comparison

    def _linearized_rows(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tangent cuts G v >= lb of the conditions at u, stacked over the cases; needs `_conditions(u)` just before."""
        R = self._R
        # d h / d u = (W + closing / a Wv) B, per case; self._MB holds [W B; -Wv B] for the nominal gain
        G = (self._t * self._inva)[:, :, None] * self._MB[R:]
        np.subtract(self._MB[:R], G, out=G)
        G *= self._scales[:, :, None]
        G = G.reshape(-1, self._m)
        return G, G @ u - self._cond.reshape(-1)

    def cbf_conditions(self, obs: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        """For tests and diagnostics: u -> h_r(x+(u)) - (1 - gain_r) h_r(x) per row (>= 0 is safe); no state change."""
        pred = self._predictor
        saved = pred.v.copy()
        pred.load_observation(np.asarray(obs, np.float64)[self._obs_src])
        pred.load_action(self._fallback)
        self._prepare()
        self._free_part(self._fallback)
        pred.v[:] = saved
        Z, MB = self._Z.copy(), self._MB.copy()

        def conditions(u: np.ndarray) -> np.ndarray:
            Z_now, MB_now = self._Z, self._MB
            self._Z, self._MB = Z, MB
            try:
                return self._conditions(np.asarray(u, np.float64)).reshape(-1).copy()
            finally:
                self._Z, self._MB = Z_now, MB_now

        return conditions

    # ---- the filter -----------------------------------------------------------
    def filter(self, obs: np.ndarray, action: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        """Return the safe action (float32[act_dim], normalized units) for one observation and the shield info."""
        t0 = time.perf_counter()
        obs = np.asarray(obs)
        action = np.asarray(action, dtype=np.float32).reshape(-1)
        # Plain floats: for 1-15 entries a list check costs less than one numpy reduction.
        obs_ok = obs.shape == self._obs_shape and all(map(math.isfinite, obs.tolist()))
        act_list = action.tolist()
        act_ok = action.shape == self._act_shape and all(map(math.isfinite, act_list))
        bad = not (obs_ok and act_ok)
        pred = self._predictor
        if obs_ok:
            pred.load_observation(obs[self._obs_src])
        elif not pred.load_prediction():  # no state observed: trust the prediction from the last good one
            u = self._fallback32.copy()
            pred.commit(u, have_state=False)
            return u, self._info(True, True, True, np.full(self._n_constraints, np.nan), 0.0, t0)
        u_p = self._fallback if bad else action.astype(np.float64)
        pred.load_action(u_p)
        h_now = self._prepare()
        checked = False
        if not bad and all(lo <= a <= hi for a, lo, hi in zip(act_list, self._low32_list, self._high32_list)):
            if self._loaded_action_is_safe():  # the common case: returned bitwise unchanged, no QP
                pred.commit(None, have_state=True)
                return action.copy(), self._info(False, False, False, h_now, 0.0, t0)
            checked = self._box_exact  # u_p is its own box projection and fails the conditions
        self._free_part(u_p)
        u, feasible, slack = self._solve(u_p, checked)
        out = u.astype(np.float32)
        pred.commit(u, have_state=True)
        intervened = bad or not np.array_equal(out, action)
        return out, self._info(intervened, bad or not feasible, bad, h_now, slack, t0)

    def note_sent(self, action: np.ndarray) -> None:
        """The plant got `action` (normalized units) instead of the last `filter` output: predict from what it got.

        Call it after `filter` for the same step when the server sent something else (a
        deadline overrun answered with the fallback, a transport failure): the pending actions
        (latency) and the next predicted state then follow the action the plant really applies.
        The latest call wins; before any `filter` since `reset` it does nothing. A NaN/Inf or
        wrongly sized action is ignored: nothing non-finite reaches the prediction.
        """
        u = np.asarray(action, dtype=np.float64).reshape(-1)
        if u.shape == self._act_shape and all(map(math.isfinite, u.tolist())):
            self._predictor.resend(u)

    def _solve(self, u_p: np.ndarray, checked: bool) -> tuple[np.ndarray, bool, float]:
        """Sequential linearization of the concave barrier conditions; QP each time. Returns (u, feasible, slack).

        `checked`: u_p is in the box and just failed the conditions, so it is not tried again.
        """
        u = u_p if checked else np.clip(u_p, self._low, self._high)
        for it in range(_SQP_ITERS):
            if it == 0:
                if checked:
                    self._conditions(u)  # the closing speeds the linearization needs
                elif self._meets(u, 0.0):
                    return u, True, 0.0  # the box projection already meets every condition: it is the optimum
            G, lb = self._linearized_rows(u)  # the last `_conditions` call was at u
            u_new = self._projection.solve(G, lb, u_p)
            if u_new is None:
                return self._brake(G, lb)
            step = max([abs(a - b) for a, b in zip(u_new.tolist(), u.tolist())])
            u = u_new
            # The tangent cuts contain the true safe set, so a solution that meets the true
            # conditions is also the projection onto the true set.
            if step < 1e-12 or self._meets(u, -_SQP_TOL):
                break
        return u, True, 0.0

    def _brake(self, G: np.ndarray, lb: np.ndarray) -> tuple[np.ndarray, bool, float]:
        """Infeasible QP: least-violation braking (see shield.fallback)."""
        u = self._least_violation_brake(G, lb)
        return u, False, float(max(0.0, np.max(lb - G @ u)))

    def _per_constraint(self, h_rows: np.ndarray) -> np.ndarray:
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
