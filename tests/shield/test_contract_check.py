"""A controller reads the served bundle's contract (control period, names hash) and refuses to run against a
bundle other than the one it was built for: the Python client, and the C example compiled with the hash of
its bundle. The contract goes from the declaration to the manifest to the C client's own check."""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import numpy as np
import pytest

from shield.bundle import MANIFEST_FILE
from shield.client import ContractMismatch, PolicyClient
from shield.contract import contract_sha256
from shield.protocol import (
    CONTRACT_REQUEST_PAD,
    HEADER_SIZE,
    Status,
    decode_act_reply,
    decode_contract_reply,
    encode_contract_request,
)
from shield.runtime import EdgeRuntime
from tests.helpers.bundle_helpers import resealed_copy
from tests.helpers.serve_bundles import write_key_file, write_tiny_bundle
from tests.shield.test_bundle_contract import cartpole_bundle  # noqa: F401  (a fixture)
from tests.shield.test_serve_attacks import ServerThread
from tests.shield.test_serve_clients import C_SOURCE

pytestmark = pytest.mark.timeout(120)
KEY = b"contract-check-pre-shared-key-0123456789"


@pytest.fixture(scope="module")
def bundles(request, tmp_path_factory):
    """(the cart-pole bundle, the same one whose contract lists the observations in another order)."""
    ours = request.getfixturevalue("cartpole_bundle")

    def reorder(contract):
        contract["observations"].reverse()
        contract["names_sha256"] = contract_sha256(contract)

    return ours, resealed_copy(ours, tmp_path_factory.mktemp("other") / "b", reorder)


@pytest.fixture(scope="module")
def regeared(request, tmp_path_factory):
    """The cart-pole bundle exported for a drive geared otherwise: the same names, 45 N per unit action, not 30. A
    controller that scales the policy's action for the 30 N drive would push the cart 1.5 times as hard."""
    ours = request.getfixturevalue("cartpole_bundle")

    def regear(contract):
        contract["actions"][0]["units_per_action"] *= 1.5
        contract["names_sha256"] = contract_sha256(contract)

    return resealed_copy(ours, tmp_path_factory.mktemp("regeared") / "b", regear)


def _hash(bundle) -> str:
    return json.loads((bundle / MANIFEST_FILE).read_text())["contract"]["names_sha256"]


def _compile(tmp_path, names_hash: str):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on this machine")
    exe = tmp_path / "s2r_client"
    flags = ["-O2", "-Wall", "-Wextra", "-Werror", "-std=c99", f'-DS2R_NAMES_SHA256="{names_hash}"']
    subprocess.run([cc, *flags, "-o", str(exe), str(C_SOURCE)], check=True)
    return exe


def test_the_contract_reply_states_the_period_and_the_names_hash(bundles, tmp_path):
    ours, other = bundles
    assert _hash(ours) != _hash(other)
    srv = ServerThread(EdgeRuntime.load(ours), key=KEY, not_before_us=0)
    try:
        with PolicyClient(srv.host, srv.port, key=KEY, timeout_s=2.0) as client:
            served = client.contract()
            assert served.control_period_s == 0.02 and served.names_sha256 == _hash(ours)
            assert (served.obs_dim, served.act_dim, served.state_kind) == (5, 1, "none")
            assert client.check_contract(_hash(ours)).names_sha256 == _hash(ours)
            with pytest.raises(ContractMismatch, match=_hash(ours)):
                client.check_contract(_hash(other))
        # No amplification: the reply is no longer than the request.
        request = encode_contract_request(1, 0)
        assert len(request) == HEADER_SIZE + CONTRACT_REQUEST_PAD
        srv_plain = ServerThread(EdgeRuntime.load(ours))
        try:
            reply = srv_plain.server.handle(request, ("127.0.0.1", 1))
            assert reply is not None and len(reply) <= len(request)
            assert decode_contract_reply(reply).names_sha256 == _hash(ours)
            short = srv_plain.server.handle(request[:-8] + bytes(36), ("127.0.0.1", 1))  # padding too short
            assert short is not None and decode_act_reply(short).status & Status.BAD_INPUT
        finally:
            srv_plain.stop()
    finally:
        srv.stop()
    # A schema-1 bundle states no names: an empty hash, and its shield's control period.
    old = ServerThread(EdgeRuntime.load(write_tiny_bundle(tmp_path / "old")))
    try:
        with PolicyClient(old.host, old.port, timeout_s=2.0) as client:
            served = client.contract()
            assert served.names_sha256 == "" and math.isfinite(served.control_period_s)
            with pytest.raises(ContractMismatch, match="no contract"):
                client.check_contract(_hash(ours))
    finally:
        old.stop()


