"""Byte-exact frames (built by hand from docs/reference/protocol.md) and how the server classifies every packet."""

from __future__ import annotations

import hashlib
import hmac
import struct
import time

import numpy as np
import pytest

from shield.protocol import (
    COUNTER_NAMES,
    LATENCY_BINS,
    MsgType,
    PacketError,
    Status,
    decode_act_reply,
    decode_act_request,
    decode_status_reply,
    encode_act_reply,
    encode_act_request,
    encode_status_request,
    latency_bin,
)
from shield.runtime import EdgeRuntime
from shield.server import PolicyServer
from tests.helpers.serve_bundles import write_tiny_bundle

KEY = b"0123456789abcdef0123456789abcdef"
REQUEST_KEY = hmac.new(KEY, b"S2RP v2 request", hashlib.sha256).digest()  # README: keys per direction
REPLY_KEY = hmac.new(KEY, b"S2RP v2 reply", hashlib.sha256).digest()
OBS = np.array([-1.0, 1.0, 0.1, 3.0e-3], np.float32)  # far from every constraint: the shield stays out
ADDR = ("127.0.0.1", 40000)


def doc_header(msg_type: int, flags: int, seq: int, ts: int, payload_len: int, client_id: int = 0) -> bytes:
    """The 32-byte header exactly as the table in README.md, "Wire protocol" lays it out."""
    return (
        b"S2RP"
        + bytes([2, msg_type])
        + flags.to_bytes(2, "little")
        + seq.to_bytes(8, "little")
        + ts.to_bytes(8, "little")
        + payload_len.to_bytes(4, "little")
        + client_id.to_bytes(4, "little")
    )


def test_act_request_is_byte_exact():
    legacy = np.array([0.5, -1.0], np.float32)
    payload = struct.pack("<HH", 4, 2) + struct.pack("<4f", *OBS) + struct.pack("<2f", *legacy)
    frame = doc_header(1, 0, 7, 123456, len(payload), 99) + payload
    assert encode_act_request(7, 123456, OBS, legacy, client_id=99) == frame
    assert len(frame) == 32 + 4 + 24
    signed = doc_header(1, 1, 7, 123456, len(payload), 99) + payload
    signed += hmac.new(REQUEST_KEY, signed, hashlib.sha256).digest()
    assert encode_act_request(7, 123456, OBS, legacy, key=KEY, client_id=99) == signed
    req = decode_act_request(signed, KEY)
    assert (req.seq, req.timestamp_us) == (7, 123456)
    assert req.obs.tobytes() == OBS.tobytes() and req.legacy_action.tobytes() == legacy.tobytes()


def test_act_reply_and_status_request_are_byte_exact():
    action = np.array([0.125, -0.75], np.float32)
    status = Status.INTERVENED | Status.STALE
    payload = struct.pack("<IIIHH", int(status), 42, 3, 2, 0) + struct.pack("<2f", *action)
    frame = doc_header(2, 0, 9, 55, len(payload), 5) + payload
    assert encode_act_reply(9, 55, status, 42, 3, action, client_id=5) == frame
    reply = decode_act_reply(frame)
    assert (reply.seq, reply.timestamp_us, reply.status) == (9, 55, status)
    assert (reply.latency_us, reply.bundle_version) == (42, 3)
    assert reply.action.tobytes() == action.tobytes()
    assert encode_status_request(11, 12) == doc_header(3, 0, 11, 12, 480) + bytes(480)  # padded: no amplification
    signed_reply = frame[:6] + b"\x01\x00" + frame[8:]
    signed_reply += hmac.new(REPLY_KEY, signed_reply, hashlib.sha256).digest()
    assert encode_act_reply(9, 55, status, 42, 3, action, key=KEY, client_id=5) == signed_reply
    # Status bits are the documented powers of two.
    assert [
        int(s)
        for s in (
            Status.INTERVENED,
            Status.FALLBACK,
            Status.BAD_INPUT,
            Status.AUTH_FAILED,
            Status.SHADOW,
            Status.STALE,
            Status.DEADLINE,
            Status.INFERENCE_ERROR,
            Status.ENVELOPE,
        )
    ] == [1 << i for i in range(9)]


