"""A stateful policy's state is explicit: a named input and output of policy.onnx, stated in the contract, kept
per plant session at the edge and started afresh by the contract's reset rules, each counted.

The server's replies are held bit for bit against two in-process runtimes that see the same steps and resets;
one state shared by both plants would answer otherwise, which the test also checks so that it can fail.
"""

from __future__ import annotations

import io
import itertools
import socket
import time
import warnings

import numpy as np
import onnx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.deployment.export import (
    PARITY_TOL,
    STATE_PARITY_PLANTS,
    STATE_PARITY_STEPS,
    state_parity_error,
    to_onnx,
)
from shield.bundle import Bundle, BundleError
from shield.client import PolicyClient, PolicyTimeout
from shield.contract import RESET_RULES
from shield.policy import OnnxPolicy
from shield.protocol import (
    HEADER,
    Flags,
    Status,
    decode_act_reply,
    decode_status_reply,
    encode_act_request,
    encode_status_request,
)
from shield.runtime import EdgeRuntime
from tests.helpers.bundle_helpers import OBS_MEAN, OBS_STD, resealed_copy
from tests.pipeline.deployment.test_export_parity import history_policy
from tests.shield.test_serve_attacks import ServerThread
from tests.shield.test_serve_history import history_bundle  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(180)
REFUSED = int(Status.BAD_INPUT | Status.AUTH_FAILED | Status.STALE | Status.DEADLINE | Status.INFERENCE_ERROR)


@pytest.fixture(scope="module")
def stateful(request):
    """(the torch policy, the bundle exported from it): history_policy() is seeded, so it is the same policy."""
    return history_policy()[0], request.getfixturevalue("history_bundle")


def test_the_state_is_a_named_input_and_output_that_the_contract_states(stateful):
    _, out = stateful
    bundle = Bundle.load(out)
    model = onnx.load_from_string(bundle.policy_onnx)
    assert [i.name for i in model.graph.input] == ["obs", "history"]
    assert [o.name for o in model.graph.output] == ["action", "next_history"]
    state = bundle.manifest["contract"]["policy_state"]
    assert (state["input"], state["output"], state["dtype"], state["initial"]) == (
        "history",
        "next_history",
        "float32",
        "zeros",
    )
    assert state["shape"] == [1, 3, 6] and state["reset_on"] == list(RESET_RULES)
    # Parity over >= 200 closed-loop steps with resets ran in the export itself, and is recorded.
    assert bundle.manifest["metrics"]["state_parity_max_abs_err"] <= PARITY_TOL
    assert bundle.manifest["metrics"]["state_parity_steps"] == STATE_PARITY_STEPS * STATE_PARITY_PLANTS >= 200


def test_state_parity_catches_a_graph_that_is_not_the_policy(stateful):
    policy, out = stateful
    other, meta = history_policy(seed=7)  # same interface, other weights
    wrong = to_onnx(other, 4, {}).SerializeToString()
    err, resets, _ = state_parity_error(policy, OnnxPolicy(wrong), np.asarray(OBS_MEAN), np.asarray(OBS_STD))
    assert err > 1e-3 and resets > 0
    right, *_ = state_parity_error(
        policy, OnnxPolicy(Bundle.load(out).policy_onnx), np.asarray(OBS_MEAN), np.asarray(OBS_STD)
    )
    assert right <= PARITY_TOL


def test_a_contract_naming_other_state_tensors_is_refused(stateful, tmp_path):
    _, out = stateful
    bundle = resealed_copy(out, tmp_path / "b", lambda c: c["policy_state"].update(output="hidden"))
    with pytest.raises(BundleError, match="next_history"):
        EdgeRuntime.load(bundle)


def _episodes(rng, plant: int, steps: int) -> set[int]:
    """Steps at which a plant starts a new episode (sends new_episode=True)."""
    return {t for t in range(1, steps) if rng.random() < 0.12} | {7 + 5 * plant}


