"""The UDP wire protocol between a plant's controller and `sim2real serve`.

Byte-by-byte description: README.md, "Wire protocol". Everything is little-endian; a
datagram is a 32-byte header, a payload, and (when a key is configured) a
32-byte HMAC-SHA256 trailer over header + payload. No pickle, no JSON.

Version 2 (why it is not 1): the MAC covers a direction. The pre-shared key is
never used as a MAC key itself; each direction has its own key derived from it,
`HMAC-SHA256(psk, "S2RP v2 request")` for controller -> server and
`HMAC-SHA256(psk, "S2RP v2 reply")` for server -> controller, so a signed reply
can never verify as a request (version 1 signed both with the same key, and a
reflected refusal passed as a request).

This module only encodes and decodes frames; the server's policy decisions
(replay window, deadlines, fallback) live in `shield.server`.
"""

from __future__ import annotations

import functools
import hmac
import struct
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag

import numpy as np

from shield.contract import MAX_ESTIMATES

MAGIC = b"S2RP"
PROTOCOL_VERSION = 2
REQUEST_KEY_LABEL = b"S2RP v2 request"  # derives the controller -> server MAC key from the PSK
REPLY_KEY_LABEL = b"S2RP v2 reply"  # derives the server -> controller MAC key

# magic, version, type, flags, seq, timestamp_us, payload_len, client_id
HEADER = struct.Struct("<4sBBHQQII")
HEADER_SIZE = HEADER.size  # 32
MAC_SIZE = 32  # HMAC-SHA256 digest
# n_obs, n_legacy; then float32 obs[n_obs], float32 legacy_action[n_legacy]
ACT_REQUEST_HEAD = struct.Struct("<HH")
# status bits, server latency (µs), bundle version, n_act, reserved; then float32 action[n_act]
ACT_REPLY_HEAD = struct.Struct("<IIIHH")
# A status request carries this many zero bytes of padding (payload_len >= it), so that its
# reply is never larger than the request: a spoofed status request amplifies nothing.
STATUS_REQUEST_PAD = 480
# Counters in a status reply, in wire order (each u64). Names match ServeStats.
COUNTER_NAMES = (
    "requests",  # datagrams received, whatever they hold (answered + dropped)
    "answered",  # replies sent (act replies, refusals included, and status replies)
    "dropped",  # datagrams not answered (too short, not a request, unauthenticated, ...)
    "policy_calls",  # times the policy ran (one per accepted act request)
    "interventions",  # active replies whose action the shield changed
    "fallbacks",  # act replies carrying the fallback action (refusals included)
    "bad_inputs",  # malformed or non-finite requests, answered BAD_INPUT
    "auth_failures",  # missing or wrong MAC (dropped with a key; answered without one)
    "stale",  # refusals STALE sent: seq not newer than the client's last, or (with a key)
    # outside the server's clock window: replays included
    "deadline_misses",  # kernel receive -> action computed overran --deadline-us: fallback sent
    "inference_errors",  # runtime raised, returned non-finite values, or the policy's action was non-finite
    # (active: INFERENCE_ERROR replies; shadow: counted and logged, legacy sent)
    "reloads",  # hot reloads of a newly promoted bundle
    "status_requests",  # status requests answered
    "envelope_flags",  # act replies with ENVELOPE: the plant was outside the declared envelope
    "plants_evicted",  # plant sessions (shield state, policy memory) dropped to admit a new plant
    "plants_refused",  # act requests of a new plant answered BUSY: every session held by a live plant
    # A stateful policy's per-plant state started from its initial value (shield.contract.RESET_RULES):
    "state_resets_new_plant",  # a new plant session
    "state_resets_requested",  # act requests with the RESET_STATE flag (new episode, or a reply lost)
    "state_resets_silence",  # a plant silent longer than the plant-live time
    "contract_requests",  # contract requests answered
    "obs_out_of_range",  # act replies with OBS_RANGE: an observation far outside the contract's expected range
    "rate_warnings",  # act replies with RATE: the plant's request rate is far from the control period
    "blind_steps",  # act replies with BLIND: the request said its observation was missing (OBS_MISSING)
    "blind_past_horizon",  # act replies with BLIND_PAST_HORIZON: blind past the shield's blind horizon
    "estimate_requests",  # plant estimate requests answered
    "backups",  # act replies with BACKUP: the predictive filter's backup continued its last accepted plan
)
# bundle version, obs_dim, act_dim, control period (s, NaN: not stated), names_sha256 (32 raw bytes, zeros:
# no contract), policy state kind (0 none, 1 history), state length, blind horizon (steps; the field was reserved
# and 0 before it, which a reader takes as "no blind step is covered")
CONTRACT_REPLY = struct.Struct("<IHHd32sHHI")
# A contract request's padding: its reply is never larger than the request.
CONTRACT_REQUEST_PAD = CONTRACT_REPLY.size
STATE_KIND_CODES = {"none": 0, "history": 1}
# bundle version, n (parameters in this reply: 0 when the policy estimates none, or the requesting plant has no
# session or no estimate yet), reserved, steps the plant's policy state has seen since it last started; then
# float32 estimate[n], in the order of the contract's plant_estimate.parameters
ESTIMATE_REPLY_HEAD = struct.Struct("<IHHI")
# An estimate request's padding: room for the largest reply (MAX_ESTIMATES parameters), never amplified.
ESTIMATE_REQUEST_PAD = ESTIMATE_REPLY_HEAD.size + 4 * MAX_ESTIMATES
# bundle version, uptime (µs), n_counters, n_bins; then u64 counters, u64 histogram bins
STATUS_REPLY_HEAD = struct.Struct("<IQHH")
# Latency histogram: bin 0 counts < 1 µs, bin i (1..N-2) counts [2**(i-1), 2**i) µs,
# the last bin counts everything >= 2**(N-2) µs (here 2**18 µs ~ 0.26 s).
LATENCY_BINS = 20


