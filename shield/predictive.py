"""`PredictiveFilter`: a predictive safety filter (model-predictive safety certification with a backup controller).

A per-position braking barrier cannot keep a constraint on a coordinate the actuator does not drive (a crane's
swing): a state it admits may already be lost. This filter asks instead whether, after the candidate action, a
backup controller can hold the plant inside every constraint forever:

1. From the shield state ``v`` (`shield.prediction.LatencyPredictor`'s buffer: the observed state, the actions
   sent but not applied, the candidate ``u`` and a constant), the nominal model gives the state ``x_L`` the
   candidate acts on and the next state ``x_1 = A x_L + B u + c``.
2. The backup stops the plant at the equilibrium nearest the next state: ``u_j = u_hold - K (x_j - x_hold)``
   with ``x_hold = x_op + P (x_1 - x_op)``, ``P`` the projection onto the states the model can hold still and
   ``u_hold = F (x_hold - x_op)`` the action that holds it (a crane hangs at rest anywhere on its rail under
   zero action; a ball rests off centre on a beam under the torque that levels it): it is stopped where it
   is, not driven back to the operating point, which would take far more of the input box. Every predicted
   ``x_j`` (j = 1..horizon) is then affine in ``v``.
3. Every constraint row ``d(x) = w.x + f >= 0`` must hold at every ``x_j`` less the tube ``|w| . tube_j`` (the
   measured bound on how far the plant, under this very loop, strays from the nominal prediction after j steps;
   where the model's error grows with the distance from the operating point, the tube is ``tube_j + tube_slope_j .
   |x_L - x_op| + tube_action_slope_j . |a|``, a the actions in flight (pending, then the candidate u), and never
   below ``tube_floor_j`` (the error from rest): still one product per call for the state and the pending actions
   (and one maximum), and ``cand . |u|`` for the candidate, whose rows stay convex in u (one linear row per sign
   pattern of u where the filter must solve); every backup action must lie
   in the input box (so the prediction, made without saturation, is the backup's); the last state must lie within
   ``terminal_box`` of ``x_hold`` (but for ``free_states``, which move nothing: a wheel's angle), and ``x_hold``
   far enough inside every constraint that the backup's tail from there stays inside (`terminal_reach`: the most any
   row moves over the rest of the backup's run from the edge of that box, followed until it has settled).
4. All of that is ``G u >= lb`` with ``G`` and the part of ``lb`` that does not depend on ``v`` built once: one
   matrix-vector product per call. An action that meets every row passes bitwise unchanged; otherwise the
   filter is ``min ||u - u_p||^2`` over the rows and the box (closed form for one input, the QP otherwise).
5. When no action meets the rows the answer is the backup's own action at ``x_L``, stopping at the last
   accepted plan's ``x_hold``: that plan continues, so the plant stays on a plan that was certified
   (recursive feasibility).
6. Conservative mode, once the assumption monitor has flagged the plant (until the episode's reset: the flag
   itself clears whenever a hard push's wide input-gain hull covers the residual again, and a mode that cleared
   with it let the trolley drift back out), the plant is outside the envelope the tube was measured on:
   - every row tightened by the tube (the constraints at every step, the settled equilibrium's) is tightened by
     ``tube_factor`` times it instead (`widen`: a vector ``(tube_factor - 1) |w| . tube_j`` per row, built once,
     taken off the rows' constants in place). The factor (`shield.monitor.conservative_tube_factor`) is the least
     by which a flagged plant's unmodelled acceleration exceeds the worst the envelope showed: the smallest
     wider tube the flag implies. Where no plan meets the wider rows, point 5 applies;
   - the backup, where it acts, carries the persistent acceleration the monitor measured (its windowed mean
     residual per velocity, `AssumptionMonitor.mean_residual`): in its prediction through the latency, and in
     where it stops the plant (the equilibrium shifted to hold against it: the drive holding a steady force on
     the trolley, the payload tilted under one on it). Without it, a plant outside the envelope under a steady
     force (wind, a slope) was stopped by a backup that believed the trolley slower than it was and held too
     softly: the legacy controller through the filter crossed the rail band three times as often as the
     legacy controller alone (621 against 215 violating steps over 4 crane episodes, a steady push of up to
     60 N on the trolley; with conservative mode 0).

Stdlib + numpy only.
"""

from __future__ import annotations

import copy

import numpy as np

from shield.constraints import LinearRow
from shield.fallback import BoxHalfspaceProjection


