"""`BarrierRows`: the shield spec's constraints as barrier rows over the shield state, built once.

Each constraint gives rows ``h_r(x) = d_r(x) - margin - max(0, s_r(x))^2 / (2 a_r)``
with the distance ``d = W x + f`` and, for positions, the closing speed
``s = closing0 - Wv x`` braked at ``a_r`` (see `shield.cbf` for the conditions
built on them). Rows of keep-out zones (cylinders, spheres) are re-linearized at
the predicted position every call (`linearize_keepouts`). Everything here that
the hot path reads is laid out for it: both parts of every row in one matrix,
offsets per predicted state, and the input's effect per gain case.
Stdlib + numpy only.
"""

from __future__ import annotations

import math
from operator import mul
from typing import Any

import numpy as np

from shield.constraints import LinearRow
from shield.spec import ShieldSpec


class BarrierRows:
    """Barrier rows of a spec over ``[obs[state_index], internal]``; read by `CbfShield` on every call."""

    def __init__(self, spec: ShieldSpec, internal_dim: int, B: np.ndarray, scales: list[float]):
        self.spec = spec
        self._n, self._nz = len(spec.state_index), internal_dim
        self._B, self._m = B, B.shape[1]
        self._cases = len(scales)
        self._scales = np.array(scales)[:, None]
        self._margin = spec.margin
        self._w_max = np.asarray(spec.disturbance_accel or [0.0] * len(spec.position_index), np.float64)
        self._w_list = self._w_max.tolist()
        self._build_rows()
        self._build_offsets()

    def _build_rows(self) -> None:
        """Barrier rows: d = W x + f (distance), closing speed = -(Wv x), per-row gain and braking."""
        spec = self.spec
        col = {o: j for j, o in enumerate(spec.state_index)}
        vel_of = dict(zip(spec.position_index, spec.velocity_index))
        # Per position: the braking acceleration toward - and toward + (a row brakes toward its normal).
        brake_of = dict(zip(spec.position_index, spec.brake_accel_pairs))
        N = self._n + self._nz
        W, Wv, f, brake, gain, owned, closing0 = [], [], [], [], [], [], []
        # With a lagged inner loop (response time tau) the realized acceleration z is an internal
        # state; braking starts ~tau late, so the closing speed the barrier brakes from is
        # s + tau (z_n + a_brake + w_n): the speed reached before the commanded deceleration takes
        # hold, with the worst disturbance w pushing meanwhile.
        # Per position, (toward -, toward +): the disturbance bound (the same both ways) and a push's speed beyond
        # what braking absorbs while it lasts (spec.push_velocity): every row brakes from its closing speed plus
        # the most of it along the row's normal.
        w_of = {o: (w, w) for o, w in zip(spec.position_index, self._w_list)}
        kick_of = dict(zip(spec.position_index, spec.push_velocity or [(0.0, 0.0)] * len(spec.position_index)))
        tau = float(spec.model.get("response_time_s", 0.0)) if spec.model["type"] == "double_integrator" else 0.0
        accel_col = {o: self._n + k for k, o in enumerate(spec.position_index)} if self._nz else {}
        dynamic = []  # (row, state cols, velocity cols or None, center, radius)

        def add_row(weights: dict[int, float], offset: float, g: float, k: int, directional: bool = True) -> int:
            w, wv = np.zeros(N), np.zeros(N)
            for o, v in weights.items():
                w[col[o]] = v
            positional = all(o in vel_of for o in weights)
            if positional:
                for o, v in weights.items():
                    wv[col[vel_of[o]]] = v
                    if o in accel_col:
                        wv[accel_col[o]] = tau * v
            # The distance grows along +weights: braking accelerates that way, so a positive weight
            # counts on the position's toward-+ braking and a negative one on its toward-- braking.
            # A keep-out row's normal changes every step (not directional): the weaker direction.
            a_brake = (
                min(brake_of[o][v > 0] if directional else min(brake_of[o]) for o, v in weights.items())
                if positional
                else math.inf
            )
            if positional:
                w_n, kick_n = _along_normal(weights, directional, w_of), _along_normal(weights, directional, kick_of)
                closing0.append(tau * (a_brake + w_n) + kick_n)
            else:
                closing0.append(0.0)
            W.append(w)
            Wv.append(wv)
            f.append(offset)
            brake.append(a_brake)
            gain.append(g)
            owned.append(k)
            return len(W) - 1

        for k, con in enumerate(spec.constraint_objects()):
            for row in con.rows():
                if isinstance(row, LinearRow):
                    add_row(row.weights, row.offset, con.gain, k)
                else:  # a keep-out zone: weights filled per step
                    idx = list(row.index)
                    r = add_row({i: 1.0 for i in idx}, 0.0, con.gain, k, directional=False)
                    cols = [col[i] for i in idx]
                    vcols = [col[vel_of[i]] for i in idx] if all(i in vel_of for i in idx) else None
                    dynamic.append((r, cols, vcols, np.asarray(row.center, np.float64), float(row.radius)))
        R = self.R = len(W)
        self._W, self._Wv = np.array(W).reshape(R, N), np.array(Wv).reshape(R, N)
        self._f = np.array(f, dtype=np.float64)
        self._closing0 = np.array(closing0, dtype=np.float64)
        self._closing0_list = [float(c) for c in closing0]  # plain floats: numpy scalars cost ~10x in the hot loop
        self._tau = tau
        positional = self.positional = np.isfinite(np.array(brake, dtype=np.float64))  # rows on positions
        # h = d - closing^2 / (2 a): closing speeds are carried scaled by 1 / sqrt(2 a), so h = d - closing'^2.
        self._root = np.sqrt(np.where(positional, 0.5 / np.where(positional, brake, 1.0), 0.0))
        self._root_list = self._root.tolist()
        self.keep = 1.0 - np.array(gain, dtype=np.float64)  # the share of h the next step must keep
        owner = np.array(owned, dtype=np.intp)
        self.n_constraints = len(spec.constraints)
        self.row_start = np.searchsorted(owner, np.arange(self.n_constraints))
        if R and len(set(owner.tolist())) != self.n_constraints:
            raise ValueError("shield spec: every constraint needs at least one finite bound")
        # Keep-out rows as plain lists: (row, position cols, velocity cols, acceleration cols, center, radius).
        self.dynamic = [
            (
                r,
                cols,
                vc,
                None if vc is None or not accel_col else [accel_col[i] for i in spec.constraints[owner[r]]["index"]],
                [float(v) for v in center],
                radius,
            )
            for r, cols, vc, center, radius in dynamic
        ]
        # Per keep-out row, the matrix entries its unit normal n sets: the distance's (state, index into n) and
        # the closing speed's (state, index into n, factor); with steering, the sideways speed's entries in the
        # distance part (state, index into the sideways direction, factor).
        self._dyn_writes: dict[int, tuple[Any, Any, Any]] = {}
        self._credited = [False] * R  # per row: are its sideways-speed entries nonzero now?
        # The rows the last `linearize_keepouts` credited: (row, normal, distance offset without the credit,
        # how each axis's push raises the row without it, the push maps, closing0, root), read by `uncredited`.
        self._last_credited: list = []
        # Per keep-out row, each of its positions' index among the spec's positions (the disturbance's axes).
        self._zone_axes = {
            r: [spec.position_index.index(o) for o in spec.constraints[owner[r]]["index"]] for r, *_ in self.dynamic
        }
        self.steering = bool(spec.keepout_steering)
        T0, T1 = spec.latency_steps * spec.dt, (spec.latency_steps + 1) * spec.dt
        for r, pcols, vcols, acols, _, radius in self.dynamic:
            root = self._root_list[r]
            speed = [(j, i, 1.0) for i, j in enumerate(vcols or ())] + [
                (j, i, self._tau) for i, j in enumerate(acols or ())
            ]
            keep = float(self.keep[r])
            # Steering: (R = radius + margin, 1 / (2 a), sideways-speed entries, position and velocity exposure
            # to a push over the step, as in `_build_offsets`), or None.
            axes = spec.constraints[owner[r]]["index"]
            steer = (
                (
                    radius + self._margin,
                    root * root,
                    speed,
                    0.5 * (T1 * T1 - keep * T0 * T0),
                    T1 - keep * T0,
                    [w_of[o][0] for o in axes],
                    self._closing0_list[r],
                )
                if self.steering and vcols is not None
                else None
            )
            self._dyn_writes[r] = (
                [(j, i) for i, j in enumerate(pcols)],
                [(j, i, -root * f) for j, i, f in speed],
                steer,
            )

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
        spec, R, N, C = self.spec, self.R, self._n + self._nz, self._cases
        W, Wv = self._W, self._Wv
        f_next, closing0_next = self._f.copy(), self._closing0.copy()
        self._dyn_offsets: list[Any] = [None] * len(self.dynamic)
        latency_push = np.zeros(R)  # per row, what the worst push over the latency takes off h(x_L)
        if np.any(self._w_max > 0):
            cols = {o: j for j, o in enumerate(spec.state_index)}
            E0, E1 = (np.zeros((N, len(spec.position_index))) for _ in range(2))
            for E, T in ((E0, spec.latency_steps * spec.dt), (E1, (spec.latency_steps + 1) * spec.dt)):
                for k, (p, v) in enumerate(zip(spec.position_index, spec.velocity_index)):
                    E[cols[p], k] = 0.5 * T * T
                    E[cols[v], k] = T
            S = (W + Wv) @ E1  # (rows, axes): how each axis's push raises each row
            w = -self._w_max * np.sign(S)
            w0 = w @ E0.T  # (rows, state): the push's effect over the latency alone
            e = w @ E1.T - self.keep[:, None] * w0
            f_next += np.einsum("ij,ij->i", W, e)
            latency_push = -np.einsum("ij,ij->i", W, w0)
            closing0_next -= np.einsum("ij,ij->i", Wv, e)
            for i, (r, pcols, vcols, acols, _, _) in enumerate(self.dynamic):
                Pw, Pv = np.zeros((len(pcols), N)), np.zeros((len(pcols), N))  # W_r = n Pw, Wv_r = n Pv
                Pw[range(len(pcols)), pcols] = 1.0
                if vcols is not None:
                    Pv[range(len(pcols)), vcols] = 1.0
                if acols is not None:
                    Pv[range(len(pcols)), acols] = self._tau
                Er = E1 - self.keep[r] * E0
                self._dyn_offsets[i] = tuple(
                    [(int(a), int(k), float(X[a, k])) for a, k in zip(*np.nonzero(X))]
                    for X in ((Pw + Pv) @ E1, Pw @ Er, Pv @ Er)
                )
        # Barrier parts per state: Y[0] = distance - margin, Y[1] = closing speed scaled by 1 / sqrt(2 a),
        # each (states, rows) with rows 0..C-1 for x_L and C..2C-1 for x+. Kept as separate contiguous
        # blocks: numpy's per-call cost roughly doubles on strided slices at these sizes.
        root = self._root
        self._MT = np.ascontiguousarray(np.vstack([W, -Wv * root[:, None]]).T)  # (state, 2 rows)
        self.MT_parts = (self._MT[:, :R], self._MT[:, R:])
        self.off = np.stack(
            [
                np.concatenate([np.tile(self._f - self._margin, (C, 1)), np.tile(f_next - self._margin, (C, 1))]),
                np.concatenate([np.tile(self._closing0 * root, (C, 1)), np.tile(closing0_next * root, (C, 1))]),
            ]
        )
        # The input's effect on both parts per gain case, (2, cases, rows, inputs); refreshed when keep-out rows move.
        self._MB = self._MT.T @ self._B
        self._scales4 = self._scales[None, :, :, None]
        self.SMB = self._scales4 * self._MB.reshape(2, 1, R, self._m)
        self.SMB_flat = self.SMB.reshape(-1, self._m)
        self.near = self._near(latency_push)
        self._input_effect_stale = False
        self.steer_now = True  # `CbfShield._brake_hard` turns the keep-outs' steering credit off while it brakes
        # The keep-out rows' hot loop writes single entries: through flat memoryviews of the (contiguous) matrix
        # and offsets, a few times cheaper per store than numpy's item assignment. Per row, flat indices of
        # what it writes: MT[state, r] = W, MT[state, R + r] = -Wv / sqrt(2a), off[part, state, r].
        # (ndarray.data is that memoryview; typed Any: its items are float64, which typeshed cannot say)
        self._MT_mv: Any = self._MT.reshape(-1).data
        self._off_mv: Any = self.off.reshape(-1).data
        two_r = 2 * R
        self._hot = []
        for (r, pcols, _, _, center, radius), maps in zip(self.dynamic, self._dyn_offsets):
            pos_writes, closing_writes, steer = self._dyn_writes[r]
            if steer is not None:  # the sideways-speed entries' flat indices in place of their state columns
                steer = (
                    steer[:2]
                    + ([(j * two_r + r, i, fac) for j, i, fac in steer[2]], *steer[2:])
                    + ([j * two_r + r for j, _, _ in steer[2]],)
                )
            self._hot.append(
                (
                    r,
                    pcols,
                    center,
                    radius,
                    [(j * two_r + r, i) for j, i in pos_writes],
                    [(j * two_r + R + r, i, coef) for j, i, coef in closing_writes],
                    steer,
                    maps,
                    self._zone_axes[r],
                    [k * R + r for k in range(C)],
                    [(C + k) * R + r for k in range(C)],
                    [(3 * C + k) * R + r for k in range(C)],
                    self._closing0_list[r],
                    self._root_list[r],
                )
            )

    def _near(self, latency_push: np.ndarray) -> np.ndarray:
        """Per row, where the class-K condition saturates: h(x+) >= min((1 - gain) h(x_L), near); inf: never.

        A row on a speed (not a position) is one end of a box whose other end the plant approaches whenever it
        brakes away from this one; with h(x+) >= (1 - gain) h(x_L) alone, the far end, h large, caps the
        braking at gain x h per step (a heavy arm falling at 1.1 rad/s inside a 1.5 rad/s box was let brake at a
        fraction of its authority, and fell through its lower bound). Far from its bound the row only asks that
        the next state not come nearer than the input's own one-step reach on it (its largest change under the
        full box, strongest gain), plus what the worst push over the latency takes off h(x_L), which the next
        state's offset credits (see `_build_offsets`); within that the class-K condition holds as before. Still
        an extended class-K condition (h - min((1 - gain) h, near) is increasing and at most h), so the set stays
        invariant. Positions keep the plain condition: their braking-distance barrier has no far end to cap it,
        and so do rows the input does not move within the step (no reach to saturate at).
        """
        low, high = self.spec.action_box32()
        span = np.maximum(np.abs(low), np.abs(high)).astype(np.float64)
        reach = (np.abs(self.SMB[0]) @ span).max(axis=0)  # (rows,): the largest one-step change over the cases
        speed_row = ~self.positional & (reach > 1e-12)
        return np.where(speed_row, reach + self.keep * np.maximum(latency_push, 0.0), np.inf)

    def linearize_keepouts(self, x: np.ndarray) -> None:
        """Replace each keep-out zone's row by the tangent halfspace at the position in x (plain floats: 2-3 entries).

        With steering (`ShieldSpec.keepout_steering`) the row also credits the speed past the zone.
        For a point at distance r from the centre, closing at s and moving sideways at q, braking
        radially at a (and holding q against pushes) conserves the "energy" of the radial motion,
        so the closest approach stays outside R exactly when

            h = (r - R) - s^2 / (2 a) + (r^2 / R^2 - 1) q^2 / (2 a)  >=  0

        (with q = 0 the braking-distance form). Kept linear in the state like every row: q^2 by
        its tangent at this state's q (a lower bound, the square is convex), r^2 / R^2 by its
        tangent (convex too) with r by n . (p - c) <= r, and q reduced by what the worst push can
        take off it over the inner loop's lag. Inside R the credit is 0, and so it is far from the
        zone (braking from the full speed in any direction takes under half the gap: the row cannot
        bind this step, and the credit would only cost time). A violated row brakes without it
        (`CbfShield._brake_hard` turns it off): never toward the zone. The worst push is chosen for
        the whole row at once: per axis, the sign that lowers distance, closing speed and credit
        together (a push cannot both close on the zone and slow the sideways speed at full
        strength unless the axes allow it).
        """
        MT, off, w_list = self._MT_mv, self._off_mv, self._w_list
        xs = x.tolist()
        steering = self.steering and self.steer_now
        credited = self._last_credited
        credited.clear()
        for (
            r,
            pcols,
            center,
            radius,
            pos_writes,
            closing_writes,
            steer,
            maps,
            zone_axes,
            i_now,
            i_next,
            i_closing,
            closing0_r,
            root_r,
        ) in self._hot:
            dist, n = _normal(xs, pcols, center)
            nc = sum(map(mul, n, center))
            f = -nc - radius
            grow = 1.0  # the distance's weight (1 + the credit's growth with r)
            credit_f = credit_shift = beta = 0.0
            S_plain, row_credited = None, False
            if steer is not None:
                big_r, k2, speed, speed_cols, e_pos, e_vel, w_row, closing0, credit_idx = steer
                q0 = 0.0
                if steering and dist > big_r:
                    q0, lost, t, vn = self._sideways(steer, xs, n, dist)
                if q0 > 0.0:
                    rho = dist * dist / (big_r * big_r) - 1.0
                    kappa = k2 * 2.0 * dist / (big_r * big_r) * q0 * q0
                    g = 2.0 * k2 * rho * q0
                    grow = 1.0 + kappa
                    f -= kappa * (nc + dist)
                    credit_f = -k2 * rho * q0 * (q0 + 2.0 * lost)
                    for a, i, fac in speed:
                        MT[a] = g * fac * t[i]
                    self._credited[r] = row_credited = True
                    # How a push along n and along t raises the row over the step: distance (with the
                    # credit's growth) and closing speed (at this state's), and the credit's speed part.
                    alpha = grow * e_pos + 2.0 * k2 * max(closing0 - vn, 0.0) * e_vel
                    beta = g * e_vel
                elif self._credited[r]:
                    for a in credit_idx:
                        MT[a] = 0.0
                    self._credited[r] = False
            for a, i in pos_writes:
                MT[a] = grow * n[i]
            for a, i, coef in closing_writes:
                MT[a] = coef * n[i]
            shift_f = shift_closing = 0.0
            if maps is not None:  # the worst disturbance for this normal (see `_build_offsets`)
                Q, Fw, Fv = maps  # nonzero entries (i, axis, value) of the maps from n
                S = [0.0] * len(w_list)
                for i, k, q in Q:
                    S[k] += n[i] * q
                if row_credited:
                    S_plain = S[:]  # the row without the credit: its own worst push (`uncredited`)
                if beta:  # with the credit: the sign that lowers the whole row, per axis of the zone
                    for k, a, b in zip(zone_axes, n, t):
                        S[k] = alpha * a + beta * b
                w, shift_f, shift_closing = _push(S, w_list, n, Fw, Fv)
                if beta:  # the credit's own terms under that push
                    credit_shift = sum([(kappa * a * e_pos + g * b * e_vel) * w[k] for k, a, b in zip(zone_axes, n, t)])
            if row_credited:
                credited.append((r, n, -nc - radius - self._margin, S_plain, maps, closing0_r, root_r))
            f_now = f + credit_f - self._margin
            f_next = f_now + shift_f + credit_shift
            closing_next = (closing0_r - shift_closing) * root_r
            for a in i_now:
                off[a] = f_now
            for a in i_next:
                off[a] = f_next
            for a in i_closing:
                off[a] = closing_next
        self._input_effect_stale = True

    @property
    def credited_rows(self) -> list[bool]:
        """Per row: did the last `linearize_keepouts` give it the credit?"""
        return self._credited

    @property
    def credited_now(self) -> bool:
        """Did the last `linearize_keepouts` give some row the credit (False: its rows are the uncredited ones)?"""
        return bool(self._last_credited)

    def _sideways(self, steer: tuple, xs: list, n: list, dist: float) -> tuple:
        """A keep-out row's speed past its zone, (q0, lost, t, vn): q0 the sideways speed the credit may count
        on (<= 0: none), less `lost` to pushes over the lag, along unit t; vn the speed along the normal."""
        big_r, k2, _, speed_cols, _, _, w_row, closing0, _ = steer
        ve = [0.0] * len(n)
        for j, i, fac in speed_cols:
            ve[i] += fac * xs[j]
        # Far from the zone (braking from the full speed, any direction, takes under half the gap)
        # the row cannot bind this step: no credit, and none of its per-step work.
        full = math.sqrt(sum(map(mul, ve, ve))) + closing0
        if k2 * full * full <= 0.5 * (dist - big_r):
            return 0.0, 0.0, None, 0.0
        vn = sum(map(mul, n, ve))
        side = [a - vn * b for a, b in zip(ve, n)]
        q = math.sqrt(sum(map(mul, side, side)))
        t = [a / q for a in side] if q > 1e-12 else side
        lost = self._tau * sum(map(mul, map(abs, t), w_row))  # pushes during the lag
        return q - lost, lost, t, vn

    def uncredited(self, P: list) -> list[tuple[int, list, list]]:
        """The rows the last `linearize_keepouts` credited, without the credit, at the predicted states P (the
        2C rows of `CbfShield._prepare`, as lists): per row (row, h at each case's x_L, h at each case's next
        state). The same row (normal, distance, closing speed, its own worst push) as with `steer_now` off,
        evaluated in plain floats for these few rows, not by a second pass over every row."""
        C, out = self._cases, []
        for r, n, f, S, maps, closing0, root in self._last_credited:
            pos, closing, _ = self._dyn_writes[r]
            shift_f = shift_closing = 0.0
            if maps is not None:
                _, shift_f, shift_closing = _push(S, self._w_list, n, maps[1], maps[2])
            w_d, w_s, s0 = [(j, n[i]) for j, i in pos], [(j, coef * n[i]) for j, i, coef in closing], closing0 * root
            h = []
            for k, x in enumerate(P):
                d = sum([w * x[j] for j, w in w_d]) + f
                s = sum([w * x[j] for j, w in w_s]) + s0
                if k >= C:  # the next state: the push over the step
                    d, s = d + shift_f, s - shift_closing * root
                h.append(d - s * s if s > 0.0 else d)
            out.append((r, h[:C], h[C:]))
        return out

    def refresh_input_effect(self) -> None:
        """Recompute the input's effect on the rows (`SMB`) after `linearize_keepouts` moved them (QP paths only)."""
        if self._input_effect_stale:
            np.dot(self._MT.T, self._B, out=self._MB)
            np.multiply(self._scales4, self._MB.reshape(2, 1, self.R, self._m), out=self.SMB)
            self._input_effect_stale = False


