"""Fuzz a running `serve` subprocess with >= 100,000 random and mutated datagrams.

Every datagram is classified independently here, from the README's "Wire protocol" alone:
shorter than the header -> dropped; otherwise answered, with the policy's action
only if the request is fully valid, else the fallback action and a rejection bit.
Replies come back in send order (one socket, one serving thread), so each one is
checked against its own datagram. Valid requests from a second client are
interleaved and must be answered exactly as the in-process runtime answers them.
"""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest

from shield.client import PolicyClient
from shield.protocol import (
    MsgType,
    Status,
    decode_act_reply,
    decode_contract_reply,
    decode_estimate_reply,
    decode_status_reply,
    encode_act_request,
    encode_contract_request,
    encode_estimate_request,
    encode_status_request,
)
from shield.runtime import EdgeRuntime
from tests.helpers.serve_bundles import ServerProcess, write_key_file, write_tiny_bundle

pytestmark = pytest.mark.timeout(240)  # a hung server fails the test instead of the CI job

N_PACKETS = 100_032  # 1563 bursts of 64
BURST = 64  # in-flight bound: the socket buffers never overflow, so nothing is lost to the kernel
REJECTED = Status.BAD_INPUT | Status.AUTH_FAILED | Status.STALE | Status.INFERENCE_ERROR


class Classifier:
    """What the README's "Wire protocol" says happens to each datagram at a server without a key, in order.

    Stateful like the server: a request is fresh when its seq is above the last accepted act request of
    its client (this sender's address and the header's client_id); only accepted act requests count (a status,
    contract or estimate request, unauthenticated, moves nothing).
    """

    MIN_ANSWERED = 32 + 4 + 4 * 4  # a refusal is sent only to a datagram as long as a valid act request

    def __init__(self):
        self.last: dict[int, int] = {}

    def __call__(self, pkt: bytes) -> str:
        if len(pkt) < 32 or pkt[5] not in (1, 3, 5, 7):
            return "drop"
        refuse = "reject" if len(pkt) >= self.MIN_ANSWERED else "drop"
        magic, version, msg_type, flags, seq, _, payload_len, client_id = struct.unpack_from("<4sBBHQQII", pkt)
        if flags & ~0x0006 or magic != b"S2RP" or version != 2 or payload_len != len(pkt) - 32:
            return refuse
        blind = flags & 0x0004  # OBS_MISSING: act requests only, the observation's values ignored
        if blind and msg_type != 1:
            return refuse
        if client_id in self.last and seq <= self.last[client_id]:
            return refuse
        if msg_type == 3:
            if payload_len < 480:
                return refuse
            return "status"
        if msg_type == 5:
            if payload_len < 56:
                return refuse
            return "contract"
        if msg_type == 7:
            if payload_len < 204:
                return refuse
            return "estimate"
        if payload_len < 4:
            return refuse
        n_obs, n_legacy = struct.unpack_from("<HH", pkt, 32)
        if n_obs != 4 or n_legacy not in (0, 2) or payload_len != 4 + 4 * (n_obs + n_legacy):
            return refuse
        checked = pkt[36 + 4 * n_obs :] if blind else pkt[36:]  # blind: the legacy action only
        if not np.isfinite(np.frombuffer(checked, "<f4")).all():
            return refuse
        self.last[client_id] = seq
        return "blind" if blind else "policy"


