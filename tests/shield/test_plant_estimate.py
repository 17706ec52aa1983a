"""An adaptive policy's plant estimate, from the graph to the operator.

The student's estimate head is exported as the named output `plant_estimate` (parity with torch, in the export
itself), the contract names each parameter with its unit and train range, the edge keeps each plant's latest
estimate with that plant's state, and a controller or operator reads it back: the estimate request over real
UDP (bit for bit what an in-process session of that plant alone holds) and Prometheus over real HTTP.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import urllib.request

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shield.bundle import Bundle, BundleError
from shield.client import PolicyClient
from shield.contract import (
    MAX_ESTIMATES,
    ContractError,
    check_contract,
    contract_sha256,
    describe,
    estimate_names,
    names_sha256,
)
from shield.policy import ESTIMATE_OUTPUT, OnnxPolicy
from shield.protocol import (
    MsgType,
    PacketError,
    Status,
    decode_estimate_reply,
    encode_estimate_reply,
    encode_estimate_request,
)
from shield.runtime import EdgeRuntime
from tests.helpers.bundle_helpers import OBS_MEAN, OBS_STD, resealed_copy, shield_spec
from tests.helpers.serve_bundles import write_key_file
from tests.pipeline.deployment.test_export_parity import history_policy
from tests.shield.test_serve_attacks import ServerThread
from tests.shield.test_serve_clients import C_ALARMS, c_client  # noqa: F401  (c_client: a fixture)

pytestmark = pytest.mark.timeout(180)
# What domain_encoding gives for a train set: [name, low, high, log scale].
ESTIMATES = [
    ["body_mass.cart", 0.75, 1.4, False],
    ["joint_damping.hinge", 0.5, 4.0, True],
    ["latency_steps", 0.0, 3.0, False],
]
REFUSED = int(Status.BAD_INPUT | Status.AUTH_FAILED | Status.STALE | Status.DEADLINE | Status.INFERENCE_ERROR)


def estimating_policy():
    policy, meta = history_policy(estimates=ESTIMATES)
    with torch.no_grad():  # a head that spans its range on the test inputs (a fresh one stays near the middle)
        policy.estimate_head[-1].weight.mul_(3.0)
    return policy, meta


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from pipeline.deployment.export import export_deterministic

    policy, meta = estimating_policy()
    out = tmp_path_factory.mktemp("estimating") / "bundle"
    result = export_deterministic(
        policy, meta, shield_spec(), config_hash="est1", out_dir=out, registry_root=tmp_path_factory.mktemp("models")
    )
    return policy, result, out


def observations(steps: int, plants: int = 2, seed: int = 5) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(plants, steps, 4)) * np.asarray(OBS_STD) * 0.3 + OBS_MEAN).astype(np.float32)


def test_the_estimate_is_a_named_graph_output_checked_for_parity_and_named_in_the_contract(exported):
    policy, result, out = exported
    assert result["parity_max_abs_err"] <= 1e-5 and result["state_parity_max_abs_err"] <= 1e-5
    assert 0 <= result["estimate_parity_max_rel_err"] <= 1e-4
    bundle = Bundle.load(out)
    model = onnx.load_from_string(bundle.policy_onnx)
    assert [o.name for o in model.graph.output] == ["action", "next_history", ESTIMATE_OUTPUT]
    stated = bundle.manifest["contract"]["plant_estimate"]
    assert stated["output"] == ESTIMATE_OUTPUT
    assert [(p["name"], p["low"], p["high"]) for p in stated["parameters"]] == [
        (n, lo, hi) for n, lo, hi, _ in ESTIMATES
    ]
    assert [p["unit"] for p in stated["parameters"]] == ["x nominal", "x nominal", "control periods"]
    assert any(
        line.startswith("plant estimate (plant_estimate): body_mass.cart")
        for line in describe(bundle.manifest["contract"])
    )
    # Physical values, each inside the range it was learnt over, log-scaled ones decoded in log space.
    session = OnnxPolicy(bundle.policy_onnx)
    obs = observations(1, 64)[:, 0]
    history = np.random.default_rng(1).normal(size=(64, 3, 6)).astype(np.float32)
    values = session.outputs(obs, history)[2]
    with torch.no_grad():
        reference = policy.plant_estimate(torch.from_numpy(obs), torch.from_numpy(history)).numpy()
    np.testing.assert_allclose(values, reference, atol=1e-5)
    low, high = np.array([e[1] for e in ESTIMATES]), np.array([e[2] for e in ESTIMATES])
    assert np.all(values >= low - 1e-5) and np.all(values <= high + 1e-5)
    assert values.min(axis=0)[1] < math.sqrt(0.5 * 4.0) < values.max(axis=0)[1]  # both sides of the log-middle
    assert np.ptp(values, axis=0).min() > 0.1  # the head reads its input: not a constant


def test_each_plant_keeps_its_own_estimate_read_back_over_udp_as_in_process(exported):
    _, _, out = exported
    runtime = EdgeRuntime.load(out)
    alone = [runtime.new_session(), runtime.new_session()]  # each plant as if it were the only one
    obs = observations(25)
    srv = ServerThread(EdgeRuntime.load(out))
    try:
        plants = [PolicyClient(srv.host, srv.port, timeout_s=2.0) for _ in range(2)]
        never = PolicyClient(srv.host, srv.port, timeout_s=2.0)
        none_yet = never.estimate()
        assert none_yet.values.size == 0 and none_yet.steps == 0  # no session: nothing invented, none admitted
        apart = 0
        for t in range(obs.shape[1]):
            for p in (0, 1):
                reply = plants[p].act(obs[p, t])
                assert reply.status & REFUSED == 0, reply.status
                safe, _, _ = alone[p].act(obs[p, t])
                alone[p].sent(obs[p, t], safe, replaced=False)
                served = plants[p].estimate()
                expected, steps = alone[p].estimate()
                assert served.values.tobytes() == np.asarray(expected, "<f4").tobytes()
                assert served.steps == steps == t + 1
            apart += not np.array_equal(plants[0].estimate().values, plants[1].estimate().values)
        assert apart > 0  # two plants, two estimates: one shared state would have given one
        assert srv.server.stats.estimate_requests == 2 * 2 * obs.shape[1] + 1
        assert len(srv.server.plants.sessions) == 2  # asking admitted no plant
        restarted = plants[0].act(obs[0, 0], new_episode=True)  # the state starts afresh, and its step count
        assert restarted.status & REFUSED == 0 and plants[0].estimate().steps == 1
        # Both plants silent past the plant-live time (their last request moved back, no sleep): their states restart
        # at their next request, so neither still reports what it believed before (helper-50 read the old values).
        for session in srv.server.plants.sessions.values():
            session.seen_ns -= srv.server.served.plant_live_ns + 10**6
        silent = plants[1].estimate()
        assert silent.values.size == 0 and silent.steps == 0
        back = plants[1].act(obs[1, 0])
        assert back.status & REFUSED == 0 and plants[1].estimate().steps == 1
        for client in (*plants, never):
            client.close()
    finally:
        srv.stop()


def test_prometheus_shows_each_plants_estimate_with_its_parameter_names(exported):
    pytest.importorskip("prometheus_client")
    from shield.metrics import start_metrics_server

    _, _, out = exported
    srv = ServerThread(EdgeRuntime.load(out))
    try:
        with PolicyClient(srv.host, srv.port, timeout_s=2.0) as client:
            for obs in observations(4, 1)[0]:
                client.act(obs)
            values = client.estimate().values
            host, port = start_metrics_server(srv.server, 0)
            text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
            plant = f"127.0.0.1:{client.sock.getsockname()[1]}/{client.client_id}"
        lines = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("s2r_serve_plant_estimate")
        }
        for (name, *_), value in zip(ESTIMATES, values, strict=True):
            assert lines[f's2r_serve_plant_estimate{{parameter="{name}",plant="{plant}"}}'] == pytest.approx(
                value, rel=1e-6
            )
        assert lines[f's2r_serve_plant_estimate_steps{{plant="{plant}"}}'] == 4.0
        assert "s2r_serve_estimate_requests_total 1.0" in text
    finally:
        srv.stop()


def test_a_policy_without_an_estimate_answers_an_empty_one(tmp_path, c_client):  # noqa: F811
    """Over the Python client and the C example alike: the C client's -e timed out on the empty reply (44 bytes,
    shorter than any act reply, which it took as the least a reply can be; an outside integrator's finding)."""
    from pipeline.deployment.export import export_deterministic

    policy, meta = history_policy()
    export_deterministic(
        policy, meta, shield_spec(), config_hash="h1st", out_dir=tmp_path / "b", registry_root=tmp_path / "m"
    )
    assert "plant_estimate" not in Bundle.load(tmp_path / "b").manifest["contract"]
    srv = ServerThread(EdgeRuntime.load(tmp_path / "b"))
    try:
        with PolicyClient(srv.host, srv.port, timeout_s=2.0) as client:
            client.act(observations(1, 1)[0, 0])
            answer = client.estimate()
        assert answer.values.size == 0 and answer.steps == 1  # the state moved; there is simply no estimate
        obs = observations(1, 1)[0, 0]
        contract = Bundle.load(tmp_path / "b").manifest["contract"]
        ran = subprocess.run(
            [str(c_client), "-e", "-H", contract["names_sha256"], srv.host, str(srv.port)]
            + [repr(float(v)) for v in obs],
            capture_output=True,
            text=True,
            timeout=10,
        )
        status = int(ran.stdout.split("status=")[1].split()[0], 16)
        assert ran.returncode == (5 if status & C_ALARMS else 0), ran.stderr
        assert ran.stdout.splitlines()[-1] == "estimate steps=1 n=0 values= bits=", ran.stdout
        # The contract line says the policy carries a state (the names hash does not: its I/O is a memoryless one's).
        length = contract["policy_state"]["length"]
        assert ran.stdout.splitlines()[0].endswith(f" policy_state=history:{length}"), ran.stdout
    finally:
        srv.stop()