def test_two_plants_interleaved_keep_separate_states_with_resets_bit_for_bit(stateful):
    _, out = stateful
    alone = [EdgeRuntime.load(out).new_session() for _ in range(2)]  # two in-process runtimes, one per plant
    shared = EdgeRuntime.load(out).new_session()  # one state for both: what must not happen
    steps = 40
    rng = np.random.default_rng(5)
    obs = (rng.normal(size=(2, steps, 4)) * np.asarray(OBS_STD) * 0.3 + OBS_MEAN).astype(np.float32)
    resets = [_episodes(rng, p, steps) for p in (0, 1)]
    resets[0].add(0)  # a plant whose first request says new episode: counted as requested too (helper-50)
    srv = ServerThread(EdgeRuntime.load(out))
    try:
        plants = [PolicyClient(srv.host, srv.port, timeout_s=2.0) for _ in range(2)]
        differ_from_own = differ_from_shared = 0
        for t in range(steps):
            for p in (0, 1):
                new_episode = t in resets[p]
                reply = plants[p].act(obs[p, t], new_episode=new_episode)
                assert reply.status & REFUSED == 0, reply.status
                if new_episode:
                    assert alone[p].reset_policy_state()
                own, _, _ = alone[p].act(obs[p, t])
                alone[p].sent(obs[p, t], own, replaced=False)
                mixed, _, _ = shared.act(obs[p, t])
                shared.sent(obs[p, t], mixed, replaced=False)
                got = np.asarray(reply.action, np.float32)
                differ_from_own += not np.array_equal(got, own)
                differ_from_shared += not np.array_equal(got, mixed)
        assert differ_from_own == 0
        assert differ_from_shared > 0
        counters = plants[0].status().counters
        assert counters["state_resets_new_plant"] == 2
        assert counters["state_resets_requested"] == len(resets[0]) + len(resets[1])
        assert counters["state_resets_silence"] == 0
        for client in plants:
            client.close()
    finally:
        srv.stop()


def test_a_client_that_got_no_reply_resets_the_state_on_its_next_request():
    """Real UDP: a listener that never answers; the client's second request carries RESET_STATE."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    listener.settimeout(2.0)
    client = PolicyClient(*listener.getsockname(), timeout_s=0.05)
    try:
        flags = []
        for _ in range(2):
            with pytest.raises(PolicyTimeout):
                client.act(np.zeros(4, np.float32))
            flags.append(HEADER.unpack_from(listener.recv(4096))[3])
        assert flags[0] & Flags.RESET_STATE == 0 and flags[1] & Flags.RESET_STATE
    finally:
        client.close()
        listener.close()


def test_a_plant_silent_past_the_live_time_starts_from_the_initial_state(stateful):
    _, out = stateful
    from shield.server import PolicyServer

    # The bare policy (shield=False): the policy's own action comes back, never the shield's brake.
    server = PolicyServer(EdgeRuntime.load(out, shield=False), deadline_us=1e8)
    try:
        fresh = EdgeRuntime.load(out, shield=False).new_session()
        addr = ("127.0.0.1", 9)
        # Receive times (perf_counter_ns) in the past, so that the deadline is not what changes the answer.
        t0 = time.perf_counter_ns() - 2 * server.served.plant_live_ns - 10**7
        obs = np.asarray(OBS_MEAN, np.float32) + 0.3 * np.asarray(OBS_STD, np.float32)
        replies = [decode_act_reply(server.handle(encode_act_request(i + 1, 0, obs), addr, t0 + i)) for i in range(3)]
        late = decode_act_reply(
            server.handle(encode_act_request(9, 0, obs), addr, t0 + server.served.plant_live_ns + 3)
        )
        first, _, _ = fresh.act(obs)
        assert np.array_equal(replies[0].action, first) and not np.array_equal(replies[2].action, first)
        assert late.status & REFUSED == 0 and np.array_equal(late.action, first)
        status = decode_status_reply(server.handle(encode_status_request(10, 0), addr))
        assert status.counters["state_resets_silence"] == 1
        assert status.counters["state_resets_new_plant"] == 1
    finally:
        server.close()


def test_a_history_bundle_without_a_state_output_still_serves_the_same(stateful, tmp_path):
    """Graphs exported before the state became an output (history in, action out) keep per-plant histories."""
    policy, out = stateful
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            policy.eval(),
            (torch.zeros(1, 4), torch.zeros(1, 3, 6)),
            buf,
            input_names=["obs", "history"],
            output_names=["action"],
            opset_version=17,
            dynamo=False,
            dynamic_axes={"obs": {0: "batch"}, "history": {0: "batch"}, "action": {0: "batch"}},
        )
    old, new = OnnxPolicy(buf.getvalue()), OnnxPolicy(Bundle.load(out).policy_onnx)
    assert old.state_output_name is None and new.state_output_name == "next_history"
    memories = [old.new_memory(), new.new_memory()]
    rng = np.random.default_rng(2)
    for _ in range(30):
        o = (rng.normal(size=4) * OBS_STD + OBS_MEAN).astype(np.float32)
        actions = [p.act(o, m) for p, m in zip((old, new), memories)]
        assert np.abs(actions[0] - actions[1]).max() <= PARITY_TOL
        for p, m in zip((old, new), memories):
            p.remember(m, o, 0.5 * actions[1])
        assert np.abs(memories[0].array - memories[1].array).max() <= PARITY_TOL


def _policy_state(server) -> tuple:
    """Every plant's policy state, pending step and rate window, and the reset counters."""
    sessions = tuple(
        (c, s.memory.array.tobytes(), s.memory.pending is None, s.rate_count) for c, s in server.plants.sessions.items()
    )
    counters = server.stats.as_dict()
    return sessions, tuple(counters[k] for k in ("state_resets_new_plant", "state_resets_requested", "policy_calls"))