def fuzz_packets(rng: np.random.Generator, n: int) -> list[bytes]:
    """Random and mutated datagrams, a mix of every way a packet can be wrong (and some right)."""
    # Draw everything up front: per-packet generator calls would dominate the test's time.
    # Mostly increasing (fresh), sometimes behind the last accepted one (stale): both paths are exercised.
    seqs = np.arange(n, dtype=np.int64) * 1000 + rng.integers(0, 1500, n)
    obs_all = rng.normal(0, 1, (n, 4)).astype(np.float32)
    legacy_all = rng.uniform(-1, 1, (n, 2)).astype(np.float32)
    u = rng.random((n, 3))
    k = rng.integers(0, 2**31, (n, 6))
    blob = rng.bytes(n * 64)
    bits = rng.integers(0, 2**32, (n, 4), dtype=np.uint64).astype(np.uint32).view(np.float32)
    specials = np.array([np.nan, np.inf, -np.inf], np.float32)
    fields = [(4, 1), (5, 1), (6, 2), (24, 4), (32, 2), (34, 2)]
    out = []
    for i in range(n):
        seq, obs = int(seqs[i]), obs_all[i]
        legacy = legacy_all[i] if u[i, 0] < 0.3 else None
        rand = blob[64 * i : 64 * (i + 1)]
        if u[i, 1] < 0.8:
            base = encode_act_request(seq, i, obs, legacy)
        else:
            asks = (encode_status_request, encode_contract_request, encode_estimate_request)
            base = asks[min(2, int((u[i, 1] - 0.8) / 0.2 * 3))](seq, i)
        kind = int(k[i, 0] % 10)
        if kind == 0:
            pkt = rand[: k[i, 1] % 65]
        elif kind == 1:
            b = bytearray(base)
            for j in range(1 + k[i, 1] % 3):
                pos = k[i, 2 + j] % len(b)
                # Not the seq: one mutated high seq byte would make every later packet stale (that path
                # is exercised by the seqs themselves, drawn to run behind now and then).
                b[pos + 8 if 8 <= pos < 16 else pos] = rand[j]
            pkt = bytes(b)
        elif kind == 2:
            pkt = base[: k[i, 1] % len(base)]
        elif kind == 3:
            pkt = base + rand[: 1 + k[i, 1] % 63]
        elif kind == 4:  # one header or payload-head field set to a random value
            off, width = fields[k[i, 1] % len(fields)]
            pkt = base[:off] + rand[:width] + base[off + width :] if off < len(base) else base
        elif kind == 5:  # non-finite observation; half of them flagged missing (a blind step)
            bad = obs.copy()
            bad[k[i, 1] % 4] = specials[k[i, 2] % 3]
            pkt = encode_act_request(seq, i, bad, legacy, obs_missing=bool(k[i, 3] % 2))
        elif kind == 6:  # arbitrary float32 bit patterns: huge, tiny, NaN payloads
            pkt = encode_act_request(seq, i, bits[i])
        elif kind == 7:
            pkt = rand * (1 + k[i, 1] % 30)  # 64..1920 bytes of noise
        elif kind == 8:
            pkt = base
        else:
            pkt = rand[: k[i, 1] % 32]
        out.append(pkt)
    return out


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return write_tiny_bundle(tmp_path_factory.mktemp("fuzz") / "bundle", seed=21, version=2)


