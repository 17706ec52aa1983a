"""`LatencyPredictor`: the shield's state through the pending (sent, not yet applied) actions, as one matrix product.

The shield state of each input-gain case ``k`` (scale ``s_k`` on the input's
effect) evolves as ``x+ = A x + s_k B u + c_k`` (``c_k``: the case's affine term,
`LinearModel.offset`; it differs between cases where part of the plant's drift
scales with its gain, e.g. gravity compensation). With ``L`` actions sent but not
yet applied, the state the next action acts on is

    x_L = A^L x + sum_j A^(L-1-j) (s_k B p_j + c_k)        (p_0: the oldest pending action)

and the next state under the new action ``u`` is ``A x_L + s_k B u + c_k``. Both,
and the state predicted at the next call, are affine in one buffer

    v = [x_0, ..., x_(C-1), p_0, ..., p_(L-1), u, 1]

so each is a single matrix-vector product with a matrix built once from the
spec. That replaces a Python loop of small numpy operations per pending action,
which cost far more than the arithmetic at these sizes (4-9 states, 1-3 inputs).
Stdlib + numpy only.
"""

from __future__ import annotations

import numpy as np


class LatencyPredictor:
    """Per-case state buffer and the affine maps over it; `predict()` and `commit(u)` are the hot path."""

    def __init__(
        self,
        A: np.ndarray,
        B: np.ndarray,
        offsets: list[np.ndarray],
        scales: list[float],
        latency_steps: int,
        observed: int,
        internal_inits: list[np.ndarray],
        fallback: np.ndarray,
        latencies: list[int] | None = None,
    ):
        """`offsets` and `internal_inits`: per case (with `scales`), its c_k and internal states after reset.

        `latencies`: per case, the plant's latency l_k <= latency_steps (default: all latency_steps). A plant
        with l_k steps has already applied all but the newest l_k pending actions (their effect is in the
        observed state): its x_L goes through those l_k only, and the action applied this period is p_(L-l_k).
        """
        N, m = B.shape
        C, L = len(scales), latency_steps
        latencies = [L] * C if latencies is None else list(latencies)
        self.cases, self.states, self.inputs, self.latency = C, N, m, L
        self._p0 = C * N  # first pending slot
        self._u0 = C * N + L * m  # the new action's slot
        D = self._u0 + m + 1
        self.v = np.zeros(D)
        self.v[-1] = 1.0
        # K: v -> [x_L of every case, next state under u of every case]; K_next: v -> next call's state.
        K = np.zeros((D, 2 * C * N))
        K_next = np.zeros((D, C * N))
        powers = [np.eye(N)]
        for _ in range(L + 1):
            powers.append(A @ powers[-1])
        self._now_applied = []  # (case state slice, scale) of cases whose plant applies u at once, when L > 0
        for k, (s, c, lk) in enumerate(zip(scales, offsets, latencies)):
            drift = sum((powers[j] @ c for j in range(lk)), np.zeros(N))  # sum_{j<l} A^j c_k
            xs, ls, fs = slice(k * N, (k + 1) * N), slice(k * N, (k + 1) * N), slice((C + k) * N, (C + k + 1) * N)
            K[xs, ls] = powers[lk].T
            K[xs, fs] = powers[lk + 1].T
            for i in range(lk):  # the newest lk pending actions, p_(L-lk+i), oldest first
                j = L - lk + i
                pj = slice(self._p0 + j * m, self._p0 + (j + 1) * m)
                K[pj, ls] = (s * powers[lk - 1 - i] @ B).T
                K[pj, fs] = (s * powers[lk - i] @ B).T
            K[self._u0 : self._u0 + m, fs] = (s * B).T
            K[-1, ls] = drift
            K[-1, fs] = A @ drift + c
            K_next[xs, ls] = A.T
            first = self._p0 + (L - lk) * m  # p_(L-lk), or u itself when lk == 0
            K_next[first : first + m, ls] = (s * B).T
            K_next[-1, ls] = c
            if L and not lk:
                self._now_applied.append((ls, s))
        self.K, self._K_next = K, K_next  # K is public: a caller may compose it with its own linear map
        self._B = B
        self._out = np.empty(2 * C * N)
        self._next_all = np.empty(C * N)  # the next call's state, then any columns `attach_monitor` adds
        self._next = self._next_all
        # Observed entries of every case's state, and the state used before any observation.
        self._obs_slots = np.array([k * N + i for k in range(C) for i in range(observed)], dtype=np.intp)
        self._init = np.concatenate([np.concatenate([np.zeros(observed), z0]) for z0 in internal_inits])
        self._all_observed = observed == N  # no internal states: an observation overwrites every state slot
        self._fallback = np.asarray(fallback, np.float64)
        self.monitor = None  # an AssumptionMonitor fed every committed prediction (set by CbfShield)
        self.reset()

    def reset(self) -> None:
        """Episode start: the pending actions are the fallback, the internal states their initial value."""
        self.v[self._p0 : self._u0] = np.tile(self._fallback, self.latency)
        self.has_state = False  # is there a predicted state for the next call?
        self.committed = False  # has an action been committed since reset (for `resend`)?
        self._next[:] = self._init

    def attach_monitor(self, monitor) -> None:
        """Feed `monitor` (its map `monitor.K` over v) every committed prediction, computed with the next state."""
        self.monitor = monitor
        self._n_state = self._K_next.shape[1]
        self._K_next = np.hstack([self._K_next, monitor.K])
        self._next_all = np.empty(self._K_next.shape[1])
        self._next_all[: self._n_state] = self._next
        self._next = self._next_all[: self._n_state]  # a view: the state part

    def load_observation(self, observed: np.ndarray) -> None:
        """Each case's state: the observed entries, and the internal ones predicted at the last call."""
        if not self._all_observed:
            self.v[: self._p0] = self._next
        self.v[self._obs_slots] = observed

    def load_prediction(self) -> bool:
        """No observation: use the state predicted at the last call; False if there is none."""
        if not self.has_state:
            return False
        self.v[: self._p0] = self._next
        return True

    def load_action(self, u: np.ndarray) -> None:
        """The action whose next state `predict` returns (and that `commit` sends unless told otherwise)."""
        self.v[self._u0 : self._u0 + self.inputs] = u

    def predict(self) -> np.ndarray:
        """(2 cases, states): rows ``0..C-1`` each case's x_L, ``C..2C-1`` its next state under the loaded action."""
        np.dot(self.v, self.K, out=self._out)
        return self._out.reshape(2 * self.cases, self.states)

    def commit(self, u: np.ndarray | None, have_state: bool) -> None:
        """`u` (None: the loaded action) was sent: predict the next call's state (if this one had one), queue `u`."""
        if u is not None:
            self.v[self._u0 : self._u0 + self.inputs] = u
        self.has_state = have_state
        self.committed = True
        if have_state:
            np.dot(self.v, self._K_next, out=self._next_all)  # with the monitor's columns: one product for both
        if self.monitor is not None:  # before the pending actions shift: it predicts under each of them
            if have_state:
                self.monitor.take(self._next_all[self._n_state :])
            else:
                self.monitor.forget()
        if self.latency:
            # Oldest pending action out, u in (numpy copies overlapping slices correctly).
            self.v[self._p0 : self._u0] = self.v[self._p0 + self.inputs : self._u0 + self.inputs]

    def resend(self, u: np.ndarray) -> None:
        """The last committed action was replaced by `u` on the way to the plant: correct the buffers."""
        if not self.committed:
            return
        m = self.inputs
        change = u - self.v[self._u0 : self._u0 + m]
        if self._now_applied and self.has_state:  # cases whose plant applies it at once predicted with the old u
            delta = self._B @ change
            for ls, s in self._now_applied:
                self._next[ls] += s * delta
        if self.monitor is not None and self.has_state:
            # The monitor's velocities were predicted at `commit` with the old u under every latency it allows,
            # those applying it at once included: left so, a shadow plant's legacy action far from the candidate's
            # read as an unmodelled acceleration and flagged a plant inside the envelope (helper-49). Linear in v:
            # corrected by the change alone.
            monitor = self._next_all[self._n_state :]
            monitor += change @ self._K_next[self._u0 : self._u0 + m, self._n_state :]
            self.monitor.take(monitor)
        self.v[self._u0 : self._u0 + m] = u
        if self.latency:
            self.v[self._u0 - m : self._u0] = u  # the newest pending action; the state predicted used the oldest
        elif self.has_state:
            np.dot(self.v, self._K_next, out=self._next_all)  # no latency: the sent action moves the next state