def test_reply_decoding_refuses_forged_and_truncated_frames():
    frame = encode_act_reply(1, 2, 0, 3, 4, [0.5, 0.5], key=KEY)
    assert decode_act_reply(frame, KEY).action.tolist() == [0.5, 0.5]
    forged = frame[:-1] + bytes([frame[-1] ^ 1])
    with pytest.raises(PacketError) as err:
        decode_act_reply(forged, KEY)
    assert err.value.status == Status.AUTH_FAILED
    with pytest.raises(PacketError):
        decode_act_reply(encode_act_reply(1, 2, 0, 3, 4, [0.5, 0.5]), KEY)  # unsigned reply to a keyed client
    with pytest.raises(PacketError):
        decode_act_reply(frame[:20])
    with pytest.raises(PacketError) as err:  # a signed request is not a reply, whatever its type byte says
        request = encode_act_request(1, 2, [0.5, 0.5], key=KEY)
        decode_act_reply(request[:5] + bytes([2]) + request[6:], KEY)
    assert err.value.status == Status.AUTH_FAILED
    with pytest.raises(PacketError):  # reserved flag bits are refused
        decode_act_reply(frame[:6] + b"\x03\x00" + frame[8:], KEY)


def test_latency_bins_are_log2_microseconds():
    assert [latency_bin(x) for x in (0, 0.5, 1, 1.9, 2, 3, 4, 1000, 1e9)] == [0, 0, 1, 1, 2, 2, 3, 10, LATENCY_BINS - 1]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return write_tiny_bundle(tmp_path_factory.mktemp("b") / "bundle", seed=3, version=5)


def _server(bundle, **kw) -> PolicyServer:
    kw.setdefault("deadline_us", 1e7)  # a loaded CI machine must not turn these into deadline misses
    server = PolicyServer(EdgeRuntime.load(bundle), **kw)
    server.sock.close()  # these tests call handle() directly; no traffic
    return server


def test_server_answers_or_drops_exactly_as_documented(bundle):
    server = _server(bundle)
    reference = EdgeRuntime.load(bundle)
    fallback = np.zeros(2, np.float32)  # the planar spec has no fallback_action: zeros clipped to the box
    good = encode_act_request(1, 10, OBS)
    reply = decode_act_reply(server.handle(good, ADDR))
    assert reply.status == Status.OK and reply.bundle_version == 5
    assert reply.action.tobytes() == reference.act(OBS)[0].tobytes()

    assert server.handle(b"", ADDR) is None and server.handle(good[:31], ADDR) is None  # shorter than a header
    assert server.handle(good[:32], ADDR) is None  # shorter than an act request: a refusal would amplify
    assert server.handle(good[:-1], ADDR) is None and server.handle(encode_act_request(2, 10, OBS[:3]), ADDR) is None
    assert server.handle(good[:5] + b"\x02" + good[6:], ADDR) is None  # a reply is never answered
    assert server.handle(good[:5] + b"\x04" + good[6:], ADDR) is None
    assert server.stats.dropped == 7
    nan_obs = OBS.copy()
    nan_obs[2] = np.nan
    inf_obs = OBS.copy()
    inf_obs[0] = np.inf
    bad = {
        "magic": b"XXXX" + good[4:],
        "version": good[:4] + b"\x01" + good[5:],
        "type": encode_act_request(2, 10, OBS)[:5]
        + b"\x03"
        + encode_act_request(2, 10, OBS)[6:],  # a status request, not padded
        "reserved flag": good[:6] + b"\x08\x00" + good[8:],  # 0x0002 is RESET_STATE, 0x0004 OBS_MISSING
        "payload_len short": good[:24] + (19).to_bytes(4, "little") + good[28:],
        "extra byte": good + b"\x00",
        "payload_len": good[:24] + (999).to_bytes(4, "little") + good[28:],
        "obs dim": encode_act_request(2, 10, np.append(OBS, 0.0)),
        "legacy dim": encode_act_request(2, 10, OBS, [0.1]),
        "nan": encode_act_request(2, 10, nan_obs),
        "inf": encode_act_request(2, 10, inf_obs),
        "stale seq": encode_act_request(1, 10, OBS),  # not newer than this client's last: nothing runs
    }
    calls = server.stats.policy_calls
    for name, frame in bad.items():
        reply = decode_act_reply(server.handle(frame, ADDR))
        assert reply.status & (Status.BAD_INPUT | Status.STALE) and reply.status & Status.FALLBACK, name
        assert reply.action.tobytes() == fallback.tobytes(), name
        assert reply.seq == int.from_bytes(frame[8:16], "little"), name
    assert server.stats.policy_calls == calls, "a bad packet reached the policy"
    assert server.stats.bad_inputs == len(bad) - 1 and server.stats.stale == 1 and server.stats.dropped == 7
    signed = encode_act_request(50, 10, OBS, key=KEY)
    assert decode_act_reply(server.handle(signed, ADDR)).status & Status.AUTH_FAILED  # signed, but no key here


