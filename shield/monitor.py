"""`AssumptionMonitor`: does the plant still behave as the shield's assumptions say? One per `CbfShield` (per plant).

Each call the shield predicts the next observed velocities from the observed
state, for every input-gain case and every action that may be applied next
(the pending ones and the new one: any latency from 0 to the spec's). At the
next call the observed velocity is compared with that prediction:

    e_t = v_obs - centre of the predicted hull,  a_t = half-width of the hull + allowed_accel(v) * dt

where ``allowed_accel = accel + accel_per_speed * |v|`` per position (the
spec's ``assumptions.monitor``: disturbances, pushes, model error that grows
with speed such as a damping range). A single step says little under sensor
noise, so the statistic is windowed: over the last W steps,

    flag  <=>  |sum e_t| > sum a_t + z * sigma_t + J (1 - t / W)

for some velocity, where t <= W is the steps in the window so far and sigma_t the standard deviation of
the sum of t residuals under the declared observation noise (``assumptions.obs_noise_std``;
for an integrator the noise telescopes, so sigma_t hardly grows with t while a
persistent model error grows linearly). z = 5: about one false flag per 10^6
windows per velocity under Gaussian noise. J (``monitor.push_impulse``, units/s) is the speed one
declared push gives. A full window spreads it over W steps, which the measured ``accel`` covers; a
window still filling (an episode's first steps) holds it over fewer, and there it is allowed in
proportion to what the window lacks. Without it a declared 5 N push in the first steps of an
episode flagged a mast on a cart, and the predictive filter's latched conservative mode parked the
plant for the rest of the episode.

What it sees: a steady unmodelled acceleration ``a`` on a velocity is flagged once ``a`` exceeds ``accel`` plus
the hull's mean half-width over the window (the noise term shrinks as ``z sigma_t / (t dt)``). The hull counts
as explained whatever the input-gain error could make of the action applied, so a controller that holds an
action against a steady force (a crane's drive against a force on its payload) widens what is explained by
``input_gain_error |B u|``. Stated and tested (`tests/shield/test_shield_monitor.py`, measured bounds, the
legacy controller through the shield): a steady force on the payload of the crane or the Furuta pendulum whose
acceleration reaches 6 times ``accel`` on some velocity is flagged within 20 steps and before the first
violation; inside the envelope (the shield's own model at the envelope's edges, pushed by the largest
acceleration the envelope showed) no flag in 50,000 steps per task. The window's sums are running sums
(the newest term added, the oldest taken off); a term far beyond any plant's (a
sensor glitch of 1e20, or a non-finite prediction, clamped to +-1e30) would
leave its rounding in them, so once such a term has left the window the sums
are taken again from the rows, exactly (`math.fsum`), and only then: no step
pays for re-summing in normal running.

A second test sees what the first cannot: an error whose sign changes with the actions (a plant answering
actions later than the spec's latency, a heavier body ringing on its spring) cancels in the signed sum, and an
action swinging between the box's ends spans the whole hull over every latency. The plant has one latency, so
there each latency the spec allows is a hypothesis of its own, and the velocity's distance outside what the
gain cases predicted with it only adds up over the window; the flag is raised when every latency leaves more
than the envelope's plants ever did (``monitor.dist_accel``, measured; see `_outside_every_latency`). Stated
and tested (`tests/shield/test_shield_monitor.py`): a ball on a beam answering 2 steps later than the spec's
longest latency, driven by random or bang-bang actions, is flagged within 20 steps (the first test alone:
never in 200), and the same silence test inside the envelope covers both tests.

While flagged the shield runs in its conservative mode (see `shield.cbf`):
every constraint's class-K gain is divided by CONSERVATIVE_GAIN_DIVISOR, so the
plant approaches boundaries that much more slowly, and `info["envelope"]` is
True. Where the predictive filter keeps the constraints (`shield.predictive`)
there is no gain to divide: once the first test flags (until the episode's reset) its rows
are tightened by the measured tube times `conservative_tube_factor(spec)`
instead of once, and its backup holds against the window's mean residual
(`mean_residual`); see `shield.predictive`, point 6. Where the widened rows leave no plan, the plain ones
still decide (`shield.cbf`): a flag on a plant inside the envelope keeps their certificate. The second test's flag alone
leaves the filter as it is: on that ball on a beam 4 steps late the widened tube left
no plan to accept and the fallback let 46-137 violating steps through in 6
episodes, where the filter as it was kept 0. The flag clears once the
windowed statistic is back within bounds, and the barrier's conservative mode
with it. Latched there instead (until reset), a cart-pole under a steady push on
its cart (15 and 22 N, 16 episodes) gave the adversary 4 and 7 violating steps,
all at full braking at the rail's end, against 0 following the flag (the legacy
controller 0 either way): the two paths keep their own rules.
A spec without ``assumptions.obs_noise_std`` (bundles from before the monitor)
disables it: `envelope` then stays False. Stdlib + numpy only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

WINDOW = 25  # steps
_GLITCH = 1e6  # units/s: a residual term beyond this (no plant's) is a glitch; the sums are re-taken once it leaves
_BIG = 1e30  # and it is clamped to this, so the sums stay finite (a NaN term counts as this far off)
Z = 5.0  # standard deviations of the windowed noise before a flag
CONSERVATIVE_GAIN_DIVISOR = 4.0


def conservative_tube_factor(spec) -> float:
    """By how much the predictive filter's tube is widened once the monitor has flagged the plant (conservative mode).

    The tube was measured on the plants inside the envelope. With measured bounds (``monitor.measured``, see
    `pipeline.evaluation.monitor_bounds`) the monitor flags a plant once its unmodelled acceleration exceeds
    ``accel`` = the largest the envelope showed (``excess_accel``) plus a stated margin: a flagged plant strays
    from the model at least ``accel / excess_accel`` times as far as any plant in the envelope, and the tube (the
    plant's distance from the nominal plan) grows with that. The factor is that ratio, the largest over the
    velocities: the smallest widening the flag implies, so the filter still admits the plans a wider tube leaves
    room for instead of none. Without a measurement the monitor's bound was written down, far above the
    envelope's, and says nothing of the ratio: the barrier's CONSERVATIVE_GAIN_DIVISOR is taken."""
    mon = (spec.assumptions or {}).get("monitor") or {}
    accel, excess = mon.get("accel"), (mon.get("measured") or {}).get("excess_accel")
    if not accel or not excess or len(accel) != len(excess):
        return CONSERVATIVE_GAIN_DIVISOR
    ratios = [float(a) / float(e) for a, e in zip(accel, excess) if float(e) > 0.0 and float(a) > float(e)]
    return max(ratios, default=CONSERVATIVE_GAIN_DIVISOR)


class AssumptionMonitor:
    """Windowed residual test of observed transitions against the shield's model (see the module docstring)."""

    def __init__(
        self,
        spec,
        A: np.ndarray,
        B: np.ndarray,
        offsets: list[np.ndarray],
        scales: list[float],
        latency: int,
        v_size: int,
        window: int = WINDOW,
        z: float = Z,
    ):
        a = spec.assumptions or {}
        noise: Any = a.get("obs_noise_std")
        mon = a.get("monitor") or {}
        self.enabled = isinstance(noise, list) and len(noise) == spec.obs_dim
        self.flagged = False
        self.drifting = False  # the first test's part of the flag: a persistent acceleration (see `observe`)
        if not self.enabled:
            return
        window = int(mon.get("window", window))
        N, m = B.shape
        n = len(spec.state_index)
        C, L = len(scales), latency
        col = {o: j for j, o in enumerate(spec.state_index)}
        vel = [col[v] for v in spec.velocity_index]
        k = len(vel)
        self._k, self._cand, self._cases = k, L + 1, C
        accel = [float(x) for x in mon.get("accel", [0.0] * k)]
        per_speed = [float(x) for x in mon.get("accel_per_speed", [0.0] * k)]
        # Per velocity: (obs index, allowed accel * dt, allowed accel per speed * dt), for the hot path.
        self._per_velocity = [(o, a * spec.dt, b * spec.dt) for o, a, b in zip(spec.velocity_index, accel, per_speed)]
        # v layout (shield.prediction): [x per case (N each), pending p_0..p_{L-1} (m each), u (m), 1].
        # Kmon: v -> predicted next velocity per (case, applied action, velocity).
        K = np.zeros((v_size, C * self._cand * k))
        p0 = C * N
        for ci, (s, c) in enumerate(zip(scales, offsets)):  # c: the case's affine term
            for j in range(self._cand):
                slot = p0 + j * m  # j == L is the new action's slot (right after the pending ones)
                for q, r in enumerate(vel):
                    out = (ci * self._cand + j) * k + q
                    K[ci * N : (ci + 1) * N, out] = A[r]
                    K[slot : slot + m, out] = s * B[r]
                    K[-1, out] = c[r]
        self.K = K  # v -> predicted velocities; the predictor computes it with its next state
        # Standard deviation of a sum of t residuals (t = 1..window) of each velocity under obs noise.
        sig = np.array([float(noise[o]) for o in spec.state_index])
        Aobs = A[:, :n]
        # One declared push's speed (`push_impulse`), allowed in every window on top of the noise: see `observe`.
        impulse = [float(x) for x in (mon.get("push_impulse") or [0.0] * k)]
        self._sigma = []
        for t in range(1, window + 1):
            row = []
            for q, r in enumerate(vel):
                first = sig[r] ** 2 + float(np.sum((Aobs[r] * sig) ** 2))
                middle = float(np.sum(((np.eye(n)[r] - Aobs[r]) * sig) ** 2))
                row.append(z * math.sqrt(first + (t - 1) * middle) + impulse[q] * (1.0 - t / window))
            self._sigma.append(row)
        self._window = window
        # The second test (see `observe`): per applied-latency hypothesis, the velocity's distance outside what the
        # input-gain cases span. Off without a measured bound (`dist_accel`, bundles from before it).
        one = [math.sqrt(sig[r] ** 2 + float(np.sum((Aobs[r] * sig) ** 2))) for r in vel]
        self._dist_noise = [
            [dist_noise(s1, t, z) + j * (1.0 - t / window) for s1, j in zip(one, impulse)] for t in range(1, window + 1)
        ]
        dist = mon.get("dist_accel")
        self._dist = None
        if isinstance(dist, list) and len(dist) == k:
            self._dist = [(o, float(d) * spec.dt, b * spec.dt) for o, d, b in zip(spec.velocity_index, dist, per_speed)]
        self.reset()

    def reset(self) -> None:
        """Episode start: forget the window and the prediction; the flag clears."""
        if not self.enabled:
            return
        self._pred: tuple[list, list, list, list] | None = None
        self._e = [[0.0] * self._k for _ in range(self._window)]
        self._a = [[0.0] * self._k for _ in range(self._window)]
        self._se = [0.0] * self._k
        self._sa = [0.0] * self._k
        self._resum_in = 0  # calls until a glitch's term has left the window (0: none in it)
        self._count = 0
        self._slot = 0
        self.flagged = self.drifting = False
        if self._dist is not None:  # per velocity, per latency hypothesis: the window's rows and running sums
            self._d = [[[0.0] * self._cand for _ in range(self._k)] for _ in range(self._window)]
            self._sd = [[0.0] * self._cand for _ in range(self._k)]
            self._sv = [0.0] * self._k  # the window's sum of |v| per velocity (the speed term)
            self._v = [[0.0] * self._k for _ in range(self._window)]

    def take(self, predicted: np.ndarray) -> None:
        """Store the next velocities predicted per (case, applied action, velocity), `v @ self.K`, as the tests read
        them: per velocity the hull's ends over every case and latency, and per latency and velocity over the gain
        cases (a NaN anywhere reads as NaN there, and is flagged)."""
        P = predicted.reshape(self._cases, self._cand, self._k)
        lo, hi = P.min(axis=0), P.max(axis=0)
        self._pred = (lo.min(axis=0).tolist(), hi.max(axis=0).tolist(), lo.tolist(), hi.tolist())

    def forget(self) -> None:
        """No prediction for the next call (no state was observed)."""
        if self.enabled:
            self._pred = None

    def residuals(self, obs: list[float]) -> list[tuple[float, float]] | None:
        """Per velocity, (observed - centre of the predicted hull, the hull's half-width) against the last prediction
        (units/s), as `observe` would take them; None without one. No state change: for measuring the bounds."""
        if not self.enabled or self._pred is None:
            return None
        los, his = self._pred[0], self._pred[1]
        return [(obs[o] - 0.5 * (lo + hi), 0.5 * (hi - lo)) for (o, _, _), lo, hi in zip(self._per_velocity, los, his)]

    def distances(self, obs: list[float]) -> list[list[float]] | None:
        """Per velocity, per latency the spec allows, how far the observed velocity lies outside what the gain cases
        predicted with that latency (units/s), as the second test takes them; None without a prediction."""
        if not self.enabled or self._pred is None:
            return None
        lo, hi = self._pred[2], self._pred[3]
        return [
            [max(lo[j][q] - obs[o], obs[o] - hi[j][q], 0.0) for j in range(self._cand)]
            for q, (o, _, _) in enumerate(self._per_velocity)
        ]

    def mean_residual(self) -> np.ndarray | None:
        """Per velocity, the window's mean residual (observed velocity - the model's, units/s per step): the
        persistent acceleration x dt the model leaves out, which a flag says is beyond the envelope's; None before
        any step was compared."""
        if not self.enabled or not self._count:
            return None
        return np.array(self._se) / self._count

    def observe(self, obs: list[float]) -> bool:
        """Compare the observed velocities with the last prediction; returns the flag."""
        if not self.enabled or self._pred is None:
            return self.flagged
        k, (los, his) = self._k, self._pred[:2]
        slot = self._slot
        e_row, a_row = self._e[slot], self._a[slot]  # the oldest entries, overwritten in place
        se, sa = self._se, self._sa
        self._count = count = min(self._count + 1, self._window)
        sigma = self._sigma[count - 1]
        flagged = glitch = False
        for q, (o, accel_dt, per_speed_dt) in enumerate(self._per_velocity):
            lo, hi = los[q], his[q]
            v = obs[o]
            e = v - 0.5 * (lo + hi)
            a = 0.5 * (hi - lo) + accel_dt + per_speed_dt * abs(v)
            if not (-_GLITCH < e < _GLITCH and a < _GLITCH):
                glitch = True
                if not (-_BIG < e < _BIG and a < _BIG):  # non-finite, or too big to sum: clamped (NaN: flags)
                    e = math.copysign(_BIG, e) if -math.inf <= e <= math.inf else _BIG
                    a = a if a < _BIG else (_BIG if a == a else 0.0)
            sum_e = se[q] + e - e_row[q]
            sum_a = sa[q] + a - a_row[q]
            se[q], sa[q], e_row[q], a_row[q] = sum_e, sum_a, e, a
            if abs(sum_e) > sum_a + sigma[q]:
                flagged = True
        self.drifting = flagged
        if self._dist is not None and self._outside_every_latency(self._dist, obs, slot, count):
            flagged = True
        self._slot = slot + 1 if slot + 1 < self._window else 0
        if glitch:
            self._resum_in = self._window
        elif self._resum_in:
            self._resum_in -= 1
            if not self._resum_in:  # the last glitch's row was overwritten just now: take the sums again
                for q in range(k):
                    se[q] = math.fsum(row[q] for row in self._e)
                    sa[q] = math.fsum(row[q] for row in self._a)
                    if self._dist is not None:
                        self._sv[q] = math.fsum(row[q] for row in self._v)
                        self._sd[q] = [math.fsum(row[q][j] for row in self._d) for j in range(self._cand)]
        self.flagged = flagged
        return flagged

    def _outside_every_latency(self, bounds: list[tuple], obs: list[float], slot: int, count: int) -> bool:
        """The second test: for some velocity, every latency the spec allows leaves the window's observations
        farther outside the input-gain cases' span than the envelope's plants ever were.

        The first test sums signed residuals against the hull over every latency at once. An error whose sign
        alternates cancels there, and an action that swings between the box's ends spans the whole hull whatever
        it was applied with: a plant answering actions older than the spec's latency, or ringing at another
        frequency (a heavier link on its spring), crossed its limits unflagged. The plant has one latency, so here
        each is a hypothesis of its own, and distances outside its span only add up:

            flag  <=>  min_j sum_t d_jt > sum_t (dist_accel + per_speed |v_t|) dt + noise_t

        d_jt = how far the observed velocity lies outside [min, max] over the gain cases of what latency j
        predicted; noise_t bounds the sum of t noise terms' sizes (`dist_noise`); `dist_accel` is measured over
        the envelope's plants (`pipeline.evaluation.monitor_bounds`)."""
        lo_j: list[list[float]] = self._pred[2] if self._pred is not None else []  # observe calls this with one
        hi_j: list[list[float]] = self._pred[3] if self._pred is not None else []
        cand = self._cand
        d_row, v_row, sd, sv = self._d[slot], self._v[slot], self._sd, self._sv
        noise = self._dist_noise[count - 1]
        out = False
        for q, (o, dist_dt, per_speed_dt) in enumerate(bounds):
            v = obs[o]
            if not -_GLITCH < v < _GLITCH:  # a glitch: the first test flags it and the sums are re-taken later
                v = math.copysign(_GLITCH, v) if v == v else _GLITCH
            speed = abs(v)
            sv[q] += speed - v_row[q]
            v_row[q] = speed
            allowed = count * dist_dt + per_speed_dt * sv[q] + noise[q]
            row, sums, best = d_row[q], sd[q], math.inf
            for j in range(cand):
                lo, hi = lo_j[j][q], hi_j[j][q]
                d = lo - v if v < lo else (v - hi if v > hi else 0.0)
                if not d < _BIG:
                    d = _BIG
                total = sums[j] + d - row[j]
                sums[j], row[j] = total, d
                best = min(best, total)
            if best > allowed:
                out = True
        return out


def dist_noise(sigma1: float, t: int, z: float = Z) -> float:
    """A bound on the sum of t residuals' sizes under observation noise alone: each is a Gaussian of standard
    deviation sigma1 (the step's noise), so its size has mean sigma1 sqrt(2/pi); neighbours share a reading, so
    the spread is taken as that of 2t independent ones (z of them)."""
    return t * sigma1 * math.sqrt(2.0 / math.pi) + z * sigma1 * math.sqrt(2.0 * t)
