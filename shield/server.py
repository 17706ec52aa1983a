"""`PolicyServer`: serve a shielded policy to plants' controllers over UDP.

One request, one reply, every control period (README.md, "Wire protocol"). The serving
loop is a single thread, so each request sees exactly one runtime: a hot reload
(`RegistryWatcher`) builds the new runtime in its own thread and the loop adopts it
between two requests, carrying every plant's pending actions over.

Each plant (client) has its own session: shield state (prediction through the
latency, monitor) and policy memory, so one sender can never steer the shield of
another. Nothing a client sends can crash the loop or reach the policy unchecked:
the type is checked before anything else and a reply-typed datagram is never
answered; with a key, whatever does not authenticate is dropped without a reply
and changes nothing; a stale or duplicated request is refused before any state
moves; everything else that is wrong gets the fallback action with the status
bit that says why. Only stdlib + numpy here (the runtime brings onnxruntime and daqp).

`run_cli(args)` is `sim2real serve` (`shield.serve_cli`); `python -m shield.server` is
the same command for an edge box that has only `pip install .[edge]`.
"""

from __future__ import annotations

import gc
import hmac
import math
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from shield.constraints import wrap_angle
from shield.protocol import (
    ACT_REPLY_HEAD,
    ACT_REQUEST_HEAD,
    CONTRACT_REQUEST_PAD,
    ESTIMATE_REQUEST_PAD,
    HEADER,
    HEADER_SIZE,
    MAC_SIZE,
    MAGIC,
    PROTOCOL_VERSION,
    RATE_FACTOR,
    RATE_WINDOW,
    REPLY_KEY_LABEL,
    REQUEST_KEY_LABEL,
    SILENCES_FLAGGED,
    STATUS_REQUEST_PAD,
    Flags,
    MsgType,
    Status,
    direction_key,
    encode_contract_reply,
    encode_estimate_reply,
    encode_status_reply,
    latency_bin,
)
from shield.replay import PlantTable, SequenceGuard
from shield.served import ServedBundle, ServeStats
from shield.spec import same_spec

# Looks at the socket's queue without waiting or taking the datagram (0: the platform has no MSG_DONTWAIT).
_PEEK_NOW = socket.MSG_PEEK | socket.MSG_DONTWAIT if hasattr(socket, "MSG_DONTWAIT") else 0

__all__ = ["PolicyServer", "ServeStats", "ServedBundle", "run_cli", "main"]

_U32_MAX = 2**32 - 1
# Plain ints on the hot path: IntFlag arithmetic costs a microsecond per operation.
_INTERVENED, _FALLBACK, _BAD_INPUT, _AUTH_FAILED = (
    int(Status.INTERVENED),
    int(Status.FALLBACK),
    int(Status.BAD_INPUT),
    int(Status.AUTH_FAILED),
)
_SHADOW, _STALE, _DEADLINE, _INFERENCE_ERROR = (
    int(Status.SHADOW),
    int(Status.STALE),
    int(Status.DEADLINE),
    int(Status.INFERENCE_ERROR),
)
_ENVELOPE, _BUSY, _OBS_RANGE, _RATE = int(Status.ENVELOPE), int(Status.BUSY), int(Status.OBS_RANGE), int(Status.RATE)
_BLIND, _BLIND_PAST_HORIZON, _BACKUP = int(Status.BLIND), int(Status.BLIND_PAST_HORIZON), int(Status.BACKUP)
_HMAC, _RESERVED, _RESET_STATE = int(Flags.HMAC), int(Flags.RESERVED), int(Flags.RESET_STATE)
_OBS_MISSING = int(Flags.OBS_MISSING)
_ACT_REQUEST, _ACT_REPLY = int(MsgType.ACT_REQUEST), int(MsgType.ACT_REPLY)
_STATUS_REQUEST, _CONTRACT_REQUEST = int(MsgType.STATUS_REQUEST), int(MsgType.CONTRACT_REQUEST)
_ESTIMATE_REQUEST = int(MsgType.ESTIMATE_REQUEST)
# The padding each non-act request must carry: its reply is never larger than it.
_REQUEST_PAD = {
    _STATUS_REQUEST: STATUS_REQUEST_PAD,
    _CONTRACT_REQUEST: CONTRACT_REQUEST_PAD,
    _ESTIMATE_REQUEST: ESTIMATE_REQUEST_PAD,
}
_MAX_DATAGRAM = 65535
_isfinite = math.isfinite
# Linux: the kernel stamps each datagram when it is received (CLOCK_REALTIME, struct timespec).
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35 if sys.platform.startswith("linux") else None)
_TIMESPEC = struct.Struct("@qq")
_TIMEVAL = struct.Struct("@ll")  # struct timeval on Linux (SO_RCVTIMEO)
DEFAULT_DEADLINE_US = 1000.0
DEFAULT_CLOCK_WINDOW_US = 1_000_000
DEFAULT_MAX_PLANTS = 64
# While serving, the cyclic GC runs only when nothing is queued (`_idle`), or when this many tracked objects
# have piled up since the last collection (a leak of reference cycles: a young-generation pass, ~0.1 ms).
GC_BACKLOG = 2000