def test_stale_sequence_is_refused_before_the_policy_with_or_without_a_key(bundle):
    server = _server(bundle)
    assert decode_act_reply(server.handle(encode_act_request(10, 0, OBS), ADDR)).status == Status.OK
    late = decode_act_reply(server.handle(encode_act_request(9, 0, OBS), ADDR))
    assert late.status == Status.STALE | Status.FALLBACK and server.stats.policy_calls == 1
    # Without a key the client is (source address, client_id): another sender's seq is its own.
    assert decode_act_reply(server.handle(encode_act_request(9, 0, OBS), ("127.0.0.1", 40001))).status == Status.OK
    keyed = _server(bundle, key=KEY, not_before_us=0)
    now = time.time_ns() // 1000
    frame = encode_act_request(now, 0, OBS, key=KEY, client_id=1)
    assert decode_act_reply(keyed.handle(frame, ADDR), KEY).status == Status.OK
    for addr in (ADDR, ("127.0.0.1", 40001)):  # a replay from any address is a replay
        reply = decode_act_reply(keyed.handle(frame, addr), KEY)
        assert reply.status == Status.STALE | Status.FALLBACK
    assert keyed.stats.policy_calls == 1 and keyed.stats.stale == 2
    # Outside the clock window (either side), or signed with the PSK itself (version 1 style): refused.
    for seq in (now - 5_000_000, now + 5_000_000):
        assert (
            decode_act_reply(keyed.handle(encode_act_request(seq, 0, OBS, key=KEY, client_id=2), ADDR), KEY).status
            == Status.STALE | Status.FALLBACK
        )
    v1_style = encode_act_request(now + 1, 0, OBS, client_id=3)
    v1_style = v1_style[:6] + b"\x01\x00" + v1_style[8:]
    assert keyed.handle(v1_style + hmac.new(KEY, v1_style, hashlib.sha256).digest(), ADDR) is None
    assert keyed.stats.policy_calls == 1 and keyed.stats.auth_failures == 1


def test_status_reply_layout(bundle):
    server = _server(bundle)
    server.handle(encode_act_request(1, 0, OBS), ADDR)
    frame = server.handle(encode_status_request(2, 77), ADDR)
    head = struct.unpack_from("<4sBBHQQII", frame)
    assert head[:6] == (b"S2RP", 2, MsgType.STATUS_REPLY, 0, 2, 77)
    assert len(frame) <= len(encode_status_request(2, 77))  # never larger than the request
    version, uptime, n_counters, n_bins = struct.unpack_from("<IQHH", frame, 32)
    assert (version, n_counters, n_bins) == (5, len(COUNTER_NAMES), LATENCY_BINS)
    assert head[6] == 16 + 8 * (n_counters + n_bins) == len(frame) - 32
    counters = struct.unpack_from(f"<{n_counters}Q", frame, 48)
    assert dict(zip(COUNTER_NAMES, counters))["policy_calls"] == 1
    status = decode_status_reply(frame)
    assert status.counters["requests"] == 2 and status.counters["status_requests"] == 1
    assert int(status.histogram.sum()) == 1
    # An older reader that knows only the first 13 counters reads them unchanged (extra ones are appended).
    assert COUNTER_NAMES[:13] == (
        "requests",
        "answered",
        "dropped",
        "policy_calls",
        "interventions",
        "fallbacks",
        "bad_inputs",
        "auth_failures",
        "stale",
        "deadline_misses",
        "inference_errors",
        "reloads",
        "status_requests",
    )
    assert COUNTER_NAMES[13:19] == (
        "envelope_flags",
        "plants_evicted",
        "plants_refused",
        "state_resets_new_plant",
        "state_resets_requested",
        "state_resets_silence",
    )


