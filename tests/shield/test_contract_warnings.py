"""A plant that does not send what the contract says gets a warning bit and a counter, never a refusal: an
observation far outside its expected range (OBS_RANGE), requests far from the control period (RATE). The
shield still answers each request exactly as it would have otherwise."""

from __future__ import annotations

import importlib.util
import json
import math
import time
import urllib.request

import numpy as np
import pytest

from shield.bundle import MANIFEST_FILE
from shield.client import PolicyClient
from shield.protocol import (
    ALARM_BITS,
    OBS_RANGE_WIDTHS,
    RATE_FACTOR,
    RATE_WINDOW,
    Status,
    decode_act_reply,
    encode_act_request,
)
from shield.runtime import EdgeRuntime
from shield.server import PolicyServer
from tests.shield.test_bundle_contract import cartpole_bundle  # noqa: F401  (a fixture)
from tests.shield.test_serve_attacks import ServerThread

pytestmark = pytest.mark.timeout(120)
PERIOD_NS = 20_000_000  # the cart-pole's control period
REFUSED = ALARM_BITS & ~Status.FALLBACK


@pytest.fixture(scope="module")
def bundle(request):
    return request.getfixturevalue("cartpole_bundle")


def _far_edges(bundle) -> tuple[np.ndarray, np.ndarray]:
    obs = json.loads((bundle / MANIFEST_FILE).read_text())["contract"]["observations"]
    low, high = np.array([o["expected_low"] for o in obs]), np.array([o["expected_high"] for o in obs])
    return low - OBS_RANGE_WIDTHS * (high - low), high + OBS_RANGE_WIDTHS * (high - low)


def test_an_observation_far_outside_its_range_is_flagged_and_still_answered(bundle):
    far_low, far_high = _far_edges(bundle)
    rng = np.random.default_rng(3)
    obs = (rng.normal(size=(30, 5)) * [0.1, 0.02, 0.1, 0.1, 0.1]).astype(np.float32)
    far = {4: (0, far_high[0] * 1.01), 11: (1, np.degrees(1.0) * 60), 20: (3, far_low[3] * 1.01)}  # m, a rad in deg
    for t, (i, v) in far.items():
        obs[t, i] = v
    # Just inside the far edge is not flagged: the threshold is the documented one, not any departure.
    obs[25, 2] = np.nextafter(np.float32(far_high[2]), np.float32(0))
    reference = EdgeRuntime.load(bundle).new_session()
    srv = ServerThread(EdgeRuntime.load(bundle))
    try:
        with PolicyClient(srv.host, srv.port, timeout_s=2.0) as client:
            flagged = []
            for t in range(len(obs)):
                reply = client.act(obs[t])
                safe, _, _ = reference.act(obs[t])
                reference.sent(obs[t], safe, replaced=False)
                assert reply.action.tobytes() == np.asarray(safe, "<f4").tobytes()  # answered as ever
                assert not reply.status & REFUSED  # the policy ran (the shield may brake a far state)
                if reply.status & Status.OBS_RANGE:
                    flagged.append(t)
            assert flagged == sorted(far)
            assert client.status().counters["obs_out_of_range"] == len(far)
        if importlib.util.find_spec("prometheus_client") is not None:  # the metrics extra: the same counter
            from shield.metrics import start_metrics_server

            host, port = start_metrics_server(srv.server, 0)
            text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
            assert f"s2r_serve_obs_out_of_range_total {float(len(far))}" in text
            assert "s2r_serve_rate_warnings_total" in text and "s2r_serve_state_resets_requested_total" in text
    finally:
        srv.stop()


def test_requests_far_faster_than_the_control_period_are_flagged_over_udp(bundle):
    srv = ServerThread(EdgeRuntime.load(bundle))
    try:
        with PolicyClient(srv.host, srv.port, timeout_s=2.0) as client:
            obs = np.zeros(5, np.float32)
            # Back to back: a round trip on loopback is far below half the 20 ms period.
            replies = [client.act(obs) for _ in range(RATE_WINDOW + 3)]
            assert not any(r.status & Status.RATE for r in replies[:RATE_WINDOW])  # no full window yet
            assert all(r.status & Status.RATE for r in replies[RATE_WINDOW:])
            assert all(r.ok for r in replies)  # a warning: the shield still answers
            assert client.status().counters["rate_warnings"] == 3
    finally:
        srv.stop()


