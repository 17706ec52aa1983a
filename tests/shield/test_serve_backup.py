"""The predictive filter's backup hand-over over the wire: a reply whose action is the backup continuing its last
accepted plan carries BACKUP, not FALLBACK, and is not an alarm (`Reply.ok`); its action and bits are the
in-process runtime's, byte for byte, and the status counters count it. Real UDP on 127.0.0.1."""

from __future__ import annotations

import pytest

from shield.cbf import CbfShield
from shield.client import PolicyClient
from shield.protocol import Status
from shield.runtime import EdgeRuntime
from tests.helpers.predictive_specs import THETA_MAX, X_MAX, crane_spec
from tests.helpers.serve_bundles import constant_policy_onnx, write_tiny_bundle
from tests.shield.test_serve_attacks import ServerThread
from tests.shield.test_shield_predictive import crane_under_kicks

pytestmark = pytest.mark.timeout(120)


def test_a_backup_reply_says_backup_and_is_no_alarm_exactly_as_in_process(tmp_path):
    spec = crane_spec(latency_steps=1, latency_min_steps=0)
    bundle = write_tiny_bundle(tmp_path / "bundle", spec=spec, policy=constant_policy_onnx([1.0], spec["obs_dim"]))
    reference = EdgeRuntime.load(bundle)
    # The states the policy (always full force toward the rail's end) drives the kicked crane through behind the
    # in-process shield: the served shield sees the same observations in the same order.
    observations = [obs for obs, _ in crane_under_kicks(CbfShield(spec), lambda t: [1.0], steps=300)]
    server = ServerThread(EdgeRuntime.load(bundle))
    try:
        with PolicyClient(server.host, server.port, timeout_s=5.0) as client:
            before = client.status().counters
            replies = [(client.act(obs), *reference.act(obs)) for obs in observations]
            after = client.status().counters
    finally:
        server.stop()
    backups = fallbacks = 0
    for n, (reply, safe, _, info) in enumerate(replies):
        assert reply.action.tobytes() == safe.tobytes(), n
        assert bool(reply.status & Status.BACKUP) == info["backup"], n
        assert bool(reply.status & Status.FALLBACK) == info["fallback"], n
        if info["backup"]:
            backups += 1
            assert reply.ok and reply.status & Status.INTERVENED, n
        if info["fallback"]:  # the alarm only where a kick had put the crane past a limit: no plan's tube is there
            fallbacks += 1
            obs = observations[n]
            assert abs(obs[0]) > X_MAX or abs(obs[1]) > THETA_MAX, (n, obs)
            assert not reply.ok, n
    assert backups > 0
    assert after["backups"] - before["backups"] == backups
    assert after["fallbacks"] - before["fallbacks"] == fallbacks