def _push(S: list, w_list: list, n: list, Fw: list, Fv: list) -> tuple[list, float, float]:
    """The worst push for a keep-out row with normal n: per axis the bound whose sign lowers the row (S: how
    each axis's push raises it), and what it shifts the distance and the closing speed by (maps Fw, Fv from n)."""
    w = [-wm if s > 0.0 else (wm if s < 0.0 else 0.0) for s, wm in zip(S, w_list)]
    return w, sum([n[i] * v * w[k] for i, k, v in Fw]), sum([n[i] * v * w[k] for i, k, v in Fv])


def _normal(xs: list, pcols: list, center: list) -> tuple[float, list]:
    """Distance of the position in xs (at pcols) from a zone's centre, and the unit normal from the centre."""
    diff = [xs[j] - c for j, c in zip(pcols, center)]
    dist = math.sqrt(sum(map(mul, diff, diff)))
    return dist, ([d / dist for d in diff] if dist > 1e-9 else [1.0] + [0.0] * (len(diff) - 1))


def _along_normal(weights: dict[int, float], directional: bool, bound_of: dict[int, tuple[float, float]]) -> float:
    """The most a per-position bound (toward -, toward +) gives along a row's normal: sum |n_i| b_i, each on the
    side the row brakes toward (as its braking); a keep-out row's normal is any unit vector over its axes, where
    it is |b| (per-axis bounds: the box's farthest corner)."""
    if directional:
        return sum(abs(v) * bound_of[o][v > 0] for o, v in weights.items())
    return math.sqrt(sum(max(bound_of[o]) ** 2 for o in weights))