class MsgType(IntEnum):
    """Value of the header's type byte."""

    ACT_REQUEST = 1
    ACT_REPLY = 2
    STATUS_REQUEST = 3
    STATUS_REPLY = 4
    CONTRACT_REQUEST = 5
    CONTRACT_REPLY = 6
    ESTIMATE_REQUEST = 7
    ESTIMATE_REPLY = 8


class Flags(IntFlag):
    """Header flag bits."""

    NONE = 0
    HMAC = 0x0001  # a 32-byte HMAC-SHA256 trailer follows the payload
    # Act request: start this plant's policy state afresh before this step (a new episode, or the controller
    # got no usable reply to its previous request); ignored by a memoryless policy.
    RESET_STATE = 0x0002
    # Act request: this step's observation is missing (a sensor dropout): the shield dead-reckons from the last good
    # one through the actions sent since, and the policy does not run. The observation field keeps its size
    # (n_obs = obs_dim); its values are ignored (send NaN or zeros). Refused on any other request type.
    OBS_MISSING = 0x0004
    RESERVED = 0xFFF8  # must be 0: a frame with any of these bits set is refused


REQUEST_TYPES = (1, 3, 5, 7)  # what a server answers; a reply-typed datagram is never answered


class Status(IntFlag):
    """Status bits of an act reply: they describe the action in that reply."""

    OK = 0
    INTERVENED = 1 << 0  # the CBF shield changed the policy's action
    FALLBACK = 1 << 1  # the action is the fallback safe action
    BAD_INPUT = 1 << 2  # malformed request or non-finite values: never reached the policy
    AUTH_FAILED = 1 << 3  # bad/missing MAC or replayed sequence: never reached the policy
    SHADOW = 1 << 4  # shadow mode: the action is the request's legacy action
    STALE = 1 << 5  # sequence number not newer than this client's last one
    DEADLINE = 1 << 6  # compute overran the deadline: fallback sent instead
    INFERENCE_ERROR = 1 << 7  # the runtime failed or returned non-finite values
    ENVELOPE = 1 << 8  # the plant is outside the declared envelope: the shield is in its conservative mode
    BUSY = 1 << 9  # a new plant, and every session is held by a live plant: fallback, no session
    # Warnings (the action is the shield's as usual): what the plant sends does not look like the contract.
    OBS_RANGE = 1 << 10  # an observation lies more than OBS_RANGE_WIDTHS widths outside its expected range
    RATE = 1 << 11  # this plant's requests over the last RATE_WINDOW came more than RATE_FACTOR x too fast/slow
    # A request with Flags.OBS_MISSING: the action is the shield's fallback checked at the dead-reckoned state
    # (FALLBACK is set too: the policy did not run).
    BLIND = 1 << 12
    # ... and that state is no longer known to within the shield's margin: blind longer than its blind horizon (the
    # contract reply states it), or no good observation yet to dead-reckon from. The guarantee no longer holds:
    # the controller should stop the plant.
    BLIND_PAST_HORIZON = 1 << 13
    # The predictive filter (shield.json `predictive`) found no action whose plan holds, and its backup controller
    # continues the plan it accepted last: its designed hand-over near a limit, certified by that plan, so neither
    # FALLBACK nor an alarm. A barrier shield never sets it.
    BACKUP = 1 << 14


