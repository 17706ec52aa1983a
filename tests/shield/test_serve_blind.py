"""Observation dropouts over the wire (issue 31 point 5): an act request flagged OBS_MISSING makes the served shield
dead-reckon, as the in-process shield does on a NaN observation, and the reply says so (BLIND) and says when the
shield's guarantee has run out (BLIND_PAST_HORIZON, and the status counters).

Real UDP on 127.0.0.1 against the cart-pole bundle (its shield declares a model error: a finite blind horizon),
the C client included; the state machine's properties on the planar test bundle through `handle()`.
"""

from __future__ import annotations

import json
import subprocess
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shield.client import PolicyClient
from shield.protocol import (
    CONTRACT_REQUEST_PAD,
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    REQUEST_KEY_LABEL,
    STATUS_REQUEST_PAD,
    ActRequest,
    Flags,
    MsgType,
    Status,
    decode_act_reply,
    decode_act_request,
    direction_key,
    encode_act_request,
    sign,
)
from shield.runtime import EdgeRuntime
from shield.server import PolicyServer
from tests.helpers.bundle_helpers import OBS_MEAN, OBS_STD
from tests.helpers.serve_bundles import ServerProcess
from tests.shield.test_bundle_contract import cartpole_bundle  # noqa: F401  (a fixture)
from tests.shield.test_serve_attacks import ServerThread
from tests.shield.test_serve_clients import NO_DEADLINE, c_client, run_c  # noqa: F401  (c_client: a fixture)
from tests.shield.test_serve_history import history_bundle  # noqa: F401  (a fixture)
from tests.shield.test_serve_properties import ADDR, KEY, servers  # noqa: F401  (servers: a fixture)
from tests.shield.test_serve_properties import state as serve_state

pytestmark = pytest.mark.timeout(300)

BLIND, PAST = Status.BLIND, Status.BLIND_PAST_HORIZON
OBS_SCALE = np.array([0.3, 0.05, 0.5, 0.4, 0.4], np.float32)  # the cart-pole bundle's normalizer's spread


def cartpole_observations(n: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(n, 5)) * OBS_SCALE).astype(np.float32)


def blind_run(client: PolicyClient, reference: EdgeRuntime, seen: np.ndarray, blind: int) -> list:
    """`seen` observed steps, `blind` missing ones, one observed step: each reply beside the in-process runtime's
    action for the same step, the missing ones fed to it as NaN observations (its shield dead-reckons)."""
    nan = np.full(5, np.nan, np.float32)
    steps = [(o, False) for o in seen[:-1]] + [(nan, True)] * blind + [(seen[-1], False)]
    out = []
    for obs, missing in steps:
        reply = client.act(obs, obs_missing=missing)
        safe, _, info = reference.act(obs)
        out.append((reply, safe, info, missing))
    return out


def test_blind_steps_are_dead_reckoned_over_udp_exactly_as_in_process_until_the_horizon(cartpole_bundle):  # noqa: F811
    """(a) and (b): k <= K missing observations get BLIND without BLIND_PAST_HORIZON, and the action the in-process
    shield gives on NaN observations, byte for byte; past K, BLIND_PAST_HORIZON (the same action still); the status
    counters count both; the contract reply states K."""
    reference = EdgeRuntime.load(cartpole_bundle)
    K = reference.shield.blind_horizon
    assert 2 <= K < 50, "the cart-pole shield declares a model error: a finite blind horizon"
    with (
        ServerProcess(str(cartpole_bundle), *NO_DEADLINE) as server,
        PolicyClient(server.host, server.port, timeout_s=5.0) as client,
    ):
        assert client.contract().blind_horizon == K
        before = client.status().counters
        within = blind_run(client, reference, cartpole_observations(8, seed=1), K)
        beyond = blind_run(client, reference, cartpole_observations(8, seed=2), K + 3)
        after = client.status().counters
        server.stop()
    for n, (reply, safe, info, missing) in enumerate(within + beyond):
        assert reply.action.tobytes() == safe.tobytes(), n
        assert bool(reply.status & BLIND) == missing, n
        past = missing and info["blind"]  # the in-process shield's own verdict
        assert bool(reply.status & PAST) == past, n
        if missing:  # the shield's fallback checked at the dead-reckoned state: the policy did not run
            assert reply.status & Status.FALLBACK and not reply.status & (Status.INTERVENED | Status.INFERENCE_ERROR)
            assert not reply.ok  # FALLBACK is an alarm already; BLIND_PAST_HORIZON says stop the plant
        else:
            assert bool(reply.status & Status.FALLBACK) == info["fallback"], n
    assert [r.status & PAST != 0 for r, *_ in within if r.status & BLIND] == [False] * K
    assert [r.status & PAST != 0 for r, *_ in beyond if r.status & BLIND] == [False] * K + [True] * 3
    assert after["blind_steps"] - before["blind_steps"] == 2 * K + 3
    assert after["blind_past_horizon"] - before["blind_past_horizon"] == 3
    assert after["bad_inputs"] == before["bad_inputs"] and after["inference_errors"] == before["inference_errors"]


