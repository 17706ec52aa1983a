"""Properties of the serving state machine, for every datagram, and the Prometheus endpoint over real HTTP.

State is everything that decides a later reply: the sequence guard, the plant sessions
(their shields' prediction buffers) and the counters that say the policy ran. A datagram
that is not authenticated (keyed server) or is malformed or stale (open server) changes none of it;
a keyed server spends an authenticated fresh request's seq whatever the answer
(tests/shield/test_serve_attacks.py), and nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from shield.client import PolicyClient
from shield.protocol import encode_act_request, encode_status_request
from shield.runtime import EdgeRuntime
from shield.server import PolicyServer
from tests.helpers.serve_bundles import ServerProcess, write_tiny_bundle

KEY = b"property-test-pre-shared-key-0123456789"
ADDR = ("127.0.0.1", 40000)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    bundle = write_tiny_bundle(tmp_path_factory.mktemp("prop") / "bundle", seed=4, version=1, latency_steps=2)
    made = {}
    for name, key in (("open", None), ("keyed", KEY)):
        server = PolicyServer(EdgeRuntime.load(bundle), key=key, deadline_us=1e9, not_before_us=0)
        server.sock.close()  # handle() only
        now = time.time_ns() // 1000
        for cid in (1, 2):  # two plants with a history: their state is what must not move
            for i in range(3):
                frame = encode_act_request(now + i, 0, [0.5 * cid, -0.3, 0.2, 0.1], key=key, client_id=cid)
                assert server.handle(frame, ADDR) is not None
        made[name] = server
    return made


def authentic(data: bytes) -> bool:
    """True when `data` carries a valid request MAC (README: HMAC-SHA256 with the request-direction key)."""
    request_key = hmac.new(KEY, b"S2RP v2 request", hashlib.sha256).digest()
    return len(data) >= 64 and hmac.compare_digest(
        hmac.new(request_key, data[:-32], hashlib.sha256).digest(), data[-32:]
    )


def state(server: PolicyServer) -> tuple:
    sessions = tuple(
        (client, s.shield._predictor.v.tobytes(), s.shield._predictor.has_state)
        for client, s in server.plants.sessions.items()
    )
    return server.guard.snapshot(), sessions, server.stats.policy_calls, server.stats.status_requests


def valid_frames(key: bytes | None) -> st.SearchStrategy[bytes]:
    now = time.time_ns() // 1000
    obs = st.lists(st.floats(-3, 3, width=32), min_size=4, max_size=4)
    act = st.builds(
        lambda o, s, c: encode_act_request(now - s, 0, o, key=key, client_id=c),
        obs,
        st.integers(0, 10**6),
        st.sampled_from([1, 2, 3]),
    )
    status = st.builds(
        lambda s, c: encode_status_request(now - s, 0, key=key, client_id=c),
        st.integers(0, 10**6),
        st.sampled_from([1, 2]),
    )
    return st.one_of(act, status)


@st.composite
def mutated(draw, key: bytes | None) -> bytes:
    frame = bytearray(draw(valid_frames(key)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "grow", "set"]))
        if op == "flip" and frame:
            i = draw(st.integers(0, len(frame) - 1))
            frame[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut" and frame:
            del frame[draw(st.integers(0, len(frame) - 1)) :]
        elif op == "grow":
            frame += draw(st.binary(min_size=1, max_size=16))
        elif op == "set" and len(frame) > 8:
            i = draw(st.integers(4, len(frame) - 1))
            frame[i] = draw(st.integers(0, 255))
    return bytes(frame)


def datagrams(key: bytes | None) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=600), mutated(key))


@settings(
    max_examples=800, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=datagrams(KEY))
def test_keyed_no_unauthenticated_datagram_changes_any_state_or_is_answered(servers, data):
    assume(not authentic(data))  # a mutation that changed nothing is still the key holder's frame
    server = servers["keyed"]
    before = state(server)
    reply = server.handle(data, ADDR)
    assert reply is None, "an unauthenticated datagram was answered"
    assert state(server) == before


@settings(
    max_examples=800, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=datagrams(None))
def test_open_server_a_refused_datagram_changes_no_state(servers, data):
    """Without a key: a datagram dropped or refused (malformed, stale) leaves every state as it was."""
    server = servers["open"]
    before = state(server)
    reply = server.handle(data, ADDR)
    after = state(server)
    accepted = after[2] > before[2] or after[3] > before[3]
    if not accepted:
        assert after == before
    else:  # accepted: only its own client moved, and only forward
        assert reply is not None


LEGACY_BOUND = 0.3  # no float32 is 0.3: float32(0.3) lies 1.2e-8 outside the box
EDGES = [
    float(v)
    for b in (LEGACY_BOUND, -LEGACY_BOUND)
    for v in (np.float32(b), np.nextafter(np.float32(b), np.float32(0)), np.nextafter(np.float32(b), np.float32(2 * b)))
]


@pytest.fixture(scope="module")
def shadow_server(tmp_path_factory):
    from shield.shadowlog import ShadowLogWriter

    root = tmp_path_factory.mktemp("shadow_box")
    bundle = write_tiny_bundle(root / "bundle", seed=4, version=1, latency_steps=2, action_bound=LEGACY_BOUND)
    log = ShadowLogWriter(root / "logs")
    server = PolicyServer(EdgeRuntime.load(bundle), mode="shadow", shadow_log=log, deadline_us=1e9)
    server.sock.close()  # handle() only
    yield server
    log.close()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(legacy=st.lists(st.one_of(st.sampled_from(EDGES), st.floats(-1, 1, width=32)), min_size=2, max_size=2))
def test_shadow_echoes_a_legacy_action_only_when_it_lies_in_the_declared_box(shadow_server, legacy):
    """Shadow mode echoes the plant's legacy action and feeds it to the shield's prediction: only one the plant
    can have applied, inside the declared box in double precision (float32(0.3) is not)."""
    from shield.protocol import Status, decode_act_reply

    server = shadow_server
    server.shadow_seq = getattr(server, "shadow_seq", 0) + 1
    legacy32 = np.asarray(legacy, np.float32)
    inside = all(-LEGACY_BOUND <= float(v) <= LEGACY_BOUND for v in legacy32)
    reply = decode_act_reply(
        server.handle(encode_act_request(server.shadow_seq, 0, [0.1, -0.2, 0.0, 0.3], legacy32, client_id=1), ADDR)
    )
    if inside:
        assert reply.status & Status.SHADOW and reply.action.tobytes() == legacy32.tobytes()
    else:
        assert reply.status & Status.BAD_INPUT and reply.action.tolist() == [0.0, 0.0]


def test_refusal_counters_count_the_refusals_sent(servers):
    """`stale`, `bad_inputs` and (unkeyed) `auth_failures` count refusals sent, as the README's table says: a
    datagram too short to be answered is only `dropped`. Before, a 32-byte header with an old seq counted as
    `stale`, so anyone could raise the replay alarm without a reply."""
    server = servers["open"]
    # A live plant past seq 1 (a plant silent past the plant-live time that counts from below is a restart, and its
    # request runs: on a slow machine the module's earlier plants are that silent by now).
    now = time.perf_counter_ns()  # both received at once: however slow the machine, plant 77 is live
    assert server.handle(encode_act_request(5, 0, [0.0] * 4, client_id=77), ADDR, now) is not None
    old = encode_act_request(1, 0, [0.0, 0.0, 0.0, 0.0], client_id=77)
    signed = encode_act_request(time.time_ns() // 1000, 0, [0.0] * 4, key=KEY, client_id=9)
    before = server.stats.as_dict()
    for short in (old[:32], old[:40], signed[:48]):  # an answered refusal needs the 52 bytes of an act request
        assert server.handle(short, ADDR) is None
    after = server.stats.as_dict()
    assert {k: after[k] - before[k] for k in after if after[k] != before[k]} == {"requests": 3, "dropped": 3}
    assert server.handle(old, ADDR, now) is not None and server.handle(signed, ADDR) is not None
    final = server.stats.as_dict()
    assert (final["stale"] - after["stale"], final["auth_failures"] - after["auth_failures"]) == (1, 1)


def test_prometheus_endpoint_shows_the_counters_moving(tmp_path):
    pytest.importorskip("prometheus_client")
    bundle = write_tiny_bundle(tmp_path / "bundle", seed=1, version=6)
    with ServerProcess(str(bundle), "--metrics-port", "0", "--deadline-us", "1e7") as server:
        url = re.search(r"metrics=(http://\S+)", "".join(server.lines)).group(1)

        def scrape() -> dict[str, float]:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            return {
                m.group(1): float(m.group(2)) for m in re.finditer(r"^(s2r_serve_\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)
            }

        first = scrape()
        with PolicyClient(server.host, server.port, timeout_s=5.0) as client:
            for obs in np.random.default_rng(0).uniform(-1.5, 1.5, (25, 4)).astype(np.float32):
                client.act(obs)
        second = scrape()
        server.stop()
    assert first["s2r_serve_policy_calls_total"] == 0 and second["s2r_serve_policy_calls_total"] == 25
    assert second["s2r_serve_answered_total"] == 25 and second["s2r_serve_bundle_version"] == 6
    assert (
        second["s2r_serve_latency_seconds_count"] == 25 and second['s2r_serve_latency_seconds_bucket{le="+Inf"}'] == 25
    )
    assert "s2r_serve_envelope_flags_total" in second and "s2r_serve_plants_evicted_total" in second


def test_metrics_endpoint_binds_loopback_and_import_shield_stays_light():
    import subprocess
    import sys

    code = (
        "import sys, shield, shield.server, shield.serve_cli, shield.metrics;"
        "print(sorted(m for m in ('prometheus_client', 'torch', 'ray', 'mujoco', 'gymnasium', 'prefect')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    import argparse

    from shield.serve_cli import add_serve_arguments

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert p.parse_args(["b", "--metrics-port", "9100"]).metrics_host == "127.0.0.1"


def test_serving_makes_no_reference_cycles(tmp_path):
    """`serve_forever` turns the cyclic GC off (a full pass stalled a request by 6 ms at 1 kHz): that is only
    sound if answering, refusing and dropping requests leave no cyclic garbage behind. Counted in a fresh
    interpreter: a test runner's own threads (pytest-xdist's channel to its controller) make garbage meanwhile."""
    code = "import sys; from tests.shield.test_serve_properties import cyclic_garbage_of_serving as f; "
    code += "print(f(sys.argv[1]))"
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "0"]  # without a key, then with one: nothing was cyclic garbage


def cyclic_garbage_of_serving(tmp: str) -> str:
    """Objects the GC finds after answering, refusing and dropping 1,950 requests, without a key and with one."""
    import gc

    bundle = write_tiny_bundle(Path(tmp) / "bundle", seed=1, version=1, latency_steps=2)
    found = []
    for key in (None, KEY):
        # A clock window of an hour: on a loaded machine the 2,000 frames may take longer to answer than the
        # default window, and frames gone stale by the clock would not reach the policy this test is about.
        server = PolicyServer(
            EdgeRuntime.load(bundle),
            key=key,
            deadline_us=1e9,
            not_before_us=0,
            max_plants=3,
            clock_window_us=3_600_000_000,
        )
        server.sock.close()  # handle() only
        server.plants.live_ns = 0  # no plant counts as live: a new one always takes the oldest one's place
        now = time.time_ns() // 1000
        rng = np.random.default_rng(0)
        frames = []
        for i in range(400):
            cid = i % 5  # more plants than the table holds: sessions are evicted and made again
            obs = rng.uniform(-3.0, 3.0, 4)
            frames.append(encode_act_request(now + i, 0, obs, key=key, client_id=cid))
            frames.append(encode_act_request(now + i, 0, obs, key=key, client_id=cid))  # a replay: refused
            frames.append(encode_act_request(now + i, 0, [np.nan, 0, 0, 0], key=key, client_id=cid))  # bad input
            frames.append(encode_status_request(now + i + 1, 0, key=key, client_id=cid))
            frames.append(b"\x00" * 40)  # malformed
        for frame in frames[:50]:  # warm-up: lazily built objects are built
            server.handle(frame, ADDR)
        gc.collect()
        gc.disable()
        try:
            for frame in frames[50:]:
                server.handle(frame, ADDR)
            assert server.stats.policy_calls > 300 and server.stats.stale > 300
            found.append(gc.collect())
        finally:
            gc.enable()
    return " ".join(map(str, found))
