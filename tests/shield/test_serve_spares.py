"""New plants joining a server whose plants keep it busy get sessions built ahead, not on the hot path.

The server builds SPARE_SESSIONS plant sessions at load. It used to refill them only after a quiet poll period,
which a live plant never leaves, so every new plant after the first four had its session built while the loop
stood still (15-35 ms for a predictive shield): its own first reply late, the other plants' requests queued
behind it. A spare is now built after a reply whenever one was taken and no request is waiting."""

from __future__ import annotations

import threading
import time

import numpy as np

from shield.client import PolicyClient
from shield.protocol import Status
from shield.runtime import EdgeRuntime
from shield.served import SPARE_SESSIONS
from shield.server import PolicyServer
from tests.helpers.serve_bundles import write_tiny_bundle


def test_spares_are_rebuilt_between_requests_while_a_plant_keeps_the_server_busy(tmp_path):
    bundle = write_tiny_bundle(tmp_path / "bundle", seed=3, version=1, latency_steps=1)
    server = PolicyServer(EdgeRuntime.load(bundle), deadline_us=1e7)
    # A poll period longer than the test: the quiet-time refill never runs, only the one after replies.
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_s": 60.0}, daemon=True)
    thread.start()
    host, port = server.address
    obs = np.zeros(4, np.float32)
    lowest = SPARE_SESSIONS
    try:
        with PolicyClient(host, port, timeout_s=5.0) as live:
            assert live.act(obs).status & Status.DEADLINE == 0
            for _ in range(3 * SPARE_SESSIONS):
                with PolicyClient(host, port, timeout_s=5.0) as newcomer:
                    assert newcomer.act(obs).status & Status.DEADLINE == 0
                for _ in range(2):  # the live plant's next requests, at its pace: the server is never quiet
                    time.sleep(0.005)
                    live.act(obs)
                lowest = min(lowest, len(server.served.spares))
    finally:
        server.stop()
        thread.join(5.0)
        server.close()
    assert lowest >= SPARE_SESSIONS - 1, f"spares ran down to {lowest} of {SPARE_SESSIONS}"