def test_a_contract_that_misstates_the_estimate_is_refused_by_key(exported, tmp_path):
    _, _, out = exported
    contract = Bundle.load(out).manifest["contract"]

    def edited(change):
        doc = {**contract, "plant_estimate": {**contract["plant_estimate"]}}
        change(doc["plant_estimate"])
        return doc

    cases = [
        (
            lambda e: e.update(parameters=[{**e["parameters"][0], "low": 2.0}]),
            r"parameters\[0\]: low 2.0 is above high",
        ),
        (lambda e: e.update(parameters=[{"unit": "x nominal", "low": 0, "high": 1}]), r"parameters\[0\]\.name"),
        (lambda e: e.update(parameters=e["parameters"] * (MAX_ESTIMATES // 3 + 1)), "must list 1 to"),
        (lambda e: e.update(output=""), r"plant_estimate\.output"),
    ]
    for change, message in cases:
        with pytest.raises(ContractError, match=message):
            check_contract(edited(change), 4, 2)
    with pytest.raises(ContractError, match="without state cannot estimate"):
        check_contract({**contract, "policy_state": {"kind": "none"}}, 4, 2)
    # A bundle whose contract names fewer parameters than its graph outputs is refused at load.
    short = resealed_copy(out, tmp_path / "short", lambda c: _rehashed(c, c["plant_estimate"]["parameters"].pop()))
    with pytest.raises(BundleError, match="states 2 parameters, policy.onnx outputs 3"):
        EdgeRuntime.load(short)


def _names(contract: dict) -> tuple:
    return [o["name"] for o in contract["observations"]], [a["name"] for a in contract["actions"]]


def _rehashed(contract: dict, _edit=None) -> None:
    """The contract's names hash made its own again after an edit (as an export would state it)."""
    contract["names_sha256"] = contract_sha256(contract)


def test_the_names_hash_covers_the_estimated_parameters_and_an_older_bundles_hash_still_loads(exported, tmp_path):
    """helper-50's client, built for one adaptive bundle, ran against a retrain that estimates fewer parameters (its
    position 2 another parameter) with the same hash. The hash now covers the estimate's names in order; a bundle
    exported before states the hash of the names and period alone, and still loads and serves."""
    _, _, out = exported
    contract = Bundle.load(out).manifest["contract"]
    names = estimate_names(contract)
    assert len(names) == 3
    period = contract["control_period_s"]
    assert contract["names_sha256"] == contract_sha256(contract)
    fewer = {**contract, "plant_estimate": {"parameters": contract["plant_estimate"]["parameters"][:2]}}
    swapped = {**contract, "plant_estimate": {"parameters": contract["plant_estimate"]["parameters"][::-1]}}
    assert contract_sha256({**contract, "plant_estimate": None}) != contract["names_sha256"]  # the layout is in it
    assert contract_sha256(fewer) != contract["names_sha256"] != contract_sha256(swapped)
    # The older recipes (names and period, then with the estimate's names): older bundles still load and serve.
    for recipe in (lambda c: names_sha256(*_names(c), period), lambda c: names_sha256(*_names(c), period, names)):
        older = resealed_copy(out, tmp_path / "older", lambda c, r=recipe: c.update(names_sha256=r(c)))
        assert EdgeRuntime.load(older).new_session() is not None
        shutil.rmtree(tmp_path / "older")
    forged = resealed_copy(out, tmp_path / "forged", lambda c: c.update(names_sha256="0" * 64))
    with pytest.raises(BundleError, match="does not hash the contract's names"):
        EdgeRuntime.load(forged)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(width=32, allow_nan=False), max_size=MAX_ESTIMATES),
    steps=st.integers(0, 2**32 - 1),
    key=st.one_of(st.none(), st.binary(min_size=16, max_size=32)),
)
def test_every_estimate_reply_round_trips_and_is_never_larger_than_its_request(values, steps, key):
    frame = encode_estimate_reply(9, 123, 4, np.asarray(values, np.float32), steps, key, client_id=5)
    answer = decode_estimate_reply(frame, key)
    assert answer.values.tobytes() == np.asarray(values, "<f4").tobytes() and answer.steps == steps
    assert (answer.seq, answer.bundle_version, answer.client_id) == (9, 4, 5)
    assert len(frame) <= len(encode_estimate_request(9, 123, key, 5))  # a spoofed request amplifies nothing
    with pytest.raises(PacketError):  # a request never verifies as a reply, nor a truncated reply as one
        decode_estimate_reply(encode_estimate_request(9, 123, key, 5), key)
    with pytest.raises(PacketError):
        decode_estimate_reply(frame[:-1], key)
    assert MsgType.ESTIMATE_REPLY == frame[5]


@pytest.mark.parametrize("keyed", [False, True])
def test_the_c_client_reads_its_plants_estimate_bit_for_bit(exported, c_client, keyed, tmp_path):  # noqa: F811
    """examples/c_client with -e: after its act request, the estimate of its own plant, as an in-process session of
    that plant alone holds it after the same step; with a key, the reply's signature is checked."""
    _, _, out = exported
    key = b"k" * 40
    obs = observations(1)[0, 0]
    alone = EdgeRuntime.load(out).new_session()
    safe, _, _ = alone.act(obs)
    alone.sent(obs, safe, replaced=False)
    expected, steps = alone.estimate()
    srv = ServerThread(EdgeRuntime.load(out), key=key if keyed else None, not_before_us=0)
    try:
        args = [str(c_client), "-e"] + (["-k", str(write_key_file(tmp_path / "psk.key", key))] if keyed else [])
        ran = subprocess.run(
            args + [srv.host, str(srv.port)] + [repr(float(v)) for v in obs], capture_output=True, text=True, timeout=10
        )
    finally:
        srv.stop()
    status = int(ran.stdout.split("status=")[1].split()[0], 16)
    assert ran.returncode == (5 if status & C_ALARMS else 0), ran.stderr  # 5: the act reply carried an alarm bit
    line = ran.stdout.splitlines()[-1]
    assert line.startswith(f"estimate steps={steps} n={len(ESTIMATES)} ") and steps == 1, line
    bits = np.array([int(w, 16) for w in line.split(" bits=")[1].split()], np.uint32)
    assert bits.tobytes() == np.asarray(expected, "<f4").view(np.uint32).tobytes()
    assert srv.server.stats.estimate_requests == 1