class PredictiveFilter:
    """The stacked rows ``G u >= lb(v)`` of a spec's `predictive` section over a `LatencyPredictor`'s buffer."""

    def __init__(
        self, spec, A: np.ndarray, B: np.ndarray, c: np.ndarray, predictor, low, high, tube_factor: float = 1.0
    ):
        section = spec.predictive
        N, m = B.shape
        L, D = spec.latency_steps, len(predictor.v)
        u0, p0 = predictor._u0, predictor._p0
        K = np.asarray(section["backup_gain"], np.float64)
        x_op = np.asarray(section["operating_point"], np.float64)
        P = np.asarray(section["hold_projection"], np.float64)
        F = np.asarray(section.get("hold_action") or np.zeros((m, N)), np.float64)  # the action holding x_hold
        # ... on top of the one that holds the operating point (a hoist's weight; absent: it rests unpowered)
        trim = np.asarray(section.get("hold_trim") or np.zeros(m), np.float64)
        tube = np.asarray(section["tube"], np.float64)  # (horizon, N)
        # (horizon, N, N) or absent: the tube's growth per unit of |x_L - x_op|, where the model's error depends on
        # how far from the operating point the plan starts (`tube_slope`, see point 3 of the module's docstring).
        slope = np.asarray(section.get("tube_slope") or np.zeros((len(tube), N, N)), np.float64)
        # (horizon, N, (L + 1) m) or absent: its growth per unit of |action| of each action in flight, the pending
        # ones (oldest first) and the candidate: an input whose effect the model misjudges (a heavy ball far out on
        # a beam adds to the beam's inertia) misleads the plan in proportion to how hard it pushes.
        act_slope = np.asarray(section.get("tube_action_slope") or np.zeros((len(tube), N, (L + 1) * m)), np.float64)
        # (horizon, N) or absent: the least the tube is per step and state wherever the plan starts (the error
        # measured from rest under the set's pushes and noise): the growing parts above are fitted over the whole
        # envelope and say nothing at rest. Without them it is simply the tube where larger.
        floor = np.asarray(section.get("tube_floor") or np.zeros_like(tube), np.float64)
        if not (np.any(slope) or np.any(act_slope)):
            tube = np.maximum(tube, floor)
        box = np.asarray(section["terminal_box"], np.float64)
        reach = np.asarray(section["terminal_reach"], np.float64)  # per constraint row
        # States nothing else depends on, no limit reads and the backup never acts on (a reaction wheel's angle):
        # the plan need not end near any value of them, so they have no terminal row. Checked below against the
        # model, the gain and the rows, so that no spec can drop a terminal row the plant's safety rests on.
        free = list(section.get("free_states") or [])
        H = int(section["horizon"])
        self.horizon, self.m = H, m
        e_const = np.zeros(D)
        e_const[-1] = 1.0
        C_drift, X_op = np.outer(c, e_const), np.outer(x_op, e_const)

        def slot(i: int) -> np.ndarray:  # the map v -> the action in slot i
            E = np.zeros((m, D))
            E[:, i : i + m] = np.eye(m)
            return E

        def latency_prediction(X: np.ndarray, sent: list) -> np.ndarray:  # what the shield predicts through L
            for S in sent[len(sent) - L :] if L else []:
                X = A @ X + B @ S + C_drift
            return X

        X0 = np.zeros((N, D))
        X0[:, :N] = np.eye(N)
        pending = [slot(p0 + j * m) for j in range(L)]
        self._Phi_L = latency_prediction(X0, pending)
        Phi_1 = A @ self._Phi_L + B @ slot(u0) + C_drift
        X_hold = X_op + P @ (Phi_1 - X_op)  # where the plan stops: the equilibrium nearest x_1
        self._Hold = X_hold
        U_hold = F @ (X_hold - X_op) + np.outer(trim, e_const)  # the map v -> the action that holds the plan's stop
        self._K, self._x_op, self._P, self._F, self._trim = K, x_op, P, F, trim
        # Conservative mode's backup: a measured velocity residual d (per velocity, per step) moves the state by
        # `per_step` d each step (the velocity by d, the position by d dt / 2); over the latency the prediction
        # is off by sum_j A^j per_step d. Held against, the plant rests at a shifted equilibrium: the least
        # (dx, du) with (A - I) dx + B du + per_step d = 0 (offset-free target: a steady force on the trolley
        # is held by the drive, u = -F / gain; one on the payload tilts it by F / (m g) with the trolley held
        # under the rod's pull). The backup then drives to hold + dx with du added: a map from d, built once.
        col_all = {o: j for j, o in enumerate(spec.state_index)}
        per_step = np.zeros((N, len(spec.velocity_index)))
        for q, (p, vel) in enumerate(zip(spec.position_index, spec.velocity_index)):
            per_step[col_all[vel], q], per_step[col_all[p], q] = 1.0, 0.5 * spec.dt
        S, Aj = np.zeros((N, N)), np.eye(N)
        for _ in range(L):
            S, Aj = S + Aj, A @ Aj
        self._residual_drift = S @ per_step  # (N, velocities)
        target = -np.linalg.pinv(np.hstack([A - np.eye(N), B])) @ per_step  # (N + m, velocities): (dx, du) per d
        self._residual_hold = target[N:] + K @ target[:N]  # (m, velocities)
        rows = [r for con in spec.constraint_objects() for r in con.rows()]
        if any(not isinstance(r, LinearRow) for r in rows):
            raise ValueError("shield spec: predictive: every constraint must be a box or a halfspace")
        col = {o: j for j, o in enumerate(spec.state_index)}
        W = np.zeros((len(rows), N))
        f = np.array([r.offset for r in rows], np.float64)
        for i, r in enumerate(rows):
            for o, w in r.weights.items():
                W[i, col[o]] = w
        owner = [k for k, con in enumerate(spec.constraint_objects()) for _ in con.rows()]
        self._owner = np.array(owner, dtype=np.intp)
        lats = [L] if spec.latency_min_steps is None else list(range(spec.latency_min_steps, L + 1))
        # (rows, D) maps and constants: slack = block @ v + offset - tight @ |x_L - x_op| - tight_act @ |actions|
        blocks, offsets, kinds, tight, tight_act = [], [], [], [], []
        tubes = []  # per row, what the constant tube takes off it (0 where none does): for conservative mode
        floors = []  # per row, what the floor takes off it beyond that (see `slack_free`)
        absW = np.abs(W)
        for i in free:
            if np.any(W[:, i]) or np.any(K[:, i]) or not np.allclose(A[:, i], np.eye(N)[i], rtol=0.0, atol=1e-9):
                raise ValueError(
                    f"shield spec: predictive.free_states: state {i} is not free: a limit reads it, the backup acts "
                    f"on it, or the model's other states depend on it"
                )
        boxed = [i for i in range(N) if i not in free]
        self._plans = []  # per latency case: the states' maps, for `plan`
        for lk in lats:
            # The plan as the plant with lk steps lives it: each step it applies what was sent lk steps before
            # (the candidate at step lk); from the next call on the shield sends the backup's action, computed
            # on its own prediction through L steps (what `backup` does), whatever the plant's latency.
            sent, X, states = pending + [slot(u0)], X0, []
            for t in range(lk + H):
                if t >= 1:
                    U = U_hold - K @ (latency_prediction(X, sent) - X_hold)
                    sent.append(U)
                    if t < H:
                        blocks += [-U, U]
                        offsets += [np.asarray(high, np.float64), -np.asarray(low, np.float64)]
                        kinds += [np.full(m, -1), np.full(m, -1)]
                        tight += [np.zeros((m, N)), np.zeros((m, N))]
                        tight_act += [np.zeros((m, (L + 1) * m))] * 2
                        tubes += [np.zeros(m), np.zeros(m)]
                        floors += [np.zeros(m), np.zeros(m)]
                X = A @ X + B @ sent[L + t - lk] + C_drift
                states.append(X)
                if t >= lk:  # after the candidate is applied: the constraints, tightened by the tube
                    blocks.append(W @ X)
                    tubes.append(absW @ tube[t - lk])
                    floors.append(absW @ np.maximum(floor[t - lk] - tube[t - lk], 0.0))
                    offsets.append(f - tubes[-1])
                    kinds.append(self._owner)
                    tight.append(absW @ slope[t - lk])
                    tight_act.append(absW @ act_slope[t - lk])
            self._plans.append(states[lk:])
            dev = (X - X_hold)[boxed]  # how far the last state is from where the backup stops it
            nb = len(boxed)
            blocks += [-dev, dev]
            offsets += [box[boxed], box[boxed]]
            kinds += [np.full(nb, -1), np.full(nb, -1)]
            tight += [np.zeros((nb, N)), np.zeros((nb, N))]
            tight_act += [np.zeros((nb, (L + 1) * m))] * 2
            tubes += [np.zeros(nb), np.zeros(nb)]
            floors += [np.zeros(nb), np.zeros(nb)]
            blocks.append(W @ X_hold)  # where the backup leaves it
            tubes.append(absW @ tube[-1])
            floors.append(absW @ np.maximum(floor[-1] - tube[-1], 0.0))
            offsets.append(f - reach - tubes[-1])
            kinds.append(self._owner)
            tight.append(absW @ slope[-1])
            tight_act.append(absW @ act_slope[-1])
        self.latencies = lats
        # Where a backup with no accepted plan may stop the plant (see `backup`): the rows `where the backup leaves
        # it` above, at their constant tightening (the larger of the tube and its floor at the horizon).
        self._hold_W = W
        self._hold_slack_op = W @ x_op + f - reach - absW @ np.maximum(tube[-1], floor[-1])
        # Constraint rows first, grouped by constraint (stable), so a step's h per constraint is one reduceat over
        # a leading slice; then the backup's action rows and the terminal box.
        kind = np.concatenate(kinds)
        order = np.argsort(np.where(kind >= 0, kind, len(spec.constraints)), kind="stable")
        M = np.vstack(blocks)[order]  # (rows, D)
        offset = np.concatenate(offsets)[order]
        # Conservative mode: each row tightened by tube_factor times its tube instead of once (point 6).
        self.tube_factor = float(tube_factor)
        self._widening = (self.tube_factor - 1.0) * np.concatenate(tubes)[order]
        self._G = np.ascontiguousarray(M[:, u0 : u0 + m])
        M[:, u0 : u0 + m] = 0.0
        M[:, -1] += offset  # the constant slot carries the offsets
        self._MT = np.ascontiguousarray(M.T)  # v @ MT: one product per call
        # How far each row moves per unit of error in the observed state (v's first N entries): while the state is
        # dead-reckoned, the rows are tightened by this times the dead reckoning's error box.
        self._abs_state_MT = np.ascontiguousarray(np.abs(M[:, :N]).T)
        # The tube's parts that grow with the plan's start: rows less z @ tight_T, z = (|x_L - x_op|, |pending
        # actions|), x_L = Phi_L v (None: no such part); and with the candidate: rows less cand @ |u|.
        T = np.hstack([np.vstack(tight), np.vstack(tight_act)])[order]
        Lm = L * m
        # The floor per row, where the growing part is below it. A row on one state is then max(floor, affine) to the
        # letter; a row over several states would need each state's own maximum, and takes the floor's excess on
        # top instead (max(f, a) <= f + a): sound, at the cost of its slack near rest only. The candidate's part
        # comes on top of either (max(f, a + c) <= max(f, a) + c).
        excess = np.concatenate(floors)[order]
        several = np.concatenate([np.full(len(e), False) for e in floors])  # rows of action/terminal: no floor
        is_row = np.concatenate(kinds) >= 0
        if len(W):  # (a spec without constraints has only the backup's rows)
            several[is_row] = np.tile(np.count_nonzero(W, axis=1) > 1, int(is_row.sum()) // len(W))
        several = several[order]
        floored = bool(np.any(excess))
        # (the part a row takes the maximum with, the part it adds), or None without a floor
        self._floor = (np.where(several, 0.0, excess), np.where(several, excess, 0.0)) if floored else None
        grows = np.any(T[:, : N + Lm]) or floored
        self._tight_T = np.ascontiguousarray(T[:, : N + Lm].T) if grows else None
        self._pending = slice(p0, p0 + Lm)
        self._z = np.zeros(N + Lm)
        self._cand = np.ascontiguousarray(T[:, N + Lm :]) if np.any(T[:, N + Lm :]) else None
        self._cand_scale = 1.0  # tube_factor while widened (conservative mode)
        self._abs_Phi_state = np.abs(self._Phi_L[:, :N])  # how far x_L moves per unit of error in the observed state
        self._x_L, self._row_tmp = self._z[:N], np.empty(len(offset))
        self._Rc = int((kind >= 0).sum())
        self._row_start = np.searchsorted(kind[order][: self._Rc], np.arange(len(spec.constraints)))
        self.R = len(offset)
        self._low, self._high = np.asarray(low, np.float64), np.asarray(high, np.float64)
        # With a candidate term, each row is one per sign pattern of u (|u_k| = max(u_k, -u_k)).
        rows_solved = self.R * (2**m if self._cand is not None else 1)
        self._projection = BoxHalfspaceProjection(self._low, self._high, rows_solved) if m > 1 else None
        # Per sign pattern of u, G less cand . sign: for u in that orthant the rows are exactly (this) u + free, one
        # product as without the candidate's term; stacked, they are every row `solve` must keep. Built once per
        # scale of the tube (the measured one here; conservative mode's wider one when it first comes).
        self._orthants: dict[float, tuple] = {}
        if self._cand is not None:
            self._signs = np.array(np.meshgrid(*[[-1.0, 1.0]] * m, indexing="ij")).reshape(m, -1).T  # (2^m, m)
            self._orthant_rows()
        self._free = np.empty(self.R)
        self._rows_at = np.empty(self.R)
        self._split = _split(self._G[:, 0]) if m == 1 else None

    def clone(self) -> PredictiveFilter:
        """A filter for another plant of the same spec: the spec's matrices shared (never written after the
        constructor), buffers of its own. Building one costs milliseconds (the plans over the horizon, per latency);
        a server taking on a new plant pays this instead, about a tenth of it."""
        other = copy.copy(self)
        other._z = np.zeros_like(self._z)
        other._x_L = other._z[: len(self._x_L)]
        other._row_tmp, other._free, other._rows_at = (np.empty(self.R) for _ in range(3))
        other._cand_scale = 1.0
        if self._projection is not None:
            other._projection = self._projection.clone()
        return other

    def slack_free(self, v: np.ndarray) -> np.ndarray:
        """Each row's value without the candidate's part (v's action slot is ignored): row = G u + this >= 0."""
        free = np.dot(v, self._MT, out=self._free)
        self._cand_scale = 1.0
        if self._tight_T is not None:
            x = np.dot(self._Phi_L, v, out=self._x_L)
            np.abs(np.subtract(x, self._x_op, out=x), out=x)
            np.abs(v[self._pending], out=self._z[len(x) :])
            grown = np.dot(self._z, self._tight_T, out=self._row_tmp)
            if self._floor is not None:  # never below the floor (see the constructor)
                np.maximum(grown, self._floor[0], out=grown)
                grown += self._floor[1]
            free -= grown
        return free

    def tighten(self, free: np.ndarray, state_error: np.ndarray) -> np.ndarray:
        """`free` (in place) at the worst state within `state_error` (per state, how far the state the rows start
        from may be off, e.g. after blind steps of dead reckoning) of the one they were computed from."""
        error = state_error[: self._abs_state_MT.shape[0]]
        free -= error @ self._abs_state_MT
        if self._tight_T is not None:  # and the tube's state-dependent part, at the farthest x_L may then be
            free -= (self._abs_Phi_state @ error) @ self._tight_T[: len(self._x_L)]
        return free

    def widen(self, free: np.ndarray) -> np.ndarray:
        """`free` (in place) with every row's tube taken `tube_factor` times instead of once: conservative mode,
        while the plant is outside the envelope the tube was measured on (point 6)."""
        free -= self._widening
        if self._tight_T is not None:  # and its parts that grow (floored), as `slack_free` last took them
            free -= (self.tube_factor - 1.0) * self._row_tmp
        self._cand_scale = self.tube_factor
        return free

    def _orthant_rows(self) -> tuple[np.ndarray, tuple | None]:
        """(2^m, rows, m): per sign pattern of u, G - scale cand . sign (the rows less scale cand . |u| in that
        orthant), at the tube's present scale; and for one input their `_split`. Built once per scale."""
        got = self._orthants.get(self._cand_scale)
        if got is None:
            assert self._cand is not None
            rows = self._G[None] - self._cand_scale * self._cand[None] * self._signs[:, None, :]
            split = None
            if self.m == 1:  # indices into `free` itself (row i of every orthant reads free[i]): no tiling per call
                up, inv_up, down, inv_down, flat = _split(rows[:, :, 0].reshape(-1))
                split = (up % self.R, inv_up, down % self.R, inv_down, flat % self.R)
            got = (rows, split)
            self._orthants[self._cand_scale] = got
        return got

    def evaluate(self, free: np.ndarray, u: np.ndarray) -> tuple[bool, np.ndarray]:
        """(does `u` meet every row: the constraints over the horizon less the tube, the backup's actions in the
        box, the terminal set; per constraint, its smallest tightened slack under `u`, >= 0 where it is kept)."""
        G = self._G
        if self._cand is not None:  # u's own orthant: the candidate's term is linear there
            G = self._orthant_rows()[0][sum(1 << (self.m - 1 - k) for k, a in enumerate(u.tolist()) if a >= 0.0)]
        s = np.add(np.dot(G, u), free, out=self._rows_at)
        return float(s.min()) >= 0.0, np.minimum.reduceat(s[: self._Rc], self._row_start)

    def solve(self, free: np.ndarray, u_p: np.ndarray) -> np.ndarray | None:
        """argmin ||u - u_p||^2 over the rows and the box; None when no input in the box meets them."""
        G, split = self._G, self._split
        if self._cand is not None:  # rows less cand |u|: one linear row per sign pattern of u, all kept
            rows, split = self._orthant_rows()
            if split is None:  # more inputs: every orthant's rows, each reading its own copy of free
                G, free = rows.reshape(-1, self.m), np.tile(free, len(self._signs))
        if split is not None:  # one input: an interval, then a clip
            return _interval(split, free, float(self._low[0]), float(self._high[0]), float(u_p[0]))
        assert self._projection is not None
        return self._projection.solve(G, -free, np.minimum(np.maximum(u_p, self._low), self._high))

    def plan(self, v: np.ndarray) -> np.ndarray:
        """(latency cases, horizon, states): the nominal plan's states after the candidate, from `v` (tube aside)."""
        return np.array([[X @ v for X in p] for p in self._plans])

    def start(self, v: np.ndarray) -> np.ndarray:
        """x_L: the state the candidate acts on, as the shield predicts it from `v`."""
        return self._Phi_L @ v

    def hold_point(self, v: np.ndarray) -> np.ndarray:
        """Where the plan for the loaded action stops the plant: the equilibrium nearest the next state."""
        return self._Hold @ v

    def backup(self, v: np.ndarray, hold: np.ndarray | None, residual: np.ndarray | None = None) -> np.ndarray:
        """The backup's action at x_L, stopping the plant at `hold` (the last accepted plan's; None: where it is),
        clipped to the box. `residual` (conservative mode, point 6): the monitor's mean velocity residual per step,
        carried through the latency prediction and held against."""
        x = self._Phi_L @ v
        if residual is not None:
            x += self._residual_drift @ residual
        if hold is None:
            hold = self._admitted_hold(self._P @ (x - self._x_op))
        u = self._trim + self._F @ (hold - self._x_op) - self._K @ (x - hold)
        if residual is not None:
            u += self._residual_hold @ residual
        return np.minimum(np.maximum(u, self._low), self._high)

    def _admitted_hold(self, d: np.ndarray) -> np.ndarray:
        """Where a backup with no plan accepted (an episode that starts outside the states the filter admits) stops
        the plant: the equilibrium nearest it, x_op + d, where a plan's stop may lie (the rows it must meet), else
        the operating point. Stopping the plant wherever it is would follow its drift, each step's stop a little
        further out: two carts on a spring, held apart against it by a backup whose hold force is off by the
        stiffness error, creep through their separation limit, a limit the legacy controller alone keeps. Stopped
        at the nearest admitted stop, the same error settles them just outside it, and the filter never takes
        over. The operating point is where the tube was measured from rest: pulled toward it, the plant comes
        into the states the filter admits, and the filter takes over."""
        if float((self._hold_W @ d + self._hold_slack_op).min(initial=0.0)) >= 0.0:
            return self._x_op + d
        return self._x_op.copy()


def _split(g: np.ndarray) -> tuple[np.ndarray, ...]:
    """Rows g u + free >= 0 of one input by how they bound it: (from below, -1/g there, from above, -1/g there,
    rows it does not move)."""
    up, down = np.flatnonzero(g > 1e-12), np.flatnonzero(g < -1e-12)
    return up, -1.0 / g[up], down, -1.0 / g[down], np.flatnonzero(np.abs(g) <= 1e-12)


def _interval(split: tuple, free: np.ndarray, lo: float, hi: float, u_p: float) -> np.ndarray | None:
    """argmin |u - u_p| over the rows (`_split` of their g) and lo <= u <= hi, for one input; None when empty."""
    up, inv_up, down, inv_down, flat = split
    if len(up):
        lo = max(lo, float((free[up] * inv_up).max()))
    if len(down):
        hi = min(hi, float((free[down] * inv_down).min()))
    if lo > hi or (len(flat) and float(free[flat].min()) < 0.0):
        return None
    return np.array([min(max(u_p, lo), hi)])