OBS_RANGE_WIDTHS = 1.0  # OBS_RANGE: beyond [low - w * (high - low), high + w * (high - low)]
RATE_WINDOW = 50  # RATE: the mean interval of a plant's last this many requests ...
RATE_FACTOR = 2.0  # ... outside [period / RATE_FACTOR, period * RATE_FACTOR]
SILENCES_FLAGGED = 2  # RATE too: this many requests in a row, each after a silence past the plant-live time


# Bits a controller treats as an alarm (the action is then the fallback, or the policy misbehaved).
ALARM_BITS = (
    Status.FALLBACK
    | Status.BAD_INPUT
    | Status.AUTH_FAILED
    | Status.STALE
    | Status.DEADLINE
    | Status.INFERENCE_ERROR
    | Status.BUSY
    | Status.BLIND_PAST_HORIZON
)


def latency_bin(latency_us: float) -> int:
    """Histogram bin of a latency in µs (see LATENCY_BINS)."""
    return min(LATENCY_BINS - 1, int(latency_us).bit_length()) if latency_us > 0 else 0


def latency_bin_edges_us() -> np.ndarray:
    """Lower edges (µs) of the latency histogram bins."""
    return np.array([0.0] + [float(2 ** (i - 1)) for i in range(1, LATENCY_BINS)])


class PacketError(ValueError):
    """A frame that cannot be decoded; `status` is the bit a reply would carry."""

    def __init__(self, message: str, status: Status = Status.BAD_INPUT):
        super().__init__(message)
        self.status = status


@functools.lru_cache(maxsize=16)
def direction_key(psk: bytes, direction: bytes) -> bytes:
    """The MAC key of one direction: HMAC-SHA256(psk, label), label REQUEST_KEY_LABEL or REPLY_KEY_LABEL."""
    return hmac.digest(psk, direction, "sha256")


def sign(key: bytes, frame: bytes) -> bytes:
    """HMAC-SHA256 trailer (32 bytes) over a frame's header + payload with a direction key."""
    return hmac.digest(key, frame, "sha256")


def _direction(msg_type: int) -> bytes:
    return REQUEST_KEY_LABEL if msg_type in REQUEST_TYPES else REPLY_KEY_LABEL


def _frame(
    msg_type: MsgType,
    seq: int,
    timestamp_us: int,
    payload: bytes,
    key: bytes | None,
    client_id: int = 0,
    flags: Flags = Flags.NONE,
) -> bytes:
    """A frame, signed with the PSK's key for its direction (requests vs replies) when `key` (the PSK) is given."""
    flags = flags | (Flags.HMAC if key is not None else Flags.NONE)
    head = HEADER.pack(MAGIC, PROTOCOL_VERSION, int(msg_type), int(flags), seq, timestamp_us, len(payload), client_id)
    frame = head + payload
    return frame + sign(direction_key(key, _direction(int(msg_type))), frame) if key is not None else frame


def _floats(values) -> bytes:
    if values is None:
        return b""
    arr = np.ascontiguousarray(values, dtype="<f4").reshape(-1)
    return arr.tobytes()


