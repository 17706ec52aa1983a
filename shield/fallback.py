"""The shield's two small optimizations: the minimal-change projection (QP) and the braking fallback.

Both work on linear conditions ``G u >= lb`` over the input ``u`` inside the
box ``low <= u <= high``; `shield.cbf` builds ``G`` and ``lb`` from the
barrier functions. Stdlib + numpy + daqp only.
"""

from __future__ import annotations

import daqp
import numpy as np

_INF = 1e30


class BoxHalfspaceProjection:
    """argmin ||u - u_p||^2 s.t. G u >= lb, low <= u <= high, with buffers allocated once."""

    def __init__(self, low: np.ndarray, high: np.ndarray, max_rows: int):
        self.low, self.high = np.asarray(low, np.float64), np.asarray(high, np.float64)
        self._low_list, self._high_list = self.low.tolist(), self.high.tolist()  # 1-3 inputs: floats beat arrays
        m = len(self.low)
        self._m = m
        self._H = np.eye(m)
        self._sense = np.zeros(m + max_rows, dtype=np.int32)
        self._upper = np.concatenate([self.high, np.full(max_rows, _INF)])
        self._lower = np.concatenate([self.low, np.zeros(max_rows)])

    def clone(self) -> BoxHalfspaceProjection:
        """The same projection with buffers of its own (for another plant's shield)."""
        return BoxHalfspaceProjection(self.low, self.high, len(self._sense) - self._m)

    def in_box(self, u: np.ndarray) -> bool:
        """low <= u <= high (pass it to `solve` when solving for one u_p several times)."""
        return all(lo <= x <= hi for x, lo, hi in zip(u.tolist(), self._low_list, self._high_list))

    def solve(
        self, G: np.ndarray, lb: np.ndarray, u_p: np.ndarray, u_p_in_box: bool | None = None
    ) -> np.ndarray | None:
        """The projection of u_p, or None when no input in the box meets every row."""
        if self.in_box(u_p) if u_p_in_box is None else u_p_in_box:
            viol = lb - G @ u_p
            worst = int(viol.argmax())
            v_worst = float(viol[worst])
            if v_worst <= 0.0:
                return u_p.copy()
            if np.count_nonzero(viol > 0.0) == 1:
                g = G[worst]
                gg = float(g @ g)
                if gg > 1e-12:
                    u = u_p + (v_worst / gg) * g
                    # Only when KKT holds (one active row with a positive multiplier, the box and
                    # every other row inactive) is this closed form the QP optimum.
                    if all(lo < x < hi for x, lo, hi in zip(u.tolist(), self._low_list, self._high_list)):
                        slack = G @ u - lb
                        slack[worst] = 0.0  # the active row: met by construction, up to rounding
                        if float(slack.min()) >= 0.0:
                            return u
        n = self._m + len(lb)
        self._lower[self._m : n] = lb
        if n == len(self._lower):  # the usual case: every row, no slicing
            upper, lower, sense = self._upper, self._lower, self._sense
        else:
            upper, lower, sense = self._upper[:n], self._lower[:n], self._sense[:n]
        x, _, exitflag, _ = daqp.solve(self._H, -u_p, np.ascontiguousarray(G), upper, lower, sense, primal_tol=1e-10)
        if exitflag < 1:
            return None
        return np.minimum(np.maximum(x, self.low, out=x), self.high, out=x)  # np.clip costs more