def test_c_client_sends_a_missing_observation_and_reads_the_blind_bits(cartpole_bundle, c_client):  # noqa: F811
    """A C plant's first request with -m: no good observation yet to dead-reckon from, so the constant fallback
    with BLIND and BLIND_PAST_HORIZON; its contract line states the blind horizon."""
    K = EdgeRuntime.load(cartpole_bundle).shield.blind_horizon
    names = json.loads((cartpole_bundle / "manifest.json").read_text())["contract"]["names_sha256"]
    with ServerProcess(str(cartpole_bundle), *NO_DEADLINE) as server:
        out = subprocess.run(
            [str(c_client), "-m", "-H", names, server.host, str(server.port), "1", "2", "3", "4", "5"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert out.returncode == 5, out.stderr  # a reply, with an alarm: the guarantee has run out
        assert f"blind_horizon={K} policy_state=none\n" in out.stdout and " blind=past_horizon action=" in out.stdout
        got = run_c(c_client, server, [0.0] * 5)  # an observed step: no blind bit, nor the field
        server.stop()
    status = int(out.stdout.split("status=")[1].split()[0], 16)
    assert status == Status.BLIND | Status.BLIND_PAST_HORIZON | Status.FALLBACK
    assert out.stdout.split(" bits=")[1].split() == ["00000000"]  # the spec's fallback_action [0.0]
    assert got["status"] & (BLIND | PAST) == 0


def test_a_history_policy_s_state_skips_the_blind_steps(history_bundle):  # noqa: F811
    """A history policy: a blind step has no observation, so nothing enters its state (a NaN there would reach its
    next H actions: INFERENCE_ERROR); its state after each observed step is that of a plant that never dropped out
    (the same observations, the actions the server sent)."""
    alone = EdgeRuntime.load(history_bundle).new_session()
    obs = (np.random.default_rng(3).normal(size=(8, 4)) * np.asarray(OBS_STD) * 0.3 + OBS_MEAN).astype(np.float32)
    srv = ServerThread(EdgeRuntime.load(history_bundle))
    try:
        with PolicyClient(srv.host, srv.port, timeout_s=5.0) as plant:
            for t, o in enumerate(obs):
                if t == 4:  # a dropout of three steps
                    for _ in range(3):
                        assert plant.act(o, obs_missing=True).status & BLIND
                reply = plant.act(o)
                assert not reply.status & (BLIND | Status.INFERENCE_ERROR), reply.status
                alone.policy.act(o, alone.memory)  # the policy's step (its next state, pending until sent)
                alone.policy.remember(alone.memory, o, reply.action)
                (session,) = srv.server.plants.sessions.values()
                assert session.memory.array.tobytes() == alone.memory.array.tobytes(), t
    finally:
        srv.stop()


def frame(msg_type: int, flags: int, seq: int, client: int, obs, sign_with: bytes | None) -> bytes:
    """A request frame with exactly these flags, signed with `sign_with` (a PSK) when given."""
    if msg_type == MsgType.ACT_REQUEST:
        payload = encode_act_request(0, 0, obs)[HEADER.size :]
    else:
        payload = bytes(STATUS_REQUEST_PAD if msg_type == MsgType.STATUS_REQUEST else CONTRACT_REQUEST_PAD)
    signed = sign_with is not None
    head = HEADER.pack(
        MAGIC, PROTOCOL_VERSION, msg_type, flags | (Flags.HMAC if signed else 0), seq, 0, len(payload), client
    )
    body = head + payload
    return body + sign(direction_key(sign_with, REQUEST_KEY_LABEL), body) if signed else body


def full_state(server: PolicyServer) -> tuple:
    """`test_serve_properties.state`, and what a blind step moves: the shields' dead-reckoning, the counters."""
    shields = tuple((s.shield._blind, s.shield.blind_past_horizon) for s in server.plants.sessions.values())
    stats = server.stats
    return serve_state(server), shields, stats.contract_requests, stats.blind_steps, stats.blind_past_horizon


RESERVED_BITS = [1 << b for b in range(16) if Flags.RESERVED & (1 << b)]
OPEN_DEFECTS = ["reserved", "status", "contract", "signed"]  # "signed": a signed request to a server without a key
KEYED_DEFECTS = ["reserved", "status", "contract", "unsigned", "forged"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    case=st.one_of(
        st.tuples(st.just("open"), st.sampled_from(OPEN_DEFECTS)),
        st.tuples(st.just("keyed"), st.sampled_from(KEYED_DEFECTS)),
    ),
    bit=st.sampled_from(RESERVED_BITS),
    client=st.integers(1, 3),
    reset=st.booleans(),
    obs=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=4, max_size=4),
)
def test_a_missing_flag_with_a_defect_changes_no_state_and_without_it_is_a_blind_step(
    servers,  # noqa: F811
    case,
    bit,
    client,
    reset,
    obs,
):
    """(c) OBS_MISSING plus a reserved bit, on a status or contract request, or (keyed) unsigned or forged, or
    (open) signed: refused or dropped, and nothing moves. The same request without the defect is accepted as a
    blind step (whatever its observation's values), which is what makes the refusal the defect's."""
    name, defect = case
    server = servers[name]
    key = KEY if name == "keyed" else None
    server.next_seq = seq = max(getattr(server, "next_seq", 0) + 1, time.time_ns() // 1000)
    flags = Flags.OBS_MISSING | (Flags.RESET_STATE if reset else 0)
    msg_type, sign_with, bad_flags = MsgType.ACT_REQUEST, key, flags
    if defect == "reserved":
        bad_flags |= bit
    elif defect in ("status", "contract"):
        msg_type = MsgType.STATUS_REQUEST if defect == "status" else MsgType.CONTRACT_REQUEST
    elif defect == "signed":
        sign_with = KEY
    elif defect == "unsigned":
        sign_with = None
    elif defect == "forged":
        sign_with = KEY + b"!"
    bad = frame(msg_type, bad_flags, seq, client, obs, sign_with)
    before = full_state(server)
    reply = server.handle(bad, ADDR)
    assert full_state(server) == before
    if defect in ("unsigned", "forged"):
        assert reply is None  # a keyed server answers nothing it cannot authenticate
    else:
        expected = Status.AUTH_FAILED if defect == "signed" else Status.BAD_INPUT
        assert decode_act_reply(reply, key).status == expected | Status.FALLBACK
    good = frame(MsgType.ACT_REQUEST, flags, seq, client, obs, key)
    blind_before = server.stats.blind_steps
    reply = decode_act_reply(server.handle(good, ADDR), key)
    assert reply.status & BLIND and reply.status & Status.FALLBACK and not reply.status & Status.BAD_INPUT
    assert server.stats.blind_steps == blind_before + 1
    assert full_state(server) != before


def test_a_nan_observation_without_the_flag_is_still_bad_input(cartpole_bundle):  # noqa: F811
    """(d) Over UDP: NaN in the observation without OBS_MISSING is BAD_INPUT (nothing ran, no blind step); the very
    same payload with the flag is a blind step. Shadow mode: the flag never excuses a non-finite legacy action."""
    nan_obs = np.array([0.0, np.nan, 0.0, 0.0, 0.0], np.float32)
    with (
        ServerProcess(str(cartpole_bundle), *NO_DEADLINE) as server,
        PolicyClient(server.host, server.port, timeout_s=5.0) as client,
    ):
        client.act(np.zeros(5, np.float32))  # a state to dead-reckon from
        refused = client.act(nan_obs)
        counters = client.status().counters
        blind = client.act(nan_obs, obs_missing=True)
        server.stop()
    assert refused.status == Status.BAD_INPUT | Status.FALLBACK and counters["blind_steps"] == 0
    assert counters["bad_inputs"] == 1 and counters["policy_calls"] == 1
    assert blind.status & BLIND and not blind.status & (PAST | Status.BAD_INPUT)

    runtime = EdgeRuntime.load(cartpole_bundle)
    shadow = ServerThread(runtime, mode="shadow")
    try:
        with PolicyClient(shadow.host, shadow.port, timeout_s=5.0) as plant:
            legacy = np.array([0.25], np.float32)
            plant.act(np.zeros(5, np.float32), legacy)
            echoed = plant.act(nan_obs, legacy, obs_missing=True)
            assert echoed.status & (Status.SHADOW | BLIND) == Status.SHADOW | BLIND
            assert echoed.action.tobytes() == legacy.tobytes()
            assert plant.act(nan_obs, np.array([np.nan], np.float32), obs_missing=True).status & Status.BAD_INPUT
    finally:
        shadow.stop()


def test_the_request_encoder_sets_the_flag_and_keeps_the_observation_s_size():
    frame_ = encode_act_request(5, 6, [np.nan] * 4, obs_missing=True, reset_state=True)
    assert HEADER.unpack_from(frame_)[3] == Flags.OBS_MISSING | Flags.RESET_STATE
    decoded: ActRequest = decode_act_request(frame_)
    assert decoded.obs.shape == (4,) and np.isnan(decoded.obs).all()
