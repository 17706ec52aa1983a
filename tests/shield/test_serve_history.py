"""A history policy (train.history_length > 0) served over UDP keeps one history per client.

Two plants talk to one server, interleaved. Every reply must equal, bit for bit, what a
session of that plant alone gives (its own history of observations and sent actions); a
single history shared by both plants would give other actions, which the test also checks
so that it can fail.
"""

from __future__ import annotations

import numpy as np
import pytest

from shield.client import PolicyClient
from shield.protocol import Status
from shield.runtime import EdgeRuntime
from tests.helpers.bundle_helpers import OBS_MEAN, OBS_STD, shield_spec
from tests.pipeline.deployment.test_export_parity import history_policy
from tests.shield.test_serve_attacks import ServerThread

pytestmark = pytest.mark.timeout(180)
REFUSED = int(Status.BAD_INPUT | Status.AUTH_FAILED | Status.STALE | Status.DEADLINE | Status.INFERENCE_ERROR)


@pytest.fixture(scope="module")
def history_bundle(tmp_path_factory):
    from pipeline.deployment.export import export_deterministic

    policy, meta = history_policy()
    out = tmp_path_factory.mktemp("history") / "bundle"
    export_deterministic(
        policy, meta, shield_spec(), config_hash="h1st", out_dir=out, registry_root=tmp_path_factory.mktemp("models")
    )
    return out


def test_the_server_keeps_a_separate_history_per_client(history_bundle):
    runtime = EdgeRuntime.load(history_bundle)
    assert runtime.policy.history_length == 3
    alone = [runtime.new_session(), runtime.new_session()]  # each plant's session as if it were the only one
    shared = runtime.new_session()  # one history for both: what a server without per-plant memory would do
    rng = np.random.default_rng(11)
    obs = (rng.normal(size=(2, 40, 4)) * np.asarray(OBS_STD) * 0.3 + OBS_MEAN).astype(np.float32)
    srv = ServerThread(EdgeRuntime.load(history_bundle))
    try:
        plants = [PolicyClient(srv.host, srv.port, timeout_s=2.0) for _ in range(2)]
        differ_from_own = differ_from_shared = 0
        for t in range(obs.shape[1]):
            for p in (0, 1):
                reply = plants[p].act(obs[p, t])
                assert reply.status & REFUSED == 0, reply.status  # the policy ran (the shield may brake)
                own, _, _ = alone[p].act(obs[p, t])
                alone[p].sent(obs[p, t], own, replaced=False)
                mixed, _, _ = shared.act(obs[p, t])
                shared.sent(obs[p, t], mixed, replaced=False)
                differ_from_own += not np.array_equal(np.asarray(reply.action, np.float32), own)
                differ_from_shared += not np.array_equal(np.asarray(reply.action, np.float32), mixed)
        assert differ_from_own == 0  # every reply follows that plant's own history
        assert differ_from_shared > 0  # and the history matters: one shared history would have answered otherwise
        for client in plants:
            client.close()
    finally:
        srv.stop()


def test_a_non_finite_observation_in_process_leaves_the_policy_state_as_it_was(history_bundle):
    """In process, a NaN observation is a blind step: the shield dead-reckons its fallback, the policy does not run,
    and the history policy's state does not move, so the next good observation gets the action it would have got
    had the bad sample never come (the shield, which knows where the plant may be, is compared separately)."""
    rng = np.random.default_rng(3)
    obs = (rng.normal(size=(12, 4)) * np.asarray(OBS_STD) * 0.3 + OBS_MEAN).astype(np.float32)
    runtime = EdgeRuntime.load(history_bundle)
    for t in range(6):
        runtime.act(obs[t])
    before = runtime._default.memory.array.copy()
    safe, raw, info = runtime.act(np.full(4, np.nan, np.float32))
    assert info["bad_input"] and np.isnan(raw).all() and np.isfinite(safe).all()
    assert np.array_equal(runtime._default.memory.array, before)  # no NaN, and no step recorded
    assert np.isfinite(runtime.act(obs[6])[1]).all()