def encode_act_request(
    seq: int,
    timestamp_us: int,
    obs,
    legacy_action=None,
    key: bytes | None = None,
    client_id: int = 0,
    reset_state: bool = False,
    obs_missing: bool = False,
) -> bytes:
    """Frame an act request: observation (float32) and, in shadow mode, the legacy action applied;
    `reset_state` sets Flags.RESET_STATE (the policy's state starts afresh before this step), `obs_missing`
    Flags.OBS_MISSING (the observation's values, NaN or zeros, are ignored: the shield dead-reckons)."""
    obs_b, leg_b = _floats(obs), _floats(legacy_action)
    payload = ACT_REQUEST_HEAD.pack(len(obs_b) // 4, len(leg_b) // 4) + obs_b + leg_b
    flags = (Flags.RESET_STATE if reset_state else Flags.NONE) | (Flags.OBS_MISSING if obs_missing else Flags.NONE)
    return _frame(MsgType.ACT_REQUEST, seq, timestamp_us, payload, key, client_id, flags)


def encode_status_request(seq: int, timestamp_us: int, key: bytes | None = None, client_id: int = 0) -> bytes:
    """Frame a status (counters) request; its payload is STATUS_REQUEST_PAD zero bytes."""
    return _frame(MsgType.STATUS_REQUEST, seq, timestamp_us, bytes(STATUS_REQUEST_PAD), key, client_id)


def encode_contract_request(seq: int, timestamp_us: int, key: bytes | None = None, client_id: int = 0) -> bytes:
    """Frame a contract request (what the served bundle expects); its payload is CONTRACT_REQUEST_PAD zeros."""
    return _frame(MsgType.CONTRACT_REQUEST, seq, timestamp_us, bytes(CONTRACT_REQUEST_PAD), key, client_id)


def encode_estimate_request(seq: int, timestamp_us: int, key: bytes | None = None, client_id: int = 0) -> bytes:
    """Frame a plant estimate request (what the policy believes about the requesting plant); its payload is
    ESTIMATE_REQUEST_PAD zeros. The reply is about the plant session of this client (its address and client id
    without a key, its client id with one)."""
    return _frame(MsgType.ESTIMATE_REQUEST, seq, timestamp_us, bytes(ESTIMATE_REQUEST_PAD), key, client_id)


def encode_estimate_reply(
    seq: int,
    timestamp_us: int,
    bundle_version: int,
    estimate,
    steps: int,
    key: bytes | None = None,
    client_id: int = 0,
) -> bytes:
    """Frame a plant estimate reply: `estimate` float32[n] (None or empty: none) and the state's steps."""
    values = b"" if estimate is None else _floats(estimate)
    payload = ESTIMATE_REPLY_HEAD.pack(int(bundle_version), len(values) // 4, 0, int(steps)) + values
    return _frame(MsgType.ESTIMATE_REPLY, seq, timestamp_us, payload, key, client_id)


def contract_payload(
    bundle_version: int,
    obs_dim: int,
    act_dim: int,
    control_period_s: float | None,
    names_sha256: str | None,
    state_kind: str = "none",
    state_length: int = 0,
    blind_horizon: int = 0,
) -> bytes:
    """A contract reply's payload (the server builds it once per bundle)."""
    return CONTRACT_REPLY.pack(
        int(bundle_version),
        int(obs_dim),
        int(act_dim),
        float("nan") if control_period_s is None else float(control_period_s),
        bytes.fromhex(names_sha256) if names_sha256 else bytes(32),
        STATE_KIND_CODES[state_kind],
        int(state_length),
        int(blind_horizon),
    )


def encode_contract_reply(
    seq: int, timestamp_us: int, payload: bytes, key: bytes | None = None, client_id: int = 0
) -> bytes:
    """Frame a contract reply around `contract_payload(...)`."""
    return _frame(MsgType.CONTRACT_REPLY, seq, timestamp_us, payload, key, client_id)


def encode_act_reply(
    seq: int,
    timestamp_us: int,
    status: int,
    latency_us: int,
    bundle_version: int,
    action,
    key: bytes | None = None,
    client_id: int = 0,
) -> bytes:
    """Frame an act reply (the server builds the same bytes on its hot path)."""
    act_b = _floats(action)
    payload = ACT_REPLY_HEAD.pack(int(status), int(latency_us), int(bundle_version), len(act_b) // 4, 0) + act_b
    return _frame(MsgType.ACT_REPLY, seq, timestamp_us, payload, key, client_id)


def encode_status_reply(
    seq: int,
    timestamp_us: int,
    bundle_version: int,
    uptime_us: int,
    counters: dict[str, int],
    histogram,
    key: bytes | None = None,
    client_id: int = 0,
) -> bytes:
    """Frame a status reply: fixed binary counters and latency histogram."""
    hist = np.asarray(histogram, dtype="<u8").reshape(-1)
    payload = (
        STATUS_REPLY_HEAD.pack(int(bundle_version), int(uptime_us), len(COUNTER_NAMES), len(hist))
        + struct.pack(f"<{len(COUNTER_NAMES)}Q", *(int(counters[n]) for n in COUNTER_NAMES))
        + hist.tobytes()
    )
    return _frame(MsgType.STATUS_REPLY, seq, timestamp_us, payload, key, client_id)


@dataclass(frozen=True)
class Header:
    """A decoded 32-byte header."""

    magic: bytes
    version: int
    msg_type: int
    flags: int
    seq: int
    timestamp_us: int
    payload_len: int
    client_id: int


def decode_header(data: bytes) -> Header:
    """Decode the first 32 bytes; raises PacketError when shorter."""
    if len(data) < HEADER_SIZE:
        raise PacketError(f"datagram of {len(data)} bytes is shorter than the {HEADER_SIZE}-byte header")
    return Header(*HEADER.unpack_from(data))


def open_frame(data: bytes, expected_type: MsgType, key: bytes | None = None) -> tuple[Header, memoryview]:
    """Check type, magic, version, flags, length and (with `key`, the PSK) the MAC; return header and payload.

    The MAC is checked with the key of `expected_type`'s direction, so a frame of the
    other direction never verifies, whatever its type byte says.
    """
    head = decode_header(data)
    if head.msg_type != expected_type:
        raise PacketError(f"message type {head.msg_type}, expected {int(expected_type)}")
    if head.magic != MAGIC or head.version != PROTOCOL_VERSION:
        raise PacketError(f"bad magic {head.magic!r} or version {head.version}")
    if head.flags & Flags.RESERVED:
        raise PacketError(f"reserved flag bits set (flags 0x{head.flags:04x})")
    has_mac = bool(head.flags & Flags.HMAC)
    if key is not None:
        if not has_mac or len(data) < HEADER_SIZE + MAC_SIZE:
            raise PacketError("frame is not signed", Status.AUTH_FAILED)
        mac = sign(direction_key(key, _direction(int(expected_type))), data[:-MAC_SIZE])
        if not hmac.compare_digest(mac, data[-MAC_SIZE:]):
            raise PacketError("bad MAC", Status.AUTH_FAILED)
    elif has_mac:
        raise PacketError("frame is signed but no key is configured", Status.AUTH_FAILED)
    if HEADER_SIZE + head.payload_len + (MAC_SIZE if has_mac else 0) != len(data):
        raise PacketError(f"payload_len {head.payload_len} does not match the datagram's {len(data)} bytes")
    return head, memoryview(data)[HEADER_SIZE : HEADER_SIZE + head.payload_len]


@dataclass(frozen=True)
class ActRequest:
    """A decoded act request."""

    seq: int
    timestamp_us: int
    obs: np.ndarray
    legacy_action: np.ndarray | None


@dataclass(frozen=True)
class Reply:
    """A decoded act reply: the action to apply and why."""

    seq: int
    timestamp_us: int
    status: Status
    latency_us: int
    bundle_version: int
    action: np.ndarray
    client_id: int = 0  # echoed from the request: a client takes only replies to its own id and seq

    @property
    def ok(self) -> bool:
        """True when the action came from the (shielded) policy or, in shadow mode, the legacy action."""
        return not (self.status & ALARM_BITS)


@dataclass(frozen=True)
class ServerStatus:
    """A decoded status reply."""

    seq: int
    bundle_version: int
    uptime_us: int
    counters: dict[str, int]
    histogram: np.ndarray = field(repr=False)
    client_id: int = 0


@dataclass(frozen=True)
class ServedContract:
    """A decoded contract reply: what the served bundle expects of the plant."""

    seq: int
    bundle_version: int
    obs_dim: int
    act_dim: int
    control_period_s: float  # NaN when the bundle does not state it
    names_sha256: str  # hex; "" for a bundle without a contract (schema 1)
    state_kind: str
    state_length: int
    client_id: int = 0
    # Blind steps (Flags.OBS_MISSING) in a row the shield's guarantee covers; past them a reply carries
    # Status.BLIND_PAST_HORIZON. 0 from a server older than the field (then no blind step is covered).
    blind_horizon: int = 0


def decode_contract_reply(data: bytes, key: bytes | None = None) -> ServedContract:
    """Decode a contract reply; with a key, an unsigned or forged one raises."""
    head, payload = open_frame(data, MsgType.CONTRACT_REPLY, key)
    if len(payload) != CONTRACT_REPLY.size:
        raise PacketError(f"contract payload of {len(payload)} bytes, expected {CONTRACT_REPLY.size}")
    version, n_obs, n_act, period, digest, kind, length, horizon = CONTRACT_REPLY.unpack(payload)
    kinds = {code: name for name, code in STATE_KIND_CODES.items()}
    if kind not in kinds:
        raise PacketError(f"unknown policy state kind {kind}")
    names = digest.hex() if any(digest) else ""
    return ServedContract(
        head.seq, version, n_obs, n_act, period, names, kinds[kind], length, head.client_id, blind_horizon=horizon
    )


@dataclass(frozen=True)
class PlantEstimate:
    """A decoded estimate reply: the domain parameters the policy believes the requesting plant has."""

    seq: int
    bundle_version: int
    values: np.ndarray  # float32[n], the contract's plant_estimate.parameters order; empty: no estimate
    steps: int  # steps the plant's policy state has seen since it last started (a few: mostly the prior)
    client_id: int = 0


def decode_estimate_reply(data: bytes, key: bytes | None = None) -> PlantEstimate:
    """Decode a plant estimate reply; with a key, an unsigned or forged one raises."""
    head, payload = open_frame(data, MsgType.ESTIMATE_REPLY, key)
    if len(payload) < ESTIMATE_REPLY_HEAD.size:
        raise PacketError(f"estimate payload of {len(payload)} bytes is shorter than its head")
    version, n, _, steps = ESTIMATE_REPLY_HEAD.unpack_from(payload)
    if len(payload) != ESTIMATE_REPLY_HEAD.size + 4 * n:
        raise PacketError(f"estimate payload of {len(payload)} bytes does not hold {n} float32")
    values = np.frombuffer(payload, dtype="<f4", offset=ESTIMATE_REPLY_HEAD.size).astype(np.float32)
    return PlantEstimate(head.seq, version, values, steps, head.client_id)


def decode_act_request(data: bytes, key: bytes | None = None) -> ActRequest:
    """Decode and check an act request (dims are checked by the server, which knows them)."""
    head, payload = open_frame(data, MsgType.ACT_REQUEST, key)
    if len(payload) < ACT_REQUEST_HEAD.size:
        raise PacketError("act request payload is shorter than its 4-byte head")
    n_obs, n_leg = ACT_REQUEST_HEAD.unpack_from(payload)
    if len(payload) != ACT_REQUEST_HEAD.size + 4 * (n_obs + n_leg):
        raise PacketError(f"payload of {len(payload)} bytes does not hold {n_obs}+{n_leg} float32")
    floats = np.frombuffer(payload, dtype="<f4", offset=ACT_REQUEST_HEAD.size)
    return ActRequest(head.seq, head.timestamp_us, floats[:n_obs], floats[n_obs:] if n_leg else None)


def decode_act_reply(data: bytes, key: bytes | None = None) -> Reply:
    """Decode and check an act reply; with a key, an unsigned or forged reply raises."""
    head, payload = open_frame(data, MsgType.ACT_REPLY, key)
    if len(payload) < ACT_REPLY_HEAD.size:
        raise PacketError("act reply payload is shorter than its 16-byte head")
    status, latency, version, n_act, _ = ACT_REPLY_HEAD.unpack_from(payload)
    if len(payload) != ACT_REPLY_HEAD.size + 4 * n_act:
        raise PacketError(f"reply payload of {len(payload)} bytes does not hold {n_act} float32")
    action = np.frombuffer(payload, dtype="<f4", offset=ACT_REPLY_HEAD.size).astype(np.float32)
    return Reply(head.seq, head.timestamp_us, Status(status), latency, version, action, head.client_id)


def decode_status_reply(data: bytes, key: bytes | None = None) -> ServerStatus:
    """Decode a status reply into named counters and the latency histogram."""
    head, payload = open_frame(data, MsgType.STATUS_REPLY, key)
    version, uptime, n_counters, n_bins = STATUS_REPLY_HEAD.unpack_from(payload)
    need = STATUS_REPLY_HEAD.size + 8 * (n_counters + n_bins)
    if len(payload) != need:
        raise PacketError(f"status payload of {len(payload)} bytes, expected {need}")
    values = np.frombuffer(payload, dtype="<u8", offset=STATUS_REPLY_HEAD.size)
    # A reader takes the counters it knows and ignores extra ones; one it knows that an
    # older server does not send is absent from the dict.
    counters = {name: int(values[i]) for i, name in enumerate(COUNTER_NAMES[:n_counters])}
    return ServerStatus(head.seq, version, uptime, counters, values[n_counters:].astype(np.int64), head.client_id)