FRESH_SEQ = itertools.count(2**21)


@st.composite
def reset_frames(draw) -> bytes:
    """RESET_STATE act requests of the two plants, most of them broken somewhere (a byte set, cut or grown)."""
    obs = draw(st.lists(st.floats(-3, 3, width=32), min_size=4, max_size=4))
    # Half fresh (above every seq sent so far), half behind the plants' last seq: stale.
    seq = next(FRESH_SEQ) if draw(st.booleans()) else draw(st.integers(0, 2**20))
    frame = bytearray(encode_act_request(seq, 0, obs, client_id=draw(st.sampled_from([1, 2])), reset_state=True))
    op = draw(st.sampled_from(["set", "cut", "grow", "nan", "none"]))
    if op == "set":
        frame[draw(st.integers(0, len(frame) - 1))] = draw(st.integers(0, 255))
    elif op == "cut":
        del frame[draw(st.integers(0, len(frame) - 1)) :]
    elif op == "grow":
        frame += draw(st.binary(min_size=1, max_size=8))
    elif op == "nan":
        i = 36 + 4 * draw(st.integers(0, 3))
        frame[i : i + 4] = b"\x00\x00\xc0\x7f"  # a NaN observation
    return bytes(frame)


@pytest.fixture(scope="module")
def stateful_server(stateful):
    from shield.server import PolicyServer

    server = PolicyServer(EdgeRuntime.load(stateful[1]), deadline_us=1e9)
    server.sock.close()  # handle() only
    for cid in (1, 2):
        for i in range(4):
            assert server.handle(encode_act_request(2**20 + i, 0, OBS_MEAN, client_id=cid), ("127.0.0.1", 1))
    yield server
    server.close()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame=reset_frames())
def test_a_refused_reset_request_resets_nothing(stateful_server, frame):
    """Only an accepted request resets a policy state: a malformed, stale or non-finite one (flag set or not)
    leaves every plant's state, its pending step and the counters as they were."""
    before = _policy_state(stateful_server)
    stateful_server.handle(frame, ("127.0.0.1", 1))
    after = _policy_state(stateful_server)
    if after[1][2] == before[1][2]:  # the policy did not run: refused or dropped
        assert after == before
    else:
        # Accepted: a RESET_STATE request is counted once (a mutation may clear the flag), a new plant's too: a
        # changed client id, or a plant silent past the plant-live time restarting from a lower seq (on a slow
        # runner the module's plants fall silent between examples).
        assert after[1][1] - before[1][1] == int(bool(frame[6] & Flags.RESET_STATE))
