"""`CbfShield`: a discrete-time control-barrier-function safety filter solved as a small QP.

Each step, for the observation ``o`` and the policy's action ``u_p``:

1. The shield state ``x = [o[state_index], z]`` (``z``: predicted-only internal
   states such as the realized acceleration of a lagged inner loop; the angles of
   joints that turn without limit read wrapped, `ShieldSpec.angles`) is predicted
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
   (for a speed row, ``>= min((1 - gain_r) h_r(x), near_r)``: far from its bound it only asks the next state to
   keep the input's one-step reach from it, `BarrierRows._near`) and the input box, in both gain cases (h is
   concave along the gain scaling, so the two ends bound the gains between, to first order) and for the worst additive
   acceleration within `disturbance_accel` (per row, each axis at the bound
   that lowers it). ``h(x+(u))`` is concave in ``u``. Usually one condition binds:
   the action is first projected onto it exactly (a scalar Newton solve on its
   KKT conditions, `_project_on_row`), which is the optimum when every other
   condition and the box hold there (and so are projections onto conditions that
   move disjoint inputs, combined: a fence's corner). Otherwise the conditions are linearized and
   the QP re-solved at the new point until the true conditions hold (a few
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
6. Blind steps (observations dropped, NaN) are dead reckoning, and its error grows:
   after k of them the state is known to within a box delta_k (per state,
   ``delta_k = |A| delta_(k-1) + e``, e the per-step effect of the unmodelled
   acceleration w: the larger of `disturbance_accel` and the monitor's measured
   `accel`, per position). Every barrier row is evaluated at the worst point of
   that box (distance less |W| delta, closing speed plus |Wv| delta), so the
   conditions stay sound while w bounds what the model leaves out. The blind
   horizon (`blind_horizon`, steps) is the most blind steps after which every
   position is still known to within the spec's margin; past it the tightening
   takes more than the margin the plant keeps anyway, and soundness rests on the
   bound w alone over an ever longer prediction. There the rows are no longer
   tightened: a box wider than the margin makes both sides of a band look
   crossed, and braking hard "away" from both is no direction at all (a blind
   quadrotor braked that way crossed its bounds several times as often as one
   dead-reckoned plainly). Instead `info["blind"]` is True and
   `blind_past_horizon` counts those steps (`info["blind_steps"]`: the current
   run), so the caller knows the guarantee has run out.

7. A spec with a `predictive` section (a constraint on a coordinate the actuator does not drive, which no
   per-position braking barrier keeps) is filtered by `shield.predictive` instead of steps 2-4, over the same
   prediction buffer (pending actions, latency cases, monitor, `note_sent`): the action passes if the plan
   "this action, then the backup controller" keeps every constraint less the measured tube; else the nearest
   action whose plan does; else the backup's own action, continuing the last accepted plan. While blind, it
   plans from the dead-reckoned state and tightens every row by the dead reckoning's error box (point 6): a plan
   is accepted only if it holds from anywhere the state may be by then; when none is, the backup acts. Once
   the monitor has flagged the plant (conservative mode, until `reset`), every row's tube is taken
   `shield.monitor`'s `conservative_tube_factor` times instead of once (`PredictiveFilter.widen`), and the
   backup holds against the monitor's mean residual (`shield.predictive`, point 6).

When the policy's action satisfies every condition it is returned unchanged (bitwise).
Keep-out rows credit a plant passing them (`shield.barrier`) wherever the row could
bind this step, and `info["h"]` is the credited value. Where the credited rows reject the
action, those rows are asked again without the credit (`_uncredited_accepts`): they are
sound on their own, so either kind accepting passes the action, and the credit never costs
the policy an intervention.
If the server sends the plant something else (a deadline overrun answered with the
fallback), `note_sent(action)` keeps the latency prediction on what was really sent.

Cost: at 1 kHz every numpy call (about a microsecond whatever its size) counts, so
the spec-only work is done once: the prediction through the pending actions is one
matrix product (`shield.prediction`), the rows' matrices and offsets are laid out
for the hot path (`shield.barrier`), buffers are preallocated, and a safe action is
checked from that one pass and returned without any QP.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from operator import le, mul
from typing import Any

import numpy as np

from shield.barrier import BarrierRows
from shield.constraints import wrap_angle
from shield.fallback import BoxHalfspaceProjection, LeastViolationBrake
from shield.monitor import CONSERVATIVE_GAIN_DIVISOR, AssumptionMonitor, conservative_tube_factor
from shield.prediction import LatencyPredictor
from shield.predictive import PredictiveFilter
from shield.spec import ShieldSpec

_SQP_ITERS = 8
_ROW_NEWTON_ITERS = 30
_MAX_BLIND_HORIZON = 10_000  # steps: where the error box grows (next to) nothing, the horizon stops here
_SQP_TOL = 1e-9  # barrier units: how far the true condition may miss after the SQP (the margin covers it)


class CbfShield:
    """CBF-QP safety filter for one plant instance: `filter(obs, action) -> (safe_action, info)`.

    The hot path runs at 1 kHz on the edge box, where a numpy call costs about a
    microsecond whatever its size: everything that depends only on the spec is
    built here once, per-call work reuses preallocated buffers, and a safe action
    costs one validity check, one prediction product and one condition check.
    """

    def __init__(self, spec: ShieldSpec | dict, template: CbfShield | None = None):
        """`template`: a shield built for this same `spec` object, whose spec-derived predictive filter this one
        clones instead of building its own (a server taking on a new plant: see `PredictiveFilter.clone`)."""
        if isinstance(spec, dict):
            spec = ShieldSpec.from_dict(spec)
        self.spec = spec
        model = spec.linear_model()
        self._A, self._B, self._c = model.A, model.B, model.c
        # Robust to the input's effect being (1 +- input_gain_error) x nominal, or within the measured
        # input_gain_range: each end is a case with its own predicted state (pending actions and lagged
        # internal states scale with the gain too); h is concave along that scaling, so both ends bound
        # every gain between.
        gain_scales = spec.gain_scales()
        # With latency_min_steps, each latency the plant may have is a case too: a plant with fewer steps
        # applies each action sooner than the prediction through latency_steps would say.
        L = spec.latency_steps
        lats = [L] if spec.latency_min_steps is None else list(range(spec.latency_min_steps, L + 1))
        scales = [s for _ in lats for s in gain_scales]
        latencies = [lat for lat in lats for _ in gain_scales]
        self._cases = len(scales)
        self._n = len(spec.state_index)
        self._nz = model.internal_dim
        offsets = [model.offset(s) for s in scales]  # per case: part of the drift may scale with the gain
        inits = [model.initial_internal(s) for s in scales]
        self._state_index = np.asarray(spec.state_index, dtype=np.intp)
        self._m = spec.act_dim
        low32, high32 = spec.action_box32()
        # The box the shield works in: float32 values, so every float32 it returns lies in the declared box
        # (a bound like 0.3 has no float32; rounding the double 0.3 would land 1e-8 outside it), and
        # "action32 in the float32 box" is exactly "action64 in the box".
        self._low, self._high = low32.astype(np.float64), high32.astype(np.float64)
        self._low32_list, self._high32_list = low32.tolist(), high32.tolist()  # 1-3 entries: floats beat arrays
        self._obs_shape, self._act_shape = (spec.obs_dim,), (self._m,)
        fb = spec.fallback_action if spec.fallback_action is not None else np.zeros(self._m)
        self._fallback = np.clip(np.asarray(fb, np.float32), low32, high32).astype(np.float64)  # what the plant gets
        self._fallback32 = self._fallback.astype(np.float32)
        # A set-point action's fallback (`fallback_hold`) is the last action sent before this step: written into
        # these same arrays (the predictor and the braking share them) when the next step begins, from the output
        # or what `note_sent` says replaced it; the constant again at reset.
        self._fallback_constant = self._fallback.copy()
        holds = spec.fallback_hold
        self._fallback_holds = np.flatnonzero(holds) if holds is not None and any(holds) else None
        self._out: np.ndarray | None = None  # this step's action, held from the next step on
        self.constraint_names = [c["name"] for c in spec.constraints]
        self._obs_src = np.tile(self._state_index, self._cases)  # obs entries of every case's state
        self._angles = spec.angles or []  # (obs index, center): read wrapped into (center - pi, center + pi]
        rows = BarrierRows(spec, self._nz, self._B, scales)
        # The rows' arrays, bound here once (the keep-out update changes them in place).
        C, R = self._cases, rows.R
        self._R, self._keep, self._row_start, self._n_constraints = R, rows.keep, rows.row_start, rows.n_constraints
        self._MT_parts, self._off, self._SMB, self._SMB_flat = rows.MT_parts, rows.off, rows.SMB, rows.SMB_flat
        self._linearize_keepouts = rows.linearize_keepouts if rows.dynamic else None
        self._rows = rows
        self._near = rows.near if np.isfinite(rows.near).any() else None
        # Per-call buffers: H (states, rows) is h at x_L (first C) and at x+; V, Z (2 parts, cases, rows).
        self._Y, self._H = np.empty((2, 2 * C, R)), np.empty((2 * C, R))
        # Views bound once: at these sizes creating a slice costs about as much as the arithmetic on it.
        self._Y0, self._Y1, self._H_now, self._H_next = self._Y[0], self._Y[1], self._H[:C], self._H[C:]
        self._MT0, self._MT1 = self._MT_parts
        self._h_rows = np.empty(R)  # h per row now: the worst case's
        # Per row, the worst case: two rows are one binary ufunc; more, one reduction over the (cases, rows) view
        # (a tuple of rows would be turned into an array first, which costs twice the reduction).
        self._H_now_cases = (self._H[0], self._H[1]) if C == 2 else self._H_now
        self._closing, self._closing2 = np.empty((2 * C, R)), np.empty((2 * C, R))
        self._V, self._Z = np.empty((2, C, R)), np.empty((2, C, R))
        self._V_flat, self._Z_flat = self._V.reshape(-1), self._Z.reshape(-1)
        self._req, self._t_buffer, self._t2, self._cond = (np.empty((C, R)) for _ in range(4))
        self._cond_cases, self._cond_rows = ((self._cond[0], self._cond[1]) if C == 2 else self._cond), np.empty(R)
        self._t = self._t_buffer  # the scaled closing speeds at the last point the conditions were evaluated
        self._predictor = LatencyPredictor(
            self._A, self._B, offsets, scales, spec.latency_steps, self._n, inits, self._fallback, latencies
        )
        # Per plant: is the plant inside the declared envelope? While not, the gains are divided (conservative mode).
        self._monitor = AssumptionMonitor(
            spec, self._A, self._B, offsets, scales, spec.latency_steps, len(self._predictor.v)
        )
        if self._monitor.enabled:
            self._predictor.attach_monitor(self._monitor)
        self._keep_normal = rows.keep
        self._keep_conservative = 1.0 - (1.0 - rows.keep) / CONSERVATIVE_GAIN_DIVISOR
        self._envelope = False
        self._init_dead_reckoning(spec, model)
        self._constraint_objs = spec.constraint_objects()
        # With a `predictive` section the predictive filter keeps every constraint (`shield.predictive`), over the
        # same prediction buffer: the pending actions, the monitor and dead reckoning stay as they are.
        if spec.predictive is None:
            self._predictive = None
        elif template is not None and template.spec is spec and template._predictive is not None:
            self._predictive = template._predictive.clone()
        else:
            self._predictive = PredictiveFilter(
                spec,
                self._A,
                self._B,
                self._c,
                self._predictor,
                self._low,
                self._high,
                tube_factor=conservative_tube_factor(spec),
            )
        self._projection = BoxHalfspaceProjection(self._low, self._high, self._R * self._cases)
        self._least_violation_brake = LeastViolationBrake(self._low, self._high, self._fallback, self._R * self._cases)
        # Without keep-out rows the barrier matrices never change, so the prediction and the rows
        # compose into one map: v -> Y (offsets in the constant slot's row), one product per call.
        self._KM = None
        if not rows.dynamic:
            K = self._predictor.K
            KM = np.stack([K.reshape(len(K), 2 * C, -1) @ part for part in self._MT_parts], axis=1)  # (D, 2, 2C, R)
            KM[-1] += self._off
            self._KM = KM.reshape(len(K), -1)
            self._Y_flat = self._Y.reshape(-1)
        self.reset()

    def reset(self) -> None:
        """Forget pending actions, predicted state and the monitor's window (call at episode start)."""
        self._fallback[:] = self._fallback_constant  # no action sent yet: a set-point's fallback is the constant
        self._fallback32[:] = self._fallback
        self._out = None
        self._predictor.reset()
        self._monitor.reset()
        self._envelope = False
        self._keep = self._keep_normal
        self._blind = 0
        self._hold: np.ndarray | None = None  # the predictive filter's last accepted plan stops the plant here
        self._outside = False  # the monitor has flagged the plant this episode: the predictive conservative mode

    def _init_dead_reckoning(self, spec: ShieldSpec, model) -> None:
        """The per-step growth of the dead-reckoning error box, and the blind horizon it gives (see point 6)."""
        N = self._n + self._nz
        col = {o: j for j, o in enumerate(spec.state_index)}
        k = len(spec.position_index)
        declared = spec.disturbance_accel or [0.0] * k
        measured = ((spec.assumptions or {}).get("monitor") or {}).get("accel") or [0.0] * k
        w = [max(float(a), float(b)) for a, b in zip(declared, measured)]
        e = np.zeros(N)
        for p, v, wk in zip(spec.position_index, spec.velocity_index, w):
            e[col[p]] = 0.5 * wk * spec.dt * spec.dt
            e[col[v]] = wk * spec.dt
        self._blind_step, self._abs_A = e, np.abs(model.A)
        # The box at the state each row reads: x_L (latency_steps further on) and the next state.
        L = spec.latency_steps
        self._blind_reach = (np.linalg.matrix_power(self._abs_A, L), np.linalg.matrix_power(self._abs_A, L + 1))
        self._blind_boxes = [np.zeros(N)]  # delta_k for k = 0, 1, ...: grown on demand
        pos = [col[p] for p in spec.position_index]
        # A spec that declares no model error at all (nothing grows) is blind-sound as far as it is sound at all.
        horizon = 0 if np.any(e > 0) and pos else _MAX_BLIND_HORIZON
        while horizon < _MAX_BLIND_HORIZON and max(self._blind_box(horizon + 1)[pos]) <= spec.margin:
            horizon += 1
        self.blind_horizon = horizon
        self.blind_past_horizon = 0
        self._blind = 0

    def _blind_box(self, k: int) -> np.ndarray:
        """delta_k: per shield state, how far the dead-reckoned value may be off after k blind steps."""
        boxes = self._blind_boxes
        while len(boxes) <= k:
            boxes.append(self._abs_A @ boxes[-1] + self._blind_step)
        return boxes[k]

    def _tighten_blind(self) -> None:
        """Evaluate every row at the worst point of the dead-reckoning box (Y: distance down, closing speed up)."""
        C = self._cases
        box = self._blind_box(self._blind)
        for rows, reach in ((slice(0, C), self._blind_reach[0]), (slice(C, 2 * C), self._blind_reach[1])):
            d = reach @ box
            self._Y0[rows] -= d @ np.abs(self._MT0)
            self._Y1[rows] += d @ np.abs(self._MT1)

    def _prepare(self) -> np.ndarray:
        """h at x_L and at the next state under the loaded action, per case and row (self._H); h per constraint now."""
        Y = self._Y
        if self._KM is not None:
            np.dot(self._predictor.v, self._KM, out=self._Y_flat)
        else:
            P = self._P = self._predictor.predict()  # rows: each case's x_L, then each case's next state
            assert self._linearize_keepouts is not None  # no precomputed product: there are keep-out rows
            self._linearize_keepouts(P[0])
            np.dot(P, self._MT0, out=self._Y0)
            np.dot(P, self._MT1, out=self._Y1)
            Y += self._off
        if 0 < self._blind <= self.blind_horizon:
            self._tighten_blind()
        closing = np.maximum(self._Y1, 0.0, out=self._closing)
        np.subtract(self._Y0, np.multiply(closing, closing, out=self._closing2), out=self._H)
        np.multiply(self._keep, self._H_now, out=self._req)  # the condition asks h(x+) >= (1 - gain) h(x_L)
        if self._near is not None:  # speed rows: at most their one-step reach from the bound (`BarrierRows._near`)
            np.minimum(self._req, self._near, out=self._req)
        if not self._R:
            return np.zeros(0)
        # The worst case per row (a binary ufunc costs less than a reduction along an axis), then per constraint.
        h_rows = self._worst_case(self._H_now_cases, self._h_rows)
        return self._per_constraint(h_rows)

    def _loaded_action_is_safe(self) -> bool:
        """True when the loaded action meets every condition in every case (from `_prepare`, no more products)."""
        return not self._R or float(np.subtract(self._H_next, self._req, out=self._cond).min()) >= 0.0

    def _free_part(self, u_loaded: np.ndarray) -> None:
        """self._Z: the conditions' part that does not depend on the action, so `_conditions(u)` is cheap for any u."""
        C = self._cases
        if self._linearize_keepouts is not None:
            self._rows.refresh_input_effect()  # only paths past the safe-action check read the input's effect
        np.dot(self._SMB_flat, u_loaded, out=self._V_flat)
        np.subtract(self._Y[:, C:], self._V, out=self._Z)
        self._Z[0] -= self._req

    def _conditions(self, u: np.ndarray) -> np.ndarray:
        """h_r(x+(u)) - (1 - gain_r) h_r(x_L) per case and row (>= 0 is safe); leaves the closing speeds in self._t."""
        np.dot(self._SMB_flat, u, out=self._V_flat)  # the input's effect, per gain case
        V = self._V
        V += self._Z
        closing = self._t = np.maximum(V[1], 0.0, out=self._t_buffer)
        np.multiply(closing, closing, out=self._t2)
        return np.subtract(V[0], self._t2, out=self._cond)

    def _meets(self, u: np.ndarray, tol: float) -> bool:
        """True when h(x+(u)) >= required - |tol| for every row and every input-gain case."""
        return not self._R or float(self._conditions(u).min()) >= tol  # a NaN fails the comparison

    def _linearized_rows(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tangent cuts G v >= lb of the conditions at u, stacked over the cases; needs `_conditions(u)` just before."""
        # d h / d u = (W + closing / a Wv) B = d(distance)/du - 2 closing' d(closing')/du, per case
        G = (2.0 * self._t)[:, :, None] * self._SMB[1]
        np.subtract(self._SMB[0], G, out=G)
        G = G.reshape(-1, self._m)
        return G, G @ u - self._cond.reshape(-1)

    def _at(self, obs: np.ndarray, steering: bool) -> np.ndarray:
        """Evaluate the rows at `obs` (the fallback action loaded), leaving the per-call buffers set; no state moves."""
        pred = self._predictor
        saved = pred.v.copy()
        obs_list = np.asarray(obs, np.float64).tolist()
        self._wrap_angles(obs_list)
        pred.load_observation(np.array(obs_list)[self._obs_src])
        pred.load_action(self._fallback)
        self._rows.steer_now = steering
        try:
            h = self._prepare()
            self._free_part(self._fallback)
        finally:
            self._rows.steer_now = True
            pred.v[:] = saved
        return h

    def barrier_values(self, obs: np.ndarray, steering: bool = True) -> np.ndarray:
        """For tests and diagnostics: h per constraint at the state predicted from `obs`, with (by default) the
        keep-outs' passing credit, as `filter` reports it; no state change."""
        return self._at(obs, steering).copy()

    def cbf_conditions(self, obs: np.ndarray, steering: bool = True) -> Callable[[np.ndarray], np.ndarray]:
        """For tests and diagnostics: u -> h_r(x+(u)) - (1 - gain_r) h_r(x) per row (>= 0 is safe); no state change.

        `steering=False`: the keep-out rows without their credit for passing (what a violated row brakes on).
        """
        self._at(obs, steering)
        Z, SMB = self._Z.copy(), self._SMB_flat.copy()

        def conditions(u: np.ndarray) -> np.ndarray:  # the arithmetic of `_conditions`
            V = (SMB @ np.asarray(u, np.float64)).reshape(Z.shape) + Z
            closing = np.maximum(V[1], 0.0)
            return (V[0] - closing * closing).reshape(-1)

        return conditions

    # ---- the filter -----------------------------------------------------------
    def filter(self, obs: np.ndarray, action: np.ndarray) -> tuple[np.ndarray, dict[str, Any]]:
        """Return the safe action (float32[act_dim], normalized units) for one observation and the shield info."""
        t0 = time.perf_counter()
        if self._out is not None:
            self._hold_sent()
        obs = np.asarray(obs)
        action = np.asarray(action, dtype=np.float32).reshape(-1)
        # Plain floats: for 1-15 entries a list check costs less than one numpy reduction.
        obs_list = obs.tolist()
        obs_ok = obs.shape == self._obs_shape and all(map(math.isfinite, obs_list))
        act_list = action.tolist()
        act_ok = action.shape == self._act_shape and all(map(math.isfinite, act_list))
        bad = not (obs_ok and act_ok)
        pred = self._predictor
        if obs_ok and self._angles and self._wrap_angles(obs_list):
            obs = np.array(obs_list)
        if obs_ok:
            if self._predictor.monitor is not None and self._monitor.observe(obs_list) != self._envelope:
                self._envelope = self._monitor.flagged
                self._keep = self._keep_conservative if self._envelope else self._keep_normal
            pred.load_observation(obs[self._obs_src])
            self._blind = 0
        elif not pred.load_prediction():  # no state observed: trust the prediction from the last good one
            u = self._fallback32.copy()
            pred.commit(u, have_state=False)
            return u, self._info(True, True, True, np.full(self._n_constraints, np.nan), 0.0, t0)
        else:  # dead reckoning: one more blind step, one more step of error in the rows
            self._blind += 1
            if self._blind > self.blind_horizon:
                self.blind_past_horizon += 1
        pred.load_action(self._fallback if bad else action)
        in_box = not bad and all(map(le, self._low32_list, act_list)) and all(map(le, act_list, self._high32_list))
        if self._predictive is not None:
            return self._filter_predictive(action, act_list, bad, in_box, t0, obs_list if obs_ok else None)
        h_now = self._prepare()
        holds = min(h_now.tolist(), default=0.0) >= 0.0  # every barrier holds at x_L
        if in_box:
            meets = self._loaded_action_is_safe()  # leaves the conditions in self._cond
            if holds and meets:  # the common case: returned bitwise unchanged, no QP
                return self._pass_through(action, h_now, t0)
            # The uncredited rows are evaluated without the dead-reckoning box: while blind they are not asked.
            h_plain = None if 0 < self._blind <= self.blind_horizon else self._uncredited_accepts()
            if h_plain is not None:
                return self._pass_through(action, h_plain, t0)
        if not holds:  # a barrier is violated at x_L: brake, whatever the action
            u_p = self._fallback if bad else action.astype(np.float64)
            u = self._brake_hard(u_p)
            out = u.astype(np.float32)
            pred.commit(u, have_state=True)
            self._sent(u)
            return out, self._info(bad or out.tolist() != act_list, True, bad, h_now, 0.0, t0)
        if in_box:  # u_p is its own box projection and fails the conditions, which `_prepare` left in place
            self._t = self._closing[self._cases :]
        u_p = self._fallback if bad else action.astype(np.float64)
        self._free_part(u_p)
        u, feasible, slack = self._solve(u_p, in_box)
        out = u.astype(np.float32)
        pred.commit(u, have_state=True)
        self._sent(u)
        intervened = bad or out.tolist() != act_list  # float compare, like np.array_equal
        return out, self._info(intervened, bad or not feasible, bad, h_now, slack, t0)

    def _filter_predictive(
        self, action: np.ndarray, act_list: list, bad: bool, in_box: bool, t0: float, obs_list: list | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """The predictive filter's step (`shield.predictive`): the action if its plan holds, else the nearest one
        whose plan does, else the backup's own action (the plan accepted last continues with it)."""
        pf, pred = self._predictive, self._predictor
        assert pf is not None
        free = pf.slack_free(pred.v)
        # Widened for a persistent unmodelled acceleration (the monitor's first test), which the wider tube and the
        # backup held against the measured mean answer. Not for the second test's alone (a plant on more latency, or
        # ringing otherwise than the model): the flag is raised, but there the wider tube left no plan to accept and
        # the fallback took the plant across limits the unwidened filter kept.
        self._outside = self._outside or (self._envelope and self._monitor.drifting)
        if self._outside:  # outside the envelope the tube was measured on: a wider one (conservative mode)
            pf.widen(free)
        if self._blind:  # dead-reckoned: every plan must hold from anywhere the state may be by now
            pf.tighten(free, self._blind_box(self._blind))
        h_p = None  # the policy's plan's h, where it was evaluated
        if in_box:
            u_p = action.astype(np.float64)
            ok, h_p = pf.evaluate(free, u_p)
            if ok:
                self._hold = pf.hold_point(pred.v)
                return self._pass_through(action, h_p, t0)
        else:
            u_p = self._fallback if bad else np.minimum(np.maximum(action.astype(np.float64), self._low), self._high)
        u = pf.solve(free, u_p)
        held = None  # conservative mode: the backup held against the monitor's residual, once computed
        if u is None and self._outside:
            # The widened rows leave no plan. The plain rows are certified on every plant of the envelope, and a plant
            # inside it can be flagged (the monitor's bounds are measured on a sample of its plants and policies):
            # there the backup held against its residual, certified by nothing, let an adversary walk a hoist at
            # its heaviest payload through its height band, where the plain filter kept it inside. So the action
            # sent is the one held against the residual where its plain plan holds, else the nearest one whose
            # plain plan holds, and that backup only where no plan holds at all: certified wherever the plant is in
            # the envelope, and as before wherever nothing could be.
            free = pf.slack_free(pred.v)
            if self._blind:
                pf.tighten(free, self._blind_box(self._blind))
            held = pf.backup(pred.v, self._hold, self._monitor.mean_residual())
            u = held if pf.evaluate(free, held)[0] else pf.solve(free, held)
        feasible = u is not None
        # The backup continuing the last accepted plan is what that plan's tube was measured on: the filter's
        # normal hand-over near a limit, certified. With no plan accepted this episode, or outside the envelope
        # (held against the monitor's measured acceleration instead), nothing certifies it: a fallback. Nor where
        # the plant is observed past a limit: no plan's tube reaches there (the plant left it), whatever was
        # accepted before.
        backup = not feasible and not bad and self._hold is not None and not self._outside
        if backup and obs_list is not None:
            backup = not any(con.violated(obs_list) for con in self._constraint_objs)
        if u is None:  # conservative mode: the backup holds against the acceleration the monitor measured
            if held is None:
                held = pf.backup(pred.v, self._hold, self._monitor.mean_residual() if self._outside else None)
            u = held
            if not (bad or backup):
                # Uncertified (no plan accepted, or the plant observed past a limit, or flagged): the backup is no
                # better founded than the policy's action, and of the two the one whose plan misses least is sent.
                # An arm holding 1.56x its heaviest declared payload, sagged below its band, was held there by the
                # backup's two-thirds torque where the legacy LQR's full torque, its plan no worse, lifted it out.
                h_backup = float(pf.evaluate(free, u)[1].min())
                if h_backup < 0.0:
                    if h_p is None:
                        h_p = pf.evaluate(free, u_p)[1]
                    if float(h_p.min()) > h_backup:
                        u = u_p
        out = u.astype(np.float32)
        u = out.astype(np.float64)  # what the plant gets: the prediction follows it
        if feasible:
            pred.load_action(u)
            self._hold = pf.hold_point(pred.v)
        pred.commit(u, have_state=True)
        self._sent(u)
        h = pf.evaluate(free, u)[1]
        intervened = bad or out.tolist() != act_list
        return out, self._info(intervened, bad or not (feasible or backup), bad, h, 0.0, t0, backup)

    def _wrap_angles(self, obs_list: list) -> bool:
        """Wrap the spec's angle entries of `obs_list` into (center - pi, center + pi], in place; True if one moved.

        The model was linearized there: a multi-turn encoder count, or a pole that fell and spun round, read
        as it comes would put the linearization radians from where it holds (and a cart-pole's coupling to its
        pole, linear in the angle, would grow without bound). An angle already in range is left bitwise as is.
        """
        moved = False
        for i, center in self._angles:
            a = obs_list[i]
            if not center - math.pi < a <= center + math.pi:
                obs_list[i] = wrap_angle(a, center)
                moved = True
        return moved

    def _uncredited_accepts(self) -> np.ndarray | None:
        """The credited rows reject the loaded action (`_loaded_action_is_safe` has left the conditions in
        self._cond): do the rows that got the credit, without it, accept it (with every other row)? If so, h per
        constraint with those rows' uncredited values; else None.

        Either kind accepting is safe: the rows without the credit are what the shield had before it, sound on
        their own, and an action they accept from a state they hold in keeps h >= 0 without the credit, which
        implies it with. So the credit never costs the policy an intervention. Only the rows that got it are
        evaluated again (`BarrierRows.uncredited`); the others' values are in the per-call buffers.
        """
        rows = self._rows
        if not rows.credited_now:
            return None
        # Every other row must hold now and meet its condition (per row, the worse case): a cheap test first.
        C = self._cases
        h_rows = self._h_rows if C > 1 else self._H[0]  # as `_prepare` left it
        cond_rows = self._worst_case(self._cond_cases, self._cond_rows)
        credited = rows.credited_rows
        if any(
            (h < 0.0 or c < 0.0) and not credited[r]
            for r, (h, c) in enumerate(zip(h_rows.tolist(), cond_rows.tolist()))
        ):
            return None
        keep = self._keep
        plain = rows.uncredited(self._P.tolist())
        if not all(min(now) >= 0.0 and all(b - keep[r] * a >= 0.0 for a, b in zip(now, nxt)) for r, now, nxt in plain):
            return None
        h_rows = h_rows.copy()
        for r, now, _ in plain:
            h_rows[r] = min(now)
        return self._per_constraint(h_rows)

    def _pass_through(self, action: np.ndarray, h_now: np.ndarray, t0: float) -> tuple[np.ndarray, dict[str, Any]]:
        """The policy's action, bitwise, as the step's output (committed to the latency prediction)."""
        self._predictor.commit(None, have_state=True)
        if self._fallback_holds is not None:
            self._sent(action)
        return action.copy(), self._info(False, False, False, h_now, 0.0, t0)

    def _sent(self, u: np.ndarray) -> None:
        """`u` is this step's action: from the next step on, a set-point action's fallback holds it."""
        if self._fallback_holds is not None:
            self._out = np.array(u, np.float64)

    def _hold_sent(self) -> None:
        """A new step: the last step's action reached the plant, and a set-point action's fallback is now it."""
        i, out = self._fallback_holds, self._out
        if i is not None and out is not None:
            self._fallback[i] = out[i]
            self._fallback32[i] = self._fallback[i]
            self._out = None

    def fallback_action(self) -> np.ndarray:
        """float32[act_dim]: the action a failed or late step sends this plant: the spec's constant, and on a
        set-point action (`fallback_hold`) the action the plant got the step before (this step's `filter` output,
        or what `note_sent` says replaced it, from the next step on), which holds the set-point."""
        return self._fallback32.copy()

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
            if self._predictor.committed:
                self._sent(np.clip(u, self._low, self._high))

    def _solve(self, u_p: np.ndarray, checked: bool) -> tuple[np.ndarray, bool, float]:
        """Sequential linearization of the concave barrier conditions; QP each time. Returns (u, feasible, slack).

        `checked`: u_p is in the box and just failed the conditions (left in self._cond), so it is
        not tried again. Usually one condition binds: with u_p in the box it is first projected onto
        the most violated condition alone, exactly (`_project_on_row`); when that meets every
        condition it is the optimum (KKT: one active concave constraint, the rest and the box
        inactive, on a convex set). When the condition violated most there moves none of the inputs
        the first one does (a fence's corner: one wall per input), u_p is projected onto it too and
        the two projections are combined: again the optimum when everything else holds there (KKT,
        each projection's multiplier on its own inputs). Otherwise the cuts are taken at the last
        point, and the condition it violates most is cut at its own exact projection.
        """
        u = u_p if checked else np.minimum(np.maximum(u_p, self._low), self._high)  # np.clip costs more
        if not checked and self._meets(u, 0.0):
            return u, True, 0.0  # the box projection already meets every condition: it is the optimum
        u_p_in_box = checked or self._projection.in_box(u_p)
        cuts = None
        if u_p_in_box:
            up = u_p.tolist()
            aj, bj, cj, dj = self._row(int(self._cond.argmin()))
            one = _project_on_row(up, aj, bj, cj, dj)
            if one is not None:
                u = np.array(one)
                if self._meets(u, -_SQP_TOL) and self._projection.in_box(u):
                    return u, True, 0.0
                k = int(self._cond.argmin())
                a, b, c, d = self._row(k)
                other = _project_on_row(up, a, b, c, d)
                if (
                    other is not None
                    and self._cond.flat[k] < 0.0
                    and not any((x or y) and (z or w) for x, y, z, w in zip(aj, cj, a, c))
                ):
                    # Row k moves none of the inputs row j moves: each projection leaves the other's inputs (and
                    # row) as they were, so together they are the KKT point of both rows.
                    u = np.array([o if (z or w) else x for x, o, z, w in zip(one, other, a, c)])
                    if self._meets(u, -_SQP_TOL) and self._projection.in_box(u):
                        return u, True, 0.0
                    cuts = self._linearized_rows(u)  # both rows are tight there: their tangents are their cuts
                else:
                    G, lb = self._linearized_rows(u)  # `_meets` just evaluated the conditions at u
                    if other is not None:  # row k's cut at its own exact projection (tighter than its tangent at u)
                        sigma = max(0.0, sum(map(mul, c, other)) + d)
                        g = [ai - 2.0 * sigma * ci for ai, ci in zip(a, c)]
                        G[k] = g
                        lb[k] = sum(map(mul, g, other)) - (sum(map(mul, a, other)) + b - sigma * sigma)
                    cuts = G, lb
        for _ in range(_SQP_ITERS):
            G, lb = cuts if cuts is not None else self._linearized_rows(u)  # the last `_conditions` call was at u
            cuts = None
            u_new = self._projection.solve(G, lb, u_p, u_p_in_box)
            if u_new is None:
                return self._brake(G, lb)
            step = max([abs(a - b) for a, b in zip(u_new.tolist(), u.tolist())])
            u = u_new
            # The tangent cuts contain the true safe set, so a solution that meets the true
            # conditions is also the projection onto the true set.
            if step < 1e-12 or self._meets(u, -_SQP_TOL):
                break
        return u, True, 0.0

    def _row(self, j: int) -> tuple[list, float, list, float]:
        """Condition j (flat over cases and rows) as h(u) = a.u + b - max(0, c.u + d)^2 (after `_free_part`)."""
        CR, SMB, Z = self._cases * self._R, self._SMB_flat, self._Z_flat
        return SMB[j].tolist(), float(Z[j]), SMB[CR + j].tolist(), float(Z[CR + j])

    def _brake_hard(self, u_p: np.ndarray) -> np.ndarray:
        """Some row has h(x_L) < 0 (violated, or its braking distance already used up): brake as hard as the box allows.

        Each input the violated rows move goes to the box end that raises the sum of their
        next-step barrier values fastest (unnormalized: a row the input barely moves, e.g.
        one the plant already leaves, yields to one it is closing on), whatever the speed:
        the action never accelerates toward a violated constraint, even where the model
        predicts the condition would hold anyway (a damped plant at 100 m/s). The other
        inputs are chosen by the least-violation brake on the remaining rows. Keep-out rows brake
        without their credit for passing (`shield.barrier`): steering past a zone the plant can no
        longer clear could point the input toward it.
        """
        u = np.minimum(np.maximum(u_p, self._low), self._high)
        if self._rows.credited_now:  # the rows violated with or without the credit, braked on without it
            H_steer = self._H[: self._cases].copy()
            self._rows.steer_now = False
            try:
                self._prepare()
            finally:
                self._rows.steer_now = True
            np.minimum(self._H[: self._cases], H_steer, out=self._H[: self._cases])
        self._free_part(u)
        self._conditions(u)
        G, lb = self._linearized_rows(u)
        violated = (self._H[: self._cases] < 0.0).reshape(-1)
        pull = G[violated].sum(axis=0)
        moved = np.abs(pull) > 1e-12 * max(1.0, float(np.abs(G[violated]).max()))
        brake = np.where(pull > 0.0, self._high, self._low)
        if moved.all():
            return brake
        low, high = np.where(moved, brake, self._low), np.where(moved, brake, self._high)
        lb = np.where(violated, -1e30, lb)  # met by any input: the violated rows have chosen theirs
        return self._least_violation_brake(G, lb, low, high, np.where(moved, brake, self._fallback))

    def _brake(self, G: np.ndarray, lb: np.ndarray) -> tuple[np.ndarray, bool, float]:
        """Infeasible QP: least-violation braking (see shield.fallback)."""
        u = self._least_violation_brake(G, lb)
        return u, False, max(0.0, float((lb - G @ u).max()))

    @staticmethod
    def _worst_case(cases: np.ndarray | tuple[np.ndarray, np.ndarray], out: np.ndarray) -> np.ndarray:
        """Per row, the smallest value over the cases: `cases` is the (cases, rows) array, or its two rows."""
        if len(cases) == 1:
            return cases[0]
        if len(cases) == 2:
            return np.minimum(cases[0], cases[1], out=out)
        return np.minimum.reduce(cases, axis=0, out=out)

    def _per_constraint(self, h_rows: np.ndarray) -> np.ndarray:
        # Rows are contiguous per constraint, so reduceat gives each constraint's worst row.
        return np.minimum.reduceat(h_rows, self._row_start)

    def _info(
        self, intervened: bool, fallback: bool, bad: bool, h: np.ndarray, slack: float, t0: float, backup: bool = False
    ) -> dict[str, Any]:
        return {
            "intervened": intervened,
            "fallback": fallback,
            "backup": backup,  # the predictive filter's backup continues its last accepted plan (not a fallback)
            "bad_input": bad,
            "h": h,
            "slack": slack,
            "envelope": self._envelope or self._outside,  # the predictive filter's conservative mode is latched
            "blind": self._blind > self.blind_horizon,
            "blind_steps": self._blind,
            "solve_us": (time.perf_counter() - t0) * 1e6,
        }


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


def _project_on_row(up: list, a: list, b: float, c: list, d: float) -> list | None:
    """argmin ||u - up||^2 s.t. h(u) = a.u + b - max(0, c.u + d)^2 >= 0, for h(up) < 0 (plain floats: 1-3 inputs).

    One barrier condition alone (concave in u, so its superlevel set is convex): on the KKT
    path u(lam) = up + lam grad h(u(lam)) the closing speed s = c.u + d has the closed form
    sigma = max(0, t) / (1 + 2 lam |c|^2) with t = s_p + lam c.a, and h(u(lam)) grows with lam;
    its root is found by Newton's method inside a bisection bracket. None when it does not
    converge (no input meets the row, or a degenerate row): the caller solves the QP instead.
    """
    hp = sum(map(mul, a, up)) + b
    sp = sum(map(mul, c, up)) + d
    A2, C2, ca = sum(map(mul, a, a)), sum(map(mul, c, c)), sum(map(mul, c, a))
    s0 = sp if sp > 0.0 else 0.0
    g2 = A2 - 4.0 * s0 * ca + 4.0 * s0 * s0 * C2  # |grad h(up)|^2
    if not g2 > 1e-300:
        return None
    lam, lo, hi = -(hp - s0 * s0) / g2, 0.0, math.inf  # the tangent's step: h is concave, so below the root
    tol = 1e-13 * (1.0 + abs(hp))
    for _ in range(_ROW_NEWTON_ITERS):
        t = sp + lam * ca
        if t > 0.0:
            q = 1.0 + 2.0 * lam * C2
            sigma = t / q
            dsigma = (ca - 2.0 * C2 * sigma) / q
            phi = hp + lam * (A2 - 2.0 * sigma * ca) - sigma * sigma
            dphi = A2 - 2.0 * sigma * ca - 2.0 * (lam * ca + sigma) * dsigma
        else:
            sigma, phi, dphi = 0.0, hp + lam * A2, A2
        if abs(phi) <= tol:  # the caller checks the conditions at u with its own tolerance
            u = [x + lam * (ai - 2.0 * sigma * ci) for x, ai, ci in zip(up, a, c)]
            s = sum(map(mul, c, u)) + d
            h = sum(map(mul, a, u)) + b - (s * s if s > 0.0 else 0.0)
            # Evaluated at u itself: far out (a row no input meets) the closed form can cancel to 0.
            return u if abs(h) <= 1e3 * tol else None
        if lam > 1e12:
            return None  # no input meets the row (its gradient vanishes along the path)
        if phi > 0.0:
            hi = lam
        else:
            lo = lam
        step = lam - phi / dphi if dphi > 0.0 else math.nan
        lam = step if lo < step < hi else (0.5 * (lo + hi) if hi < math.inf else 2.0 * lam + 1e-12)
    return None