def test_fuzz_server_stays_up_and_answers_exactly_as_documented(bundle):
    reference = EdgeRuntime.load(bundle)
    fallback = np.zeros(2, np.float32).tobytes()
    rng = np.random.default_rng(1234)
    counts = {"drop": 0, "reject": 0, "status": 0, "contract": 0, "estimate": 0, "policy": 0, "blind": 0}
    valid_sent = 0
    # Room for every client id the mutations make up: no new plant is refused BUSY (which depends on timing,
    # and this model has no clock; tests/shield/test_serve_attacks.py covers it).
    with ServerProcess(str(bundle), "--deadline-us", "1e7", "--max-plants", "100000") as server:
        fuzz = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        fuzz.settimeout(5.0)
        plant = PolicyClient(server.host, server.port, timeout_s=5.0)
        packets = fuzz_packets(rng, N_PACKETS)
        classify = Classifier()
        for start in range(0, N_PACKETS, BURST):
            burst = packets[start : start + BURST]
            kinds = [classify(p) for p in burst]
            for p in burst:
                fuzz.sendto(p, (server.host, server.port))
            obs = rng.uniform(-1.5, 1.5, 4).astype(np.float32)
            reply = plant.act(obs)  # the plant's own request, between fuzzed ones, answered exactly
            assert reply.status == Status.OK or not reply.status & REJECTED
            assert reply.action.tobytes() == reference.act(obs)[0].tobytes()
            valid_sent += 1
            for pkt, kind in zip(burst, kinds):
                counts[kind] += 1
                if kind == "drop":
                    continue
                data = fuzz.recv(4096)
                seq, ts = struct.unpack_from("<QQ", pkt, 8)
                if kind == "status":
                    assert data[5] == MsgType.STATUS_REPLY and decode_status_reply(data).seq == seq
                    continue
                if kind == "contract":
                    assert data[5] == MsgType.CONTRACT_REPLY and decode_contract_reply(data).seq == seq
                    continue
                if kind == "estimate":  # a memoryless bundle: an empty estimate
                    got_estimate = decode_estimate_reply(data)
                    assert data[5] == MsgType.ESTIMATE_REPLY and got_estimate.seq == seq, pkt
                    assert got_estimate.values.size == 0, pkt
                    continue
                got = decode_act_reply(data)
                assert (got.seq, got.timestamp_us) == (seq, ts)
                if kind == "reject":
                    assert got.status & REJECTED and got.status & Status.FALLBACK, pkt
                    assert got.action.tobytes() == fallback
                elif kind == "blind":  # dead-reckoned in this sender's session, which the reference does not share
                    assert got.status & Status.BLIND and got.status & Status.FALLBACK, pkt
                    assert not got.status & REJECTED and np.isfinite(got.action).all(), pkt
                else:
                    safe = reference.act(np.frombuffer(pkt, "<f4", 4, 36))[0]
                    if np.isfinite(safe).all():
                        assert got.action.tobytes() == safe.tobytes(), pkt
                    else:
                        assert got.status & Status.INFERENCE_ERROR and got.action.tobytes() == fallback
        assert server.proc.poll() is None, "the server died"
        stats = plant.status().counters
        plant.close()
        fuzz.close()
        text = server.stop()
    total = sum(counts.values())
    assert total == N_PACKETS and min(counts.values()) > 1000, counts
    assert stats["requests"] == total + valid_sent + 1
    assert stats["dropped"] == counts["drop"]
    assert stats["policy_calls"] == counts["policy"] + counts["blind"] + valid_sent, "a rejected packet was served"
    assert stats["blind_steps"] == counts["blind"]
    assert stats["status_requests"] == counts["status"] + 1
    assert stats["contract_requests"] == counts["contract"]
    assert stats["estimate_requests"] == counts["estimate"]
    assert "Traceback" not in text and "internal error" not in text


def test_fuzz_with_a_key_nothing_unsigned_is_answered_or_reaches_the_policy(bundle, tmp_path):
    import hashlib
    import hmac as hmac_mod

    key = b"fuzz-test-pre-shared-key-0123456789"
    write_key_file(tmp_path / "psk", key)
    rng = np.random.default_rng(99)
    packets = fuzz_packets(rng, 20_032)
    # Also packets signed with the wrong key, with the PSK itself (version 1's scheme) and with the reply key.
    reply_key = hmac_mod.new(key, b"S2RP v2 reply", hashlib.sha256).digest()
    for k in (b"w" * 32, key, reply_key):
        packets += [p + hmac_mod.new(k, p, hashlib.sha256).digest() for p in packets[:2000]]
    checked = sum(1 for p in packets if len(p) >= 32 and p[5] in (1, 3, 5, 7))
    with ServerProcess(str(bundle), "--key-file", str(tmp_path / "psk"), "--deadline-us", "1e7") as server:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        plant = PolicyClient(server.host, server.port, key=key, timeout_s=5.0)
        for start in range(0, len(packets), BURST):
            for p in packets[start : start + BURST]:
                sock.sendto(p, (server.host, server.port))
            plant.status()  # paces the bursts: the server has read everything sent before
        stats = plant.status().counters
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(4096)  # not one reply to an unauthenticated datagram
        plant.close()
        sock.close()
        server.stop()
    assert stats["policy_calls"] == 0 and stats["answered"] == stats["status_requests"]
    assert stats["auth_failures"] == checked > 15_000
    assert stats["dropped"] == len(packets)
