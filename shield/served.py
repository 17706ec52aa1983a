"""What the serving loop holds besides sockets: its counters, and the hot path's view of one loaded runtime.

`ServedBundle` is computed once per runtime (at load, or in the reload thread) so
that the hot path reads plain attributes: dimensions, the fallback action's bytes,
the action box, the shadow log's meta, and a few plant sessions built ahead.
Stdlib + numpy only.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from shield.contract import estimate_names, observation_wraps
from shield.protocol import (
    ACT_REQUEST_HEAD,
    COUNTER_NAMES,
    HEADER_SIZE,
    LATENCY_BINS,
    OBS_RANGE_WIDTHS,
    contract_payload,
)

PLANT_LIVE_S = 1.0  # a plant heard from within this (plus its latency) is never evicted for a new one
SPARE_SESSIONS = 4  # plant sessions built ahead (at load, and when idle), so a new plant's first reply is not late


class ServeStats:
    """Counters (names as in protocol.COUNTER_NAMES) and a log2 latency histogram (µs) of act replies."""

    # One attribute per protocol counter, in COUNTER_NAMES order (tests/shield/test_protocol_frames.py holds them
    # equal).
    requests: int
    answered: int
    dropped: int
    policy_calls: int
    interventions: int
    fallbacks: int
    bad_inputs: int
    auth_failures: int
    stale: int
    deadline_misses: int
    inference_errors: int
    reloads: int
    status_requests: int
    envelope_flags: int
    plants_evicted: int
    plants_refused: int
    state_resets_new_plant: int
    state_resets_requested: int
    state_resets_silence: int
    contract_requests: int
    obs_out_of_range: int
    rate_warnings: int
    blind_steps: int
    blind_past_horizon: int
    estimate_requests: int
    backups: int

    def __init__(self):
        for name in COUNTER_NAMES:
            setattr(self, name, 0)
        self.histogram = [0] * LATENCY_BINS
        self.latency_sum_us = 0  # of act replies (for the Prometheus histogram's _sum)
        self.started = time.monotonic()

    def as_dict(self) -> dict[str, int]:
        """Counters by name."""
        return {name: getattr(self, name) for name in COUNTER_NAMES}

    def latency_percentile_us(self, q: float) -> float:
        """Upper edge (µs) of the histogram bin holding quantile q in [0, 1]."""
        total = sum(self.histogram)
        if total == 0:
            return float("nan")
        acc = 0
        for i, count in enumerate(self.histogram):
            acc += count
            if acc >= q * total:
                return float(2**i)
        return float("inf")

    def summary(self) -> str:
        """One line for the log: non-zero counters and latency bins."""
        counters = " ".join(f"{k}={v}" for k, v in self.as_dict().items() if v)
        if not sum(self.histogram):  # nothing was answered: there is no latency to quote
            return f"stats: {counters or 'no requests'}"
        return (
            f"stats: {counters or 'no requests'} latency_p50<={self.latency_percentile_us(0.5):g}us "
            f"p99<={self.latency_percentile_us(0.99):g}us"
        )


class _SharedStateSession:
    """Session shim for a runtime without `new_session` (test doubles): every plant shares its one state."""

    def __init__(self, runtime: Any):
        self.runtime, self.episode, self.step = runtime, 0, 0
        self.seq, self.seen_ns = -1, 0
        self.rate_start_ns, self.rate_count, self.rate_off, self.silences = 0, 0, False, 0

    def act(self, obs):
        return self.runtime.act(obs)

    def act_blind(self):
        return self.runtime.act(np.full(int(self.runtime.obs_dim), np.nan, np.float32))

    def estimate(self):
        return None, 0

    def sent(self, obs, action, replaced: bool) -> None:
        note = getattr(self.runtime, "note_sent", None)
        if replaced and note is not None:
            note(action)

    def moved_to(self, runtime, shield=None):
        moved = _SharedStateSession(runtime)
        moved.episode, moved.step, moved.seq, moved.seen_ns = self.episode, self.step, self.seq, self.seen_ns
        return moved


class ServedBundle:
    """Everything the hot path needs from one runtime, computed once when it is loaded or swapped in."""

    def __init__(self, runtime: Any):
        self.runtime = runtime
        self.obs_dim, self.act_dim = int(runtime.obs_dim), int(runtime.act_dim)
        self.has_sessions = callable(getattr(runtime, "new_session", None))
        # A policy with a per-plant state: the server applies the contract's reset rules to it.
        self.stateful = self.has_sessions and bool(getattr(getattr(runtime, "policy", None), "stateful", False))
        shield = None
        if self.has_sessions:
            # The first calls into onnxruntime and the QP solver are slow: pay them here, off the
            # hot path (a reload happens in the watcher thread), on a session that is then dropped.
            warm = runtime.new_session()
            for _ in range(3):
                warm.act(np.zeros(self.obs_dim, dtype=np.float32))
            shield = getattr(warm, "shield", None)
        # Blind steps in a row the shield's guarantee covers (the contract reply states it); 0 without a shield.
        self.blind_horizon = int(getattr(shield, "blind_horizon", 0))
        bundle = getattr(runtime, "bundle", None)
        self.version = int(getattr(bundle, "version", None) or getattr(runtime, "version", 0) or 0)
        getter = getattr(runtime, "fallback_action", None)
        self.fallback = (
            np.asarray(getter(), np.float32).reshape(self.act_dim)
            if callable(getter)
            else np.zeros(self.act_dim, np.float32)
        )
        self.fallback_bytes = self.fallback.astype("<f4").tobytes()
        # Some action is a set-point (`fallback_hold`): a failed step sends the plant's own held action instead.
        spec = getattr(runtime, "spec", None)
        self.holds = bool(spec is not None and spec.fallback_hold and any(spec.fallback_hold))
        bounds = runtime.action_bounds() if callable(getattr(runtime, "action_bounds", None)) else None
        self.low: np.ndarray | None
        self.high: np.ndarray | None
        self.low, self.high = bounds if bounds is not None else (None, None)
        self.min_request = HEADER_SIZE + ACT_REQUEST_HEAD.size + 4 * self.obs_dim
        # A new plant's shield costs a millisecond or more to build: a few are built here, off the hot path.
        self.spares = [self.spare_session() for _ in range(SPARE_SESSIONS)] if self.has_sessions else []
        spec = getattr(runtime, "spec", None)
        # A plant heard from within this long keeps its session (shield.replay.PlantTable): a second, and
        # the actions in flight through the latency on top, so a plant evicted has applied only its own
        # fallback since every action its old session knew about.
        in_flight_s = (getattr(spec, "latency_steps", 0) + 1) * float(getattr(spec, "dt", 0.0) or 0.0)
        self.plant_live_ns = int((PLANT_LIVE_S + in_flight_s) * 1e9)
        self.constraint_names = [c["name"] for c in getattr(spec, "constraints", [])]
        self.meta = {
            "task": getattr(bundle, "task", "") or "",
            "bundle_version": self.version,
            "control_period_s": float(getattr(spec, "dt", float("nan"))),
            "constraint_names": self.constraint_names,
            "source": "serve",
        }
        self._read_contract(bundle, spec)

    def _read_contract(self, bundle: Any, spec: Any) -> None:
        """The contract's figures the hot path checks against, and the contract reply's payload (built once)."""
        manifest = getattr(bundle, "manifest", None)
        contract = manifest.get("contract") if isinstance(manifest, dict) else None
        period = contract.get("control_period_s") if contract else None
        if period is None and spec is not None:
            period = float(spec.dt)  # a schema-1 bundle: its shield's control period
        self.control_period_s: float | None = period
        self.estimate_names = estimate_names(contract)  # what each plant's estimate reply holds, in order
        self.period_ns = int(period * 1e9) if period else 0  # 0: no request-rate check
        policy = getattr(self.runtime, "policy", None)
        kind = contract["policy_state"]["kind"] if contract else ("history" if self.stateful else "none")
        self.contract_payload = contract_payload(
            self.version,
            self.obs_dim,
            self.act_dim,
            period,
            contract["names_sha256"] if contract else None,
            kind,
            int(getattr(policy, "history_length", 0)),
            self.blind_horizon,
        )
        # OBS_RANGE: an observation beyond these is far outside the range the contract expects (None: unchecked).
        self.obs_far: tuple[list[float], list[float]] | None = None
        # An angle that turns without limit is checked as the policy reads it, wrapped (shield.contract's
        # `wraps_around`): a multi-turn encoder's count is a reading of the same angle, not one far out of range.
        self.obs_wraps = observation_wraps(contract)
        if contract:
            low = [float(o["expected_low"]) for o in contract["observations"]]
            high = [float(o["expected_high"]) for o in contract["observations"]]
            self.obs_far = (
                [lo - OBS_RANGE_WIDTHS * (hi - lo) for lo, hi in zip(low, high)],
                [hi + OBS_RANGE_WIDTHS * (hi - lo) for lo, hi in zip(low, high)],
            )

    def new_session(self) -> Any:
        return self.runtime.new_session() if self.has_sessions else _SharedStateSession(self.runtime)

    def spare_session(self) -> Any:
        """A session built ahead for the next new plant, its first call paid: a fresh session's first `act` costs
        about 200 us more than the next ones (the first touches of its shield's buffers), which with the server's
        own share ran a new plant's first reply past a 1 ms deadline. The session is then reset to how it was
        built (`PlantSession.reset`: the shield's predicted state, monitor and plan, and the policy's memory)."""
        session = self.new_session()
        session.act(np.zeros(self.obs_dim, dtype=np.float32))
        session.reset()
        return session

    def warm_shield(self) -> Any:
        """A new shield for a plant moved onto this runtime (a reload with another spec), its first call paid as a
        spare session's is (`spare_session`), then reset to how it was built."""
        shield = self.runtime.new_shield()
        if shield is not None:
            shield.filter(np.zeros(self.obs_dim, dtype=np.float32), np.zeros(self.act_dim, dtype=np.float32))
            shield.reset()
        return shield

    @property
    def wants_spare(self) -> bool:
        """A spare session was taken and can be rebuilt (`add_spare`)."""
        return self.has_sessions and len(self.spares) < SPARE_SESSIONS

    def add_spare(self) -> None:
        self.spares.append(self.spare_session())

    def take_session(self) -> Any:
        """A session for a new plant: a spare one if any is left, else built now."""
        return self.spares.pop() if self.spares else self.new_session()