@pytest.mark.parametrize(
    "interval_ns,flagged",
    [
        (PERIOD_NS, False),
        (int(PERIOD_NS * RATE_FACTOR * 0.95), False),
        (int(PERIOD_NS * RATE_FACTOR * 1.05), True),  # too slow
        (int(PERIOD_NS / RATE_FACTOR * 1.05), False),
        (int(PERIOD_NS / RATE_FACTOR * 0.95), True),  # too fast
    ],
)
def test_the_rate_threshold_is_the_documented_one(bundle, interval_ns, flagged):
    """Receive times given to the server (handle's t0): the verdict depends on the interval only."""
    server = PolicyServer(EdgeRuntime.load(bundle, shield=False), deadline_us=1e9)
    server.sock.close()
    try:
        t0 = time.perf_counter_ns() - 2 * (RATE_WINDOW + 2) * interval_ns  # in the past: never late
        statuses = []
        for i in range(RATE_WINDOW + 2):
            frame = encode_act_request(i + 1, 0, np.zeros(5, np.float32))
            statuses.append(decode_act_reply(server.handle(frame, ("127.0.0.1", 7), t0 + i * interval_ns)).status)
        assert [bool(s & Status.RATE) for s in statuses] == [False] * RATE_WINDOW + [flagged] * 2
        # A new episode (RESET_STATE) starts a new window: the pause before it is not a rate.
        late = t0 + (RATE_WINDOW + 2) * interval_ns + 10 * PERIOD_NS
        reset = encode_act_request(RATE_WINDOW + 3, 0, np.zeros(5, np.float32), reset_state=True)
        assert not decode_act_reply(server.handle(reset, ("127.0.0.1", 7), late)).status & Status.RATE
    finally:
        server.close()


def test_a_plant_polling_slower_than_the_plant_live_time_is_flagged_and_a_pause_is_not(bundle):
    """Each silence past the plant-live time restarts the window, so a plant asking every 1.1 s of a 20 ms period
    was never flagged (helper-68: 0 RATE in 56 requests, its history reset on every one). Two requests in a row
    each after such a silence are flagged, and every one after them; one pause between episodes is not."""
    server = PolicyServer(EdgeRuntime.load(bundle, shield=False), deadline_us=1e9)
    server.sock.close()
    slow = int(server.served.plant_live_ns * 1.05)
    try:
        t = time.perf_counter_ns() - 40 * slow  # in the past: never late
        statuses = []

        def ask(seq: int, at: int) -> int:
            frame = encode_act_request(seq, 0, np.zeros(5, np.float32))
            status = decode_act_reply(server.handle(frame, ("127.0.0.1", 7), at)).status
            statuses.append(bool(status & Status.RATE))
            return status

        seq = 0
        for _ in range(10):  # an episode at the control period
            seq += 1
            ask(seq, t)
            t += PERIOD_NS
        t += slow  # one pause, then the next episode at the period: not a rate
        for _ in range(10):
            seq += 1
            ask(seq, t)
            t += PERIOD_NS
        assert not any(statuses)
        statuses.clear()
        for _ in range(6):  # now every request after a silence
            t += slow
            seq += 1
            ask(seq, t)
        assert statuses == [False] + [True] * 5
        assert server.stats.rate_warnings == 5
        seq += 1
        assert not ask(seq, t + PERIOD_NS) & Status.RATE  # back at the period
    finally:
        server.close()


def test_an_angle_that_turns_without_limit_is_range_checked_as_the_policy_reads_it(tmp_path):
    """A hinge without a range, observed wrapped around 0 (the contract's `wraps_around`): a plant whose encoder
    counts turns sends the same angle 2 pi k away, and the policy reads it wrapped. The far-edge check reads it
    the same way: any count of turns of an angle inside the far edges is never flagged (it was, for ever, once
    the pendulum had turned past 1.5 turns), and an angle beyond them is flagged on every count of turns."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tests.helpers.serve_bundles import write_tiny_bundle

    bundle = write_tiny_bundle(
        tmp_path / "b",
        control_period_s=0.02,
        observations={0: {"wraps_around": 0.0, "expected_low": -0.5, "expected_high": 0.5}},
    )
    server = PolicyServer(EdgeRuntime.load(bundle, shield=False), deadline_us=1e9)
    server.sock.close()
    far = 0.5 + OBS_RANGE_WIDTHS * 1.0
    seq = iter(range(1, 10**6))

    def flagged(reading: float) -> bool:
        frame = encode_act_request(next(seq), 0, np.array([reading, 0.0, 0.0, 0.0], np.float32))
        return bool(
            decode_act_reply(server.handle(frame, ("127.0.0.1", 7), time.perf_counter_ns())).status & Status.OBS_RANGE
        )

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(
        angle=st.floats(-math.pi, math.pi),
        turns=st.integers(-40, 40),
    )
    def check(angle, turns):
        reading = np.float32(angle + 2.0 * math.pi * turns)
        wrapped = math.remainder(float(reading), 2.0 * math.pi)
        if abs(abs(wrapped) - far) < 1e-3:  # float32's rounding of 40 turns moves the angle by up to 4e-6 rad
            return
        assert flagged(float(reading)) == (abs(wrapped) > far)

    try:
        check()
        assert flagged(0.3) is False and flagged(0.3 + 32 * math.pi) is False  # 16 turns on: the same angle
        assert flagged(2.0) is True and flagged(2.0 - 32 * math.pi) is True
    finally:
        server.close()