def test_a_c_controller_built_for_another_bundle_refuses_to_run(bundles, regeared, tmp_path):
    """Another bundle: its observations in another order, or its names the same and its drive geared otherwise."""
    ours, _ = bundles
    assert _hash(regeared) != _hash(ours)
    exe = _compile(tmp_path, _hash(ours))
    obs = np.array([0.05, 0.02, 0.0, 0.0, 0.0], np.float32)
    expected = EdgeRuntime.load(ours).act(obs)[0]
    key_file = write_key_file(tmp_path / "psk", KEY)
    for bundle, key in ((ours, None), (ours, KEY), *((other, None) for other in (bundles[1], regeared))):
        srv = ServerThread(EdgeRuntime.load(bundle), key=key, not_before_us=0)
        try:
            args = [str(exe), *(["-k", str(key_file)] if key else []), srv.host, str(srv.port)]
            out = subprocess.run(args + [repr(float(v)) for v in obs], capture_output=True, text=True, timeout=10)
            if bundle is ours:
                assert out.returncode == 0, out.stderr
                assert f"contract period_s=0.02 names_sha256={_hash(ours)}" in out.stdout
                assert out.stdout.splitlines()[0].endswith(" policy_state=none")  # memoryless: nothing to reset
                bits = out.stdout.split(" bits=")[1].split()
                assert np.array([int(w, 16) for w in bits], np.uint32).view(np.float32).tobytes() == expected.tobytes()
                assert srv.server.stats.policy_calls == 1
            else:
                assert out.returncode == 4 and "refusing to run" in out.stderr and _hash(bundle) in out.stderr
                assert f"names_sha256={_hash(bundle)}" in out.stdout  # what is served, printed before refusing
                assert "reply seq" not in out.stdout and srv.server.stats.policy_calls == 0  # nothing ran
                assert srv.server.stats.contract_requests == 1
        finally:
            srv.stop()


def test_a_c_controller_giving_another_count_of_observations_is_told_so_not_timed_out(bundles, tmp_path):
    """helper-50 gave the C example 4 observations for a 5-observation bundle: the server drops a request shorter
    than a valid one, and the client said "timeout". Having read the contract, it now refuses to send, naming the
    counts, and nothing reaches the policy."""
    ours, _ = bundles
    exe = _compile(tmp_path, _hash(ours))
    srv = ServerThread(EdgeRuntime.load(ours), key=None, not_before_us=0)
    try:
        for obs, legacy in (([0.05, 0.02, 0.0, 0.0], None), ([0.05, 0.02, 0.0, 0.0, 0.0], "0.1,0.2")):
            args = [str(exe), *(["-l", legacy] if legacy else []), srv.host, str(srv.port), *map(str, obs)]
            out = subprocess.run(args, capture_output=True, text=True, timeout=10)
            assert out.returncode == 4, (out.returncode, out.stderr)
            assert "takes 5 observations and 1 legacy actions" in out.stderr, out.stderr
        assert srv.server.stats.policy_calls == 0 and srv.server.stats.contract_requests == 2
    finally:
        srv.stop()