def test_runtime_failure_and_deadline_get_the_fallback(bundle, tmp_path):
    class Exploding:
        obs_dim, act_dim = 4, 2

        def act(self, obs):
            raise RuntimeError("onnxruntime fell over")

    server = PolicyServer(Exploding(), deadline_us=1e7)
    server.sock.close()
    reply = decode_act_reply(server.handle(encode_act_request(1, 0, OBS), ADDR))
    assert reply.status == Status.INFERENCE_ERROR | Status.FALLBACK and reply.action.tolist() == [0.0, 0.0]

    class NanPolicy:  # the network produced NaN; the shield caught it and braked
        obs_dim, act_dim = 4, 2

        def act(self, obs):
            info = {"intervened": True, "fallback": True, "bad_input": True}
            return np.array([0.0, -1.0], np.float32), np.full(2, np.nan, np.float32), info

    nan_server = PolicyServer(NanPolicy(), deadline_us=1e7)
    nan_server.sock.close()
    reply = decode_act_reply(nan_server.handle(encode_act_request(1, 0, OBS), ADDR))
    assert reply.status == Status.INTERVENED | Status.FALLBACK | Status.INFERENCE_ERROR
    assert reply.action.tolist() == [0.0, -1.0] and nan_server.stats.inference_errors == 1

    from shield.shadowlog import ShadowLogWriter, read_shadow_log

    log = ShadowLogWriter(tmp_path)
    shadow = PolicyServer(Exploding(), mode="shadow", shadow_log=log, deadline_us=1e7)
    shadow.sock.close()
    legacy = np.array([0.5, -0.25], np.float32)
    reply = decode_act_reply(shadow.handle(encode_act_request(1, 0, OBS, legacy), ADDR))
    assert reply.status == Status.SHADOW and reply.action.tobytes() == legacy.tobytes()  # the plant is unaffected
    log.close()
    cols, _ = read_shadow_log(tmp_path)
    assert cols["fallback"].tolist() == [True] and np.isnan(cols["candidate_action"]).all()
    assert shadow.stats.inference_errors == 1
    # The shield caught the candidate's NaN: in shadow mode that is a failure too, counted (it was not).
    nan_log = ShadowLogWriter(tmp_path / "nan")
    nan_shadow = PolicyServer(NanPolicy(), mode="shadow", shadow_log=nan_log, deadline_us=1e7)
    nan_shadow.sock.close()
    reply = decode_act_reply(nan_shadow.handle(encode_act_request(1, 0, OBS, legacy), ADDR))
    assert reply.status == Status.SHADOW and reply.action.tobytes() == legacy.tobytes()
    assert nan_shadow.stats.inference_errors == 1
    nan_log.close()
    slow = _server(bundle, deadline_us=0.0)  # every request overruns a zero deadline
    reply = decode_act_reply(slow.handle(encode_act_request(1, 0, OBS), ADDR))
    assert reply.status == Status.DEADLINE | Status.FALLBACK and slow.stats.deadline_misses == 1
    slow_nan = PolicyServer(NanPolicy(), deadline_us=0.0)  # late and the policy's output non-finite: both said
    slow_nan.sock.close()
    reply = decode_act_reply(slow_nan.handle(encode_act_request(1, 0, OBS), ADDR))
    assert reply.status == Status.DEADLINE | Status.FALLBACK | Status.INFERENCE_ERROR
    assert slow_nan.stats.inference_errors == 1 and reply.action.tolist() == [0.0, 0.0]


def test_the_example_frame_in_the_docs_is_what_the_encoder_writes():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "protocol.md").read_text()
    example = text.split("client_id 99, no key: 52 bytes,")[1].split("`")[1]
    expected = encode_act_request(7, 123456, [0.25, -0.5, 1.0, 0.003], client_id=99)
    assert bytes.fromhex(example.replace(" ", "")) == expected
    trailer = text.split("flags `0100`, then the trailer")[1].split("`")[1]
    signed = encode_act_request(
        7, 123456, [0.25, -0.5, 1.0, 0.003], key=b"0123456789abcdef0123456789abcdef", client_id=99
    )
    assert signed[6:8] == b"\x01\x00" and bytes.fromhex(trailer) == signed[-32:] and len(signed) == 84