def _smallest(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """The input in the box closest to 0: the answer when no row can bind."""
    return np.minimum(np.maximum(0.0, low), high)


def _binding(G: np.ndarray, lb: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Per row of G u >= lb: can some input in the box violate it (its lowest value over the box is below lb)?"""
    return np.minimum(G * low, G * high).sum(axis=1) < lb


def least_violation_brake(
    G: np.ndarray, lb: np.ndarray, low: np.ndarray, high: np.ndarray, constant: np.ndarray
) -> np.ndarray:
    """The input in the box that minimizes the summed squared (normalized) shortfalls of G u >= lb.

    min sum_r s_r^2 s.t. G_r u + |G_r| s_r >= lb_r, s >= 0, u in the box: each
    violated condition pulls the input toward braking away from its constraint,
    so near one constraint this is maximal braking away from it and in a corner
    it brakes away from all of them at once (a max-min LP would leave the inputs
    that do not touch the single worst row idle). Rows the input cannot move are
    left out, and so are rows no input in the box can violate (no shortfall whatever
    the input: they never bind, and leaving them out shrinks the QP); if every row
    is such, the answer is the smallest input in the box. If no row is left that the
    input moves (or the solve fails) each input goes to the box end that best raises
    the row furthest from satisfiable, or to `constant`.
    """
    m = len(low)
    binding = _binding(G, lb, low, high)
    if not binding.any():
        return _smallest(low, high)
    if not binding.all():
        G, lb = G[binding], lb[binding]
    norms = np.sqrt(np.einsum("ij,ij->i", G, G))
    live = norms > 1e-9
    rows = int(live.sum())
    if rows:
        A = np.hstack([G[live], np.diag(norms[live])])
        H = np.diag(np.concatenate([np.full(m, 1e-6), np.ones(rows)]))  # tiny weight on u: unique
        f = np.zeros(m + rows)
        upper = np.concatenate([high, np.full(rows, _INF), np.full(rows, _INF)])
        lower = np.concatenate([low, np.zeros(rows), lb[live]])
        x, _, exitflag, _ = daqp.solve(
            H, f, np.ascontiguousarray(A), upper, lower, np.zeros(len(upper), dtype=np.int32)
        )
        if exitflag >= 1:
            return np.clip(x[:m], low, high)
    best = np.where(G > 0, G * high, G * low).sum(axis=1)
    g = G[int(np.argmax(lb - best))]
    return np.where(g > 0, high, np.where(g < 0, low, constant))


class LeastViolationBrake:
    """`least_violation_brake` for a fixed number of rows and box, with the QP's buffers allocated once."""

    def __init__(self, low: np.ndarray, high: np.ndarray, constant: np.ndarray, rows: int):
        self.low, self.high = np.asarray(low, np.float64), np.asarray(high, np.float64)
        self.constant = np.asarray(constant, np.float64)
        m = self._m = len(self.low)
        self._rows = rows
        self._A = np.zeros((rows, m + rows))  # [G | diag(|G_r|)]
        self._diag = (np.arange(rows), m + np.arange(rows))
        self._H = np.diag(np.concatenate([np.full(m, 1e-6), np.ones(rows)]))
        self._f = np.zeros(m + rows)
        self._upper = np.concatenate([self.high, np.full(2 * rows, _INF)])
        self._lower = np.concatenate([self.low, np.zeros(2 * rows)])
        self._sense = np.zeros(m + 2 * rows, dtype=np.int32)

    def __call__(
        self,
        G: np.ndarray,
        lb: np.ndarray,
        low: np.ndarray | None = None,
        high: np.ndarray | None = None,
        constant: np.ndarray | None = None,
    ) -> np.ndarray:
        """The braking input for the conditions G u >= lb (see `least_violation_brake`); `low`, `high` and
        `constant` replace the box and the constant for this call (inputs the caller has already fixed)."""
        if low is None or high is None or constant is None:
            low, high, constant = self.low, self.high, self.constant
        elif not _binding(G, lb, low, high).any():
            return _smallest(low, high)  # no input in the box violates a row
        norms = np.sqrt(np.einsum("ij,ij->i", G, G))
        if len(lb) != self._rows or not float(norms.min()) > 1e-9:  # a row the input cannot move: general form
            return least_violation_brake(G, lb, low, high, constant)
        m = self._m
        self._A[:, :m] = G
        self._A[self._diag] = norms
        self._upper[:m], self._lower[:m] = high, low
        self._lower[m + self._rows :] = lb
        x, _, exitflag, _ = daqp.solve(self._H, self._f, self._A, self._upper, self._lower, self._sense)
        if exitflag >= 1:
            return np.minimum(np.maximum(x[:m], low), high)  # np.clip costs more
        return least_violation_brake(G, lb, low, high, constant)  # its box-end rule