class PolicyServer:
    """UDP server: act requests in, shielded (or, in shadow mode, legacy) actions out, one session per plant."""

    def __init__(
        self,
        runtime: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        mode: str = "active",
        key: bytes | None = None,
        shadow_log: Any = None,
        deadline_us: float = DEFAULT_DEADLINE_US,
        max_plants: int = DEFAULT_MAX_PLANTS,
        clock_window_us: int = DEFAULT_CLOCK_WINDOW_US,
        not_before_us: int | None = None,
        wall_clock_ns=time.time_ns,
    ):
        if mode not in ("active", "shadow"):
            raise ValueError(f"mode must be 'active' or 'shadow', got {mode!r}")
        if not (math.isfinite(deadline_us) and deadline_us >= 0):  # 0: every reply overruns (tests)
            raise ValueError(f"deadline_us must be a finite number of microseconds >= 0, got {deadline_us!r}")
        if not (isinstance(clock_window_us, int) and clock_window_us >= 1):
            raise ValueError(f"clock_window_us must be a whole number of microseconds >= 1, got {clock_window_us!r}")
        self.mode, self.shadow_log = mode, shadow_log
        self.key = key
        # Never the PSK itself: one derived key per direction (README, "Keys, sequence numbers and replays").
        self._request_key = direction_key(key, REQUEST_KEY_LABEL) if key is not None else None
        self._reply_key = direction_key(key, REPLY_KEY_LABEL) if key is not None else None
        self.deadline_ns = int(deadline_us * 1000)
        self.wall_clock_ns = wall_clock_ns
        self.stats = ServeStats()
        self._collected_at = -1  # stats.requests at the last idle-time GC pass
        now_us = wall_clock_ns() // 1000
        if key is not None:
            # After a restart nothing the previous run accepted is fresh: it was at most one window ahead of then.
            floor = now_us + clock_window_us if not_before_us is None else not_before_us
            self.guard = SequenceGuard(window_us=clock_window_us, not_before_us=floor)
        else:
            self.guard = SequenceGuard()
        self.served = ServedBundle(runtime)
        self._incoming: tuple[ServedBundle, list, int | None] | None = None  # a reloaded runtime (and its deadline)
        self.plants = PlantTable(max_plants, self._new_session, self.served.plant_live_ns)
        self._stop = threading.Event()
        self.busy_since_ns = 0  # watchdog: when the current request started, 0 when idle
        self.last_request_ns = 0  # when the last request was accepted (perf_counter_ns): the watchdog's silence
        # One reply buffer for every reply: act replies, refusals and status replies (<= 1 KiB).
        self._out = bytearray(1024 + 4 * self.served.act_dim)
        self._in = bytearray(_MAX_DATAGRAM)
        self.kernel_timestamps = False
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        # A burst (or a fuzzer) must queue, not be dropped by the kernel.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        if SO_TIMESTAMPNS is not None:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
                self.kernel_timestamps = True
            except OSError:
                pass  # fallback: the deadline starts when the loop dequeues the datagram (README)
        self.sock.bind((host, port))
        self.address: tuple[str, int] = self.sock.getsockname()

    def _new_session(self) -> Any:
        return self.served.take_session()

    # ---- reload ----------------------------------------------------------------
    def swap_runtime(self, runtime: Any, deadline_us: float | None = None) -> int:
        """Serve `runtime` from the next request on (call from any thread); returns its bundle version.

        The new runtime is warmed up here; the serving loop adopts it between two requests
        and moves every plant's session over (pending actions carried, see PlantSession.moved_to).
        `deadline_us`: the deadline that comes into force with it (None: the current one stays).
        """
        if deadline_us is not None and not (math.isfinite(deadline_us) and deadline_us >= 0):
            raise ValueError(f"deadline_us must be a finite number of microseconds >= 0, got {deadline_us!r}")
        new = ServedBundle(runtime)
        if (new.obs_dim, new.act_dim) != (self.served.obs_dim, self.served.act_dim):
            raise ValueError(
                f"new bundle is obs {new.obs_dim}/act {new.act_dim}, the plant speaks "
                f"obs {self.served.obs_dim}/act {self.served.act_dim}; refusing to switch"
            )
        # Shields for a changed spec are built here, off the hot path (one per plant now served).
        same = same_spec(getattr(runtime, "spec", None), getattr(self.served.runtime, "spec", None))
        spares = [] if same or not new.has_sessions else [new.warm_shield() for _ in range(len(self.plants))]
        self._incoming = (new, spares, None if deadline_us is None else int(deadline_us * 1000))
        return new.version

    def _adopt(self) -> None:
        assert self._incoming is not None  # called only once a reload has staged a runtime
        new, spares, deadline_ns = self._incoming
        self._incoming = None
        if deadline_ns is not None:
            self.deadline_ns = deadline_ns
        sessions = self.plants.sessions
        for client, session in list(sessions.items()):
            sessions[client] = session.moved_to(new.runtime, spares.pop() if spares else None)
        self.served = new
        self.plants.live_ns = new.plant_live_ns
        self.stats.reloads += 1

    # ---- one datagram ----------------------------------------------------------
    def handle(self, data: bytes, addr: Any, t0_ns: int | None = None) -> bytes | None:
        """The reply to one datagram, or None when it is dropped. `t0_ns`: receive time (perf_counter_ns)."""
        n = len(data)
        self._in[:n] = data
        size = self._process(memoryview(self._in), n, addr, time.perf_counter_ns() if t0_ns is None else t0_ns)
        return bytes(self._out[:size]) if size else None

    def _process(self, buf: memoryview, n: int, addr: Any, t0: int) -> int:
        """Reply to the datagram in buf[:n], written into self._out; returns its size (0: dropped)."""
        self._t0 = t0
        stats = self.stats
        stats.requests += 1
        if self._incoming is not None:
            self._adopt()
        if n < HEADER_SIZE:
            stats.dropped += 1
            return 0
        magic, version, msg_type, flags, seq, ts, payload_len, client_id = HEADER.unpack_from(buf)
        if msg_type != _ACT_REQUEST and msg_type not in _REQUEST_PAD:
            stats.dropped += 1  # a reply (or anything else) is never answered: no reflection, no loops
            return 0
        srv = self.served  # one snapshot per request: a reload never mixes versions in a reply
        key, body_end = self._request_key, n
        if key is not None:
            if (
                not flags & _HMAC
                or n < HEADER_SIZE + MAC_SIZE
                or not hmac.compare_digest(hmac.digest(key, buf[: n - MAC_SIZE], "sha256"), buf[n - MAC_SIZE : n])
            ):
                stats.auth_failures += 1
                stats.dropped += 1  # unauthenticated: no reply (no amplification), no state change
                return 0
            body_end -= MAC_SIZE
        elif flags & _HMAC:
            return self._refuse(srv, seq, ts, client_id, _AUTH_FAILED, n)  # signed, but this server has no key
        if (
            magic != MAGIC
            or version != PROTOCOL_VERSION
            or flags & _RESERVED
            or payload_len != body_end - HEADER_SIZE
            or (flags & _OBS_MISSING and msg_type != _ACT_REQUEST)  # the flag means something to act requests only
        ):
            return self._refuse(srv, seq, ts, client_id, _BAD_INPUT, n)
        client = client_id if key is not None else (addr, client_id)
        guard = self.guard
        restarted = False
        if not guard.fresh(
            client, seq, self.wall_clock_ns() // 1000 if key is not None else 0
        ) or seq <= self.plants.last_seq(client):
            # Without a key the seq only orders a live plant's packets: one silent past the plant-live time that
            # counts again from below its last (a duplicate of that one stays STALE) is a plant restarted (a
            # controller counting from 1), not a late packet, and was STALE for ever. It starts as a new plant
            # once its request is accepted, as eviction would.
            restarted = (
                key is None and msg_type == _ACT_REQUEST and seq < guard.last(client) and self.plants.silent(client, t0)
            )
            if not restarted:  # late, duplicated or replayed: nothing moves
                return self._refuse(srv, seq, ts, client_id, _STALE, n, client)
        if key is not None:
            # Authenticated and fresh: its seq is spent whatever the answer (as IPsec's anti-replay window moves
            # once the integrity check passes). A signed request refused below (BUSY at --max-plants, BAD_INPUT)
            # must not stay fresh for a listener to replay once it would be accepted. Without a key nothing is
            # authenticated: only accepted requests move the guard, so a malformed datagram changes nothing.
            guard.commit(client, seq)
        if msg_type != _ACT_REQUEST:  # a status, contract or estimate request: padded as long as its reply
            if payload_len < _REQUEST_PAD[msg_type]:
                return self._refuse(srv, seq, ts, client_id, _BAD_INPUT, n)
            # Without a key a read-only request moves nothing: anyone on the host can send one, and a seq from
            # the future would otherwise make the plant's own next act request STALE.
            self.last_request_ns = t0
            if msg_type == _STATUS_REQUEST:
                return self._status_reply(srv, seq, ts, client_id)
            if msg_type == _ESTIMATE_REQUEST:
                return self._estimate_reply(srv, seq, ts, client_id, client)
            return self._contract_reply(srv, seq, ts, client_id)
        if payload_len < ACT_REQUEST_HEAD.size:
            return self._refuse(srv, seq, ts, client_id, _BAD_INPUT, n, client)
        n_obs, n_legacy = ACT_REQUEST_HEAD.unpack_from(buf, HEADER_SIZE)
        shadow = self.mode == "shadow"
        if (
            n_obs != srv.obs_dim
            or n_legacy not in ((srv.act_dim,) if shadow else (0, srv.act_dim))
            or payload_len != ACT_REQUEST_HEAD.size + 4 * (n_obs + n_legacy)
        ):
            return self._refuse(srv, seq, ts, client_id, _BAD_INPUT, n, client)
        floats = np.frombuffer(buf, dtype="<f4", count=n_obs + n_legacy, offset=HEADER_SIZE + ACT_REQUEST_HEAD.size)
        values = floats.tolist()
        blind = flags & _OBS_MISSING  # the observation is missing: its values are ignored, the legacy action is not
        if not all(map(_isfinite, values[n_obs:] if blind else values)):  # a handful: cheaper than numpy's reduction
            return self._refuse(srv, seq, ts, client_id, _BAD_INPUT, n, client)
        legacy = floats[n_obs:].astype(np.float32) if shadow else None
        if (
            shadow
            and srv.low is not None
            and srv.high is not None
            and not ((legacy >= srv.low).all() and (legacy <= srv.high).all())
        ):
            return self._refuse(srv, seq, ts, client_id, _BAD_INPUT, n, client)  # the plant cannot have applied it
        # A copy: the receive buffer is reused. Blind: NaN, what the shield log records for a missing observation.
        obs = np.full(n_obs, np.nan, np.float32) if blind else floats[:n_obs].astype(np.float32)
        plants = self.plants
        created = plants.created
        if restarted:
            plants.forget(client)
        known = plants.sessions.get(client)
        silent = known is not None and plants.lapsed(known, t0)  # read before admit marks it seen
        session = plants.admit(client, seq, t0)
        if session is None:  # a new plant, and every session is a live plant's: none is taken from it
            stats.plants_refused = plants.refused
            return self._refuse(srv, seq, ts, client_id, _BUSY, n)
        if key is None:
            guard.commit(client, seq)
        self.last_request_ns = t0
        stats.plants_evicted = plants.evicted
        warn = self._contract_rules(srv, session, flags, plants.created != created, silent, values, t0)
        return self._act(srv, session, obs, legacy, seq, ts, client_id, t0, warn, bool(blind))

    def _contract_rules(
        self, srv: ServedBundle, session: Any, flags: int, new: bool, silent: bool, values: list, t0: int
    ) -> int:
        """An accepted act request: the policy state's reset rules (shield.contract.RESET_RULES), each counted;
        returns the warning bits (OBS_RANGE, RATE) its reply carries."""
        stats = self.stats
        reset = bool(flags & _RESET_STATE)  # the plant starts afresh: read by all three rules below
        if reset and not new:
            # The plant says it starts afresh: the shadow log starts an episode there, so a calibration never fits
            # the jump of a reset as dynamics (a lost reply, the other reason to send it, only splits an episode).
            self.plants.new_episode(session)
        if srv.stateful:
            # Each rule its own count: a new plant's first request with RESET_STATE counts under both.
            if new:
                stats.state_resets_new_plant += 1  # a fresh session: its state is the initial one already
            if reset:
                if not new:
                    session.reset_policy_state()
                stats.state_resets_requested += 1
            elif silent and not new:
                session.reset_policy_state()
                stats.state_resets_silence += 1
        warn = 0
        far = None if flags & _OBS_MISSING else srv.obs_far
        if far is not None and srv.obs_wraps:
            values = list(values)
            for i, c in srv.obs_wraps:
                values[i] = wrap_angle(values[i], c)
        if far is not None and any(v < lo or v > hi for v, lo, hi in zip(values, far[0], far[1])):
            warn = _OBS_RANGE
            stats.obs_out_of_range += 1
        if srv.period_ns:
            if reset or silent:
                session.rate_count, session.rate_off = 0, False  # a pause between episodes is not a rate
            # A pause is followed by requests at the control period; a plant whose every request comes after a
            # silence polls slower than the plant-live time, which the window (restarted by each silence) never
            # measures: the second such request in a row is flagged, and each after it.
            session.silences = session.silences + 1 if silent and not new and not reset else 0
            if self._rate_off(srv.period_ns, session, t0) or session.silences >= SILENCES_FLAGGED:
                warn |= _RATE
                stats.rate_warnings += 1
        return warn

    @staticmethod
    def _rate_off(period_ns: int, session: Any, t0: int) -> bool:
        """Whether this plant's requests, over its last full window of RATE_WINDOW intervals, came more than
        RATE_FACTOR times faster or slower than the control period; windows tumble, a verdict holds for the next."""
        count = session.rate_count
        if count == 0:
            session.rate_start_ns = t0
        elif count == RATE_WINDOW:
            mean_ns = (t0 - session.rate_start_ns) / RATE_WINDOW
            session.rate_off = not (period_ns / RATE_FACTOR <= mean_ns <= period_ns * RATE_FACTOR)
            session.rate_start_ns, count = t0, 0
        session.rate_count = count + 1
        return session.rate_off

    def _act(
        self,
        srv: ServedBundle,
        session: Any,
        obs: np.ndarray,
        legacy,
        seq: int,
        ts: int,
        client_id: int,
        t0: int,
        warn: int = 0,
        blind: bool = False,
    ) -> int:
        """An accepted act request; `blind`: its observation is missing (Flags.OBS_MISSING), the shield
        dead-reckons (`PlantSession.act_blind`: the policy does not run, its memory does not move)."""
        stats = self.stats
        stats.policy_calls += 1  # every accepted act request, blind ones included: the shield ran
        raised = False
        seen = None if blind else obs  # what the policy's memory records with the action sent
        try:
            safe, raw, info = session.act_blind() if blind else session.act(obs)
            safe = np.asarray(safe, dtype="<f4").reshape(srv.act_dim)
            failed = not all(map(_isfinite, safe.tolist()))
        except Exception:  # any runtime failure is answered with the fallback, never a crash
            failed = raised = True
        if failed:
            safe = raw = np.full(srv.act_dim, np.nan, np.float32)
            info = {"fallback": True}
        if failed or info.get("bad_input"):  # bad_input: the request was checked finite, the policy's output not
            stats.inference_errors += 1  # in shadow mode too: counted and logged, the plant keeps legacy
        status = warn  # OBS_RANGE, RATE: warnings, the action is still the shield's
        if info.get("envelope", False):  # the one place the monitor's flag becomes a status bit
            status |= _ENVELOPE
            stats.envelope_flags += 1
        if blind:  # the one place the shield's dead reckoning becomes status bits
            status |= _BLIND
            stats.blind_steps += 1
            if info.get("blind", True):  # past the blind horizon, no state to reckon from, or the runtime failed
                status |= _BLIND_PAST_HORIZON
                stats.blind_past_horizon += 1
        decided = time.perf_counter_ns()  # one clock reading decides `late` and is the reply's latency_us
        late = decided - t0 > self.deadline_ns
        if late:
            stats.deadline_misses += 1
        if legacy is not None:  # shadow: the candidate's failures and delays are logged; the plant keeps legacy
            self._log(srv, session, obs, legacy, raw, safe, info, t0)
            if not raised:
                session.sent(seen, legacy, replaced=True)
            return self._reply(srv, seq, ts, client_id, status | _SHADOW, legacy.tobytes(), decided)
        if failed or late:
            # The plant's own fallback: a set-point action (`fallback_hold`) holds the last one it was sent.
            held = srv.fallback if raised or not srv.holds else np.asarray(session.fallback(), "<f4")
            if not raised:  # a runtime that raised may not have filtered: nothing to correct
                session.sent(seen, held, replaced=True)
            return self._reply(
                srv,
                seq,
                ts,
                client_id,
                status
                | _FALLBACK
                | (_INFERENCE_ERROR if failed else _DEADLINE)
                | (_INFERENCE_ERROR if info.get("bad_input") else 0),
                held.tobytes() if held is not srv.fallback else srv.fallback_bytes,
                decided,
            )
        session.sent(seen, safe, replaced=False)
        if info.get("intervened"):
            status |= _INTERVENED
            stats.interventions += 1
        if info.get("fallback"):
            status |= _FALLBACK
        if info.get("backup"):
            status |= _BACKUP
            stats.backups += 1
        if info.get("bad_input"):
            status |= _INFERENCE_ERROR
        return self._reply(srv, seq, ts, client_id, status, safe.tobytes(), decided)

    def _refuse(
        self, srv: ServedBundle, seq: int, ts: int, client_id: int, status: int, request_size: int, client: Any = None
    ) -> int:
        """The fallback with `status`; dropped instead when the datagram is shorter than a valid act request
        (a refusal then amplifies no more than an ordinary act reply does). `client`: the plant the request names,
        once it is known: a set-point action (`fallback_hold`) of a plant with a session holds the last action that
        plant was sent, as a late step does; the constant would command a servo to move there (a NaN reading, a
        stale request)."""
        if request_size < srv.min_request + (MAC_SIZE if self.key is not None else 0):
            self.stats.dropped += 1  # answering would amplify: a short datagram gets nothing back
            return 0
        stats = self.stats  # each refusal counter counts the refusals sent, as the README's table says
        if status & _BAD_INPUT:
            stats.bad_inputs += 1
        elif status & _STALE:
            stats.stale += 1
        elif status & _AUTH_FAILED:
            stats.auth_failures += 1
        action = srv.fallback_bytes
        if srv.holds and client is not None and (session := self.plants.sessions.get(client)) is not None:
            action = np.asarray(session.fallback(), "<f4").tobytes()
        return self._reply(srv, seq, ts, client_id, status | _FALLBACK, action)

    def _reply(
        self,
        srv: ServedBundle,
        seq: int,
        ts: int,
        client_id: int,
        status: int,
        action: bytes,
        decided_ns: int | None = None,
    ) -> int:
        """Write an act reply into the preallocated buffer (signed with the reply key); returns its size.

        `decided_ns`: the clock reading that decided whether the reply is late; its latency_us is that
        reading, so a reply that says it was on time was judged on time by the same figure (a preemption
        between the decision and this line cannot make an on-time verdict carry a late latency).
        """
        stats = self.stats
        latency_us = min(
            max(0, ((time.perf_counter_ns() if decided_ns is None else decided_ns) - self._t0) // 1000), _U32_MAX
        )
        stats.answered += 1
        stats.histogram[latency_bin(latency_us)] += 1
        stats.latency_sum_us += latency_us
        if status & _FALLBACK:
            stats.fallbacks += 1
        key, out = self._reply_key, self._out
        size = HEADER_SIZE + ACT_REPLY_HEAD.size + len(action)
        HEADER.pack_into(
            out,
            0,
            MAGIC,
            PROTOCOL_VERSION,
            _ACT_REPLY,
            _HMAC if key is not None else 0,
            seq,
            ts,
            ACT_REPLY_HEAD.size + len(action),
            client_id,
        )
        ACT_REPLY_HEAD.pack_into(out, HEADER_SIZE, status, latency_us, srv.version, len(action) // 4, 0)
        out[HEADER_SIZE + ACT_REPLY_HEAD.size : size] = action
        if key is not None:
            out[size : size + MAC_SIZE] = hmac.digest(key, memoryview(out)[:size], "sha256")
            size += MAC_SIZE
        return size

    def _send(self, encode: Callable[[], bytes]) -> int:
        """Count an answer to a request, then encode it (so a status reply counts itself) into the outgoing buffer
        (sized in __init__ for the largest); its length."""
        self.stats.answered += 1
        frame = encode()
        self._out[: len(frame)] = frame
        return len(frame)

    def _status_reply(self, srv: ServedBundle, seq: int, ts: int, client_id: int) -> int:
        stats = self.stats
        stats.status_requests += 1
        return self._send(
            lambda: encode_status_reply(
                seq,
                ts,
                srv.version,
                int((time.monotonic() - stats.started) * 1e6),
                stats.as_dict(),
                stats.histogram,
                self.key,
                client_id,
            )
        )

    def _contract_reply(self, srv: ServedBundle, seq: int, ts: int, client_id: int) -> int:
        self.stats.contract_requests += 1
        return self._send(lambda: encode_contract_reply(seq, ts, srv.contract_payload, self.key, client_id))

    def _estimate_reply(self, srv: ServedBundle, seq: int, ts: int, client_id: int, client: Any) -> int:
        """The requesting plant's estimate (its session's, looked up, not created: asking admits no plant)."""
        self.stats.estimate_requests += 1
        estimate, steps = self.live_estimate(self.plants.sessions.get(client))
        return self._send(lambda: encode_estimate_reply(seq, ts, srv.version, estimate, steps, self.key, client_id))

    def live_estimate(self, session: Any) -> tuple[Any, int]:
        """(estimate, steps) of a plant session, or (None, 0) where there is none or the plant has been silent past
        the plant-live time: its policy state restarts at its next request (the silence reset rule), so what it
        believed before the silence is no longer what the policy holds for it."""
        if session is None or self.plants.lapsed(session, time.perf_counter_ns()):
            return None, 0
        return session.estimate()

    def _log(self, srv: ServedBundle, session: Any, obs, legacy, raw, safe, info: dict, t0: int) -> None:
        if self.shadow_log is None:
            return
        h = info.get("h")
        h = (
            np.full(len(srv.constraint_names), np.nan, np.float32)
            if h is None
            else np.asarray(h, dtype=np.float32).reshape(-1)
        )
        self.shadow_log.append(
            srv.meta,
            self.shadow_log.clock(),
            session.episode,
            session.step,
            obs,
            legacy,
            np.asarray(raw, np.float32).reshape(-1),
            safe,
            bool(info.get("intervened")),
            bool(info.get("fallback")),
            h,
            (time.perf_counter_ns() - t0) / 1000.0,
        )
        session.step += 1

    # ---- the loop ---------------------------------------------------------------
    def _receive_time(self, ancdata: list) -> int:
        """perf_counter_ns at which the kernel received the datagram (now, without a kernel timestamp)."""
        now = time.perf_counter_ns()
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
                sec, nsec = _TIMESPEC.unpack_from(data)
                queued = self.wall_clock_ns() - (sec * 1_000_000_000 + nsec)
                return now - queued if queued > 0 else now
        return now

    def _idle(self, quiet: bool = True) -> None:
        """Between requests: make a plant session ready for the next new plant; flush a due shadow log.
        `quiet`: no datagram for a whole poll period, so the cyclic GC may run its full pass too."""
        if self.served.wants_spare:
            self.served.add_spare()
        if quiet and self.stats.requests != self._collected_at:  # once per quiet spell after traffic
            self._collected_at = self.stats.requests
            gc.collect()
        if self.shadow_log is not None:
            self.shadow_log.flush_if_due()  # a plant that stopped talking still gets its log on disk

    def _refill(self, sock: socket.socket) -> None:
        """After a reply, with a spare session taken and no datagram waiting: build one spare (a millisecond or
        two). `_idle` alone refilled only after a quiet poll period, which a live plant never leaves: every new
        plant after the first SPARE_SESSIONS was built on the hot path, its own first reply late and the other
        plants' requests queued behind it (helper-48: 92 of 250 replies late at 50 Hz, new plants every 50 ms)."""
        if not self.served.wants_spare or not _PEEK_NOW:  # no non-blocking peek on this platform: `_idle` refills
            return
        try:
            sock.recv(1, _PEEK_NOW)
            return  # a request is waiting: it goes first
        except (BlockingIOError, InterruptedError):
            self.served.add_spare()
        except OSError:
            return

    def serve_forever(self, poll_s: float = 0.1, busy_poll: bool = False) -> None:
        """Answer datagrams until `stop()`; never raises on a client's input.

        `busy_poll`: spin on a non-blocking socket instead of sleeping in the kernel. A
        sleeping thread pays the scheduler's wake-up (tens of µs on bare metal, 100-200 µs
        on a VM whose idle vCPU halts) on every request; spinning pays one CPU at 100 %.
        """
        sock, buf, out = self.sock, memoryview(self._in), memoryview(self._out)
        anc = socket.CMSG_SPACE(_TIMESPEC.size) if self.kernel_timestamps else 0
        if busy_poll:
            sock.setblocking(False)
            idle_every_ns, next_idle = int(poll_s * 1e9), time.perf_counter_ns()
        else:
            idle_every_ns = next_idle = 0
            try:  # blocking, woken by the kernel's own receive timeout: one syscall per request, not poll + recv
                sec, usec = divmod(max(1, int(poll_s * 1e6)), 1_000_000)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.pack(sec, usec))
                sock.settimeout(None)
            except (OSError, AttributeError, struct.error):
                sock.settimeout(poll_s)  # Python's timeout: a poll() before each receive
        # The cyclic GC would pause a request at random for up to milliseconds (a full pass over every
        # session's objects: 6 ms measured at 1 kHz); the hot path makes no reference cycles, so it is
        # off while serving and runs when the plants are quiet, or on a backlog (GC_BACKLOG).
        gc_enabled = gc.isenabled()
        gc.disable()
        try:
            self._serve_loop(sock, buf, out, anc, idle_every_ns, next_idle)
        finally:
            if gc_enabled:
                gc.enable()

    def _serve_loop(
        self, sock: socket.socket, buf: memoryview, out: memoryview, anc: int, idle_every_ns: int, next_idle: int
    ) -> None:
        """`serve_forever`'s loop; `idle_every_ns` > 0: busy-poll, `_idle` at most that often."""
        stats, get_count, collect = self.stats, gc.get_count, gc.collect
        while not self._stop.is_set():
            try:
                n, ancdata, _, addr = sock.recvmsg_into([buf], anc)
            except BlockingIOError:  # busy-poll: nothing yet; blocking: the receive timeout (idle_every_ns 0)
                if time.perf_counter_ns() >= next_idle:
                    self._idle(quiet=time.perf_counter_ns() - self.last_request_ns > idle_every_ns)
                    next_idle = time.perf_counter_ns() + idle_every_ns
                continue
            except TimeoutError:
                self._idle()
                continue
            except OSError:
                if self._stop.is_set():
                    break
                continue  # e.g. an ICMP error queued on the socket: nothing to answer
            t0 = self._receive_time(ancdata)
            self.busy_since_ns = time.perf_counter_ns()
            try:
                size = self._process(buf, n, addr, t0)
            except Exception as err:  # a bug here must cost one reply, not the plant's controller
                print(f"serve: internal error on a {n}-byte datagram: {err!r}", file=sys.stderr)
                size = 0
                stats.dropped += 1
            if size:
                try:
                    sock.sendto(out[:size], addr)
                except OSError:
                    pass  # the client is gone; its next request gets the next reply
            self.busy_since_ns = 0
            if get_count()[0] > GC_BACKLOG:  # after the reply: the pass delays no plant's action
                collect(0)
            self._refill(sock)

    def stop(self) -> None:
        """Ask the loop to finish after the current request (signal-safe)."""
        self._stop.set()

    def close(self) -> None:
        """Flush the shadow log (waiting for it) and close the socket."""
        self._stop.set()
        if self.shadow_log is not None:
            self.shadow_log.close()
        self.sock.close()


def run_cli(args) -> int:
    """`sim2real serve` (see shield.serve_cli)."""
    from shield.serve_cli import run_cli as run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    """`python -m shield.server`: the same as `sim2real serve`, for an edge box without pipeline/."""
    from shield.serve_cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