def test_the_serve_counters_are_the_protocol_s_counters_in_order():
    from shield.served import ServeStats

    assert tuple(ServeStats.__annotations__) == COUNTER_NAMES


def test_the_serve_summary_quotes_no_latency_before_an_answer():
    from shield.served import ServeStats

    stats = ServeStats()
    assert stats.summary() == "stats: no requests"  # was "latency_p50<=nanus"
    stats.requests, stats.answered = 1, 1
    stats.histogram[5] += 1  # one reply in the 16-32 us bin
    assert stats.summary() == "stats: requests=1 answered=1 latency_p50<=32us p99<=32us"


def test_a_late_step_holds_a_set_point_action_where_it_was(tmp_path):
    """A set-point action (`fallback_hold`, a position servo's) gets the last action this plant was sent on a late
    or failed step, not the constant, which is a command to move there; the other action keeps the constant."""
    from tests.helpers.shield_specs import planar_double_integrator

    spec = planar_double_integrator()
    spec.update(task="planar", fallback_hold=[True, False])
    server = _server(write_tiny_bundle(tmp_path / "servo", seed=3, spec=spec))
    first = decode_act_reply(server.handle(encode_act_request(1, 10, OBS), ADDR))
    assert first.status & Status.FALLBACK == 0 and first.action[0] != 0.0
    server.deadline_ns = 0  # every step from here on is late
    late = decode_act_reply(server.handle(encode_act_request(2, 20, OBS), ADDR))
    assert late.status & Status.DEADLINE and late.status & Status.FALLBACK
    assert late.action.tolist() == [first.action[0], 0.0]
    other = decode_act_reply(server.handle(encode_act_request(1, 10, OBS), ("127.0.0.1", 40001)))  # a new plant
    assert other.action.tolist() == [0.0, 0.0]
    # A refused request of a plant with a session holds its set-point too: a NaN reading (BAD_INPUT) and a replayed
    # seq (STALE) were answered with the constant, a command to move the servo there.
    for request in (encode_act_request(3, 30, [np.nan] + list(OBS[1:])), encode_act_request(2, 20, OBS)):
        refused = decode_act_reply(server.handle(request, ADDR))
        assert refused.status & (Status.BAD_INPUT | Status.STALE) and refused.status & Status.FALLBACK
        assert refused.action.tolist() == [first.action[0], 0.0]
    stranger = decode_act_reply(server.handle(encode_act_request(2, 20, [np.nan] * len(OBS)), ("127.0.0.1", 40002)))
    assert stranger.status & Status.BAD_INPUT and stranger.action.tolist() == [0.0, 0.0]  # no session: the constant


def test_a_shadow_log_stamps_rows_forward_when_the_wall_clock_steps_back(tmp_path, monkeypatch):
    """Rows a server logs in shadow mode carry t from the writer's clock: wall time at start plus monotonic time since,
    so an NTP step backwards mid-recording leaves the log's t increasing (calibrate refuses a log whose t runs back),
    and still near wall time."""
    import time

    from shield.shadowlog import ShadowLogWriter, read_shadow_log

    class Hold:
        obs_dim, act_dim = 4, 2

        def act(self, obs):
            return np.zeros(2, np.float32), {"intervened": False, "fallback": False}

    log = ShadowLogWriter(tmp_path)
    shadow = PolicyServer(Hold(), mode="shadow", shadow_log=log, deadline_us=1e7)
    shadow.sock.close()
    legacy = np.array([0.5, -0.25], np.float32)
    start = time.time()
    for step in range(3):
        if step == 2:
            monkeypatch.setattr(time, "time", lambda: start - 3600.0)  # the wall clock stepped back an hour
        shadow.handle(encode_act_request(step + 1, step, OBS, legacy), ADDR)
    log.close()
    t = read_shadow_log(tmp_path)[0]["t"]
    assert len(t) == 3 and bool(np.all(np.diff(t) > 0.0)), t
    assert abs(float(t[0]) - start) < 60.0
