"""Hot reload: promoting (and rolling back) in the registry while a plant streams requests to `serve --registry`
loses no request, and every reply's action is exactly the one of the version that reply reports."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from pipeline.deployment.registry import Registry
from shield.client import PolicyClient
from shield.runtime import EdgeRuntime
from tests.helpers.serve_bundles import ServerProcess, write_tiny_bundle

pytestmark = pytest.mark.timeout(120)  # a hung server fails the test instead of the CI job

AFTER_SWITCH = 200  # requests still sent after each switch is seen


def test_promote_and_rollback_during_a_stream_lose_nothing_and_never_mix_versions(tmp_path):
    registry = Registry(tmp_path / "models")
    v1 = registry.register(write_tiny_bundle(tmp_path / "a", seed=1))
    v2 = registry.register(write_tiny_bundle(tmp_path / "b", seed=2))
    registry.promote("planar", v1)
    runtimes = {v: EdgeRuntime.load(registry.bundle_dir("planar", v)) for v in (v1, v2)}
    rng = np.random.default_rng(3)
    low, high = [-1.2, -1.2, -0.5, -0.5], [1.2, 1.2, 0.5, 0.5]
    probe = rng.uniform(low, high, (50, 4)).astype(np.float32)
    # The versions answer differently (unless the shield brakes both to the same corner), so a reply
    # computed by one version but labelled with the other is caught.
    differ = [runtimes[v1].act(o)[0].tobytes() != runtimes[v2].act(o)[0].tobytes() for o in probe]
    assert np.mean(differ) > 0.8

    versions: list[int] = []
    with ServerProcess("--registry", "planar", "--models", str(tmp_path / "models"), "--deadline-us", "1e7") as server:
        assert server.version == v1
        client = PolicyClient(server.host, server.port, timeout_s=5.0)  # a lost request raises PolicyTimeout
        for obs in probe:
            reply = client.act(obs)
            assert reply.action.tobytes() == runtimes[v1].act(obs)[0].tobytes() and reply.bundle_version == v1
            versions.append(reply.bundle_version)
        for target, action in ((v2, lambda: registry.promote("planar", v2)), (v1, lambda: registry.rollback("planar"))):
            action()
            seen_at, deadline = None, time.monotonic() + 30.0
            while seen_at is None or len(versions) - seen_at < AFTER_SWITCH:
                obs = rng.uniform(low, high).astype(np.float32)
                reply = client.act(obs)
                assert reply.action.tobytes() == runtimes[reply.bundle_version].act(obs)[0].tobytes()
                versions.append(reply.bundle_version)
                if seen_at is None and reply.bundle_version == target:
                    seen_at = len(versions)
                assert time.monotonic() < deadline, f"v{target} was never served"
        stats = client.status().counters
        client.close()
        text = server.stop()
    switches = [i for i in range(1, len(versions)) if versions[i] != versions[i - 1]]
    assert len(switches) == 2 and versions[0] == v1 and versions[-1] == v1, "one clean switch each way"
    assert stats["reloads"] == 2 and stats["requests"] == stats["answered"] == len(versions) + 1
    assert "reloaded planar v2" in text and "reloaded planar v1" in text


def test_shadow_log_through_the_sim2real_cli_splits_parts_at_a_reload(tmp_path):
    import sys

    from shield.shadowlog import read_shadow_log, shadow_log_files

    registry = Registry(tmp_path / "models")
    v1 = registry.register(write_tiny_bundle(tmp_path / "a", seed=1))
    v2 = registry.register(write_tiny_bundle(tmp_path / "b", seed=2))
    registry.promote("planar", v1)
    logs = tmp_path / "logs"
    rng = np.random.default_rng(4)
    sent = []
    with ServerProcess(
        "--registry",
        "planar",
        "--models",
        str(tmp_path / "models"),
        "--mode",
        "shadow",
        "--log",
        str(logs),
        "--deadline-us",
        "1e7",
        command=(sys.executable, "-m", "pipeline.cli", "serve"),
    ) as server:
        client = PolicyClient(server.host, server.port, timeout_s=5.0)
        versions = []
        registry_promoted = False
        while versions.count(v2) < 50:
            obs = rng.uniform(-1, 1, 4).astype(np.float32)
            reply = client.act(obs, legacy_action=[0.1, -0.1])
            versions.append(reply.bundle_version)
            sent.append(obs)
            if len(versions) == 50:
                registry.promote("planar", v2)
                registry_promoted = True
            assert len(versions) < 20000, "v2 was never served"
        client.close()
        server.stop()
    assert registry_promoted
    files = shadow_log_files(logs)
    assert len(files) >= 2  # a reload closes the part: one part never mixes versions
    cols, meta = read_shadow_log(logs)
    assert cols["obs"].tobytes() == np.stack(sent).tobytes()
    assert meta["bundle_versions"] == [v1, v2]
    runtimes = {v: EdgeRuntime.load(registry.bundle_dir("planar", v)) for v in (v1, v2)}
    for part in files:  # every logged candidate action is exactly its own part's version's
        cols, meta = read_shadow_log(part)
        rt = runtimes[meta["bundle_version"]]
        assert np.stack([rt.act(o)[0] for o in cols["obs"]]).tobytes() == cols["candidate_action"].tobytes()


PROMOTE_DURING_STARTUP = """
import sys
import shield.serve_cli as cli
from pipeline.deployment.registry import Registry
root, target = sys.argv[1], int(sys.argv[2])
load = cli._load_runtime
def loader(bundle_dir, pinned=None):
    runtime = load(bundle_dir, pinned)
    if not getattr(loader, "done", False):  # the operator's promote lands while the server starts
        loader.done = True
        Registry(root).promote("planar", target)
    return runtime
cli._load_runtime = loader
sys.exit(cli.main(sys.argv[3:]))
"""


def test_a_promote_that_lands_while_the_server_starts_is_applied(tmp_path):
    """The watcher used to read the pointer after the load, warm-up and spare sessions: a promote (or a
    rollback of a bad bundle) in that window was taken as already applied, and never was."""
    registry = Registry(tmp_path / "models")
    v1 = registry.register(write_tiny_bundle(tmp_path / "a", seed=1))
    v2 = registry.register(write_tiny_bundle(tmp_path / "b", seed=2))
    registry.promote("planar", v1)
    command = (sys.executable, "-c", PROMOTE_DURING_STARTUP, str(registry.root), str(v2))
    with ServerProcess("--registry", "planar", "--models", str(registry.root), command=command) as server:
        assert server.version == v1 and registry.production("planar") == v2
        with PolicyClient(server.host, server.port, timeout_s=5.0) as client:
            deadline = time.monotonic() + 20.0
            while client.status().bundle_version != v2:
                assert time.monotonic() < deadline, "the promote that landed during startup was never applied"
                time.sleep(0.05)
        assert "reloaded planar v2" in server.stop()


def test_a_reload_serves_the_new_bundle_with_the_deadline_of_its_own_control_period(tmp_path):
    """serve's default deadline is half the served bundle's control period. It was set once at start, so a
    promote to a bundle for a faster plant kept the old plant's deadline: replies later than the new plant's
    step were still sent as on time. An explicit --deadline-us stays whatever is served."""
    import threading

    from shield.serve_cli import _load_runtime, serve_deadline
    from shield.server import PolicyServer
    from shield.watchers import RegistryWatcher

    registry = Registry(tmp_path / "models")
    slow = registry.register(write_tiny_bundle(tmp_path / "a", seed=1, control_period_s=0.02))
    fast = registry.register(write_tiny_bundle(tmp_path / "b", seed=2, control_period_s=0.002))
    plain = registry.register(write_tiny_bundle(tmp_path / "c", seed=3))
    for given, expected in (
        (None, {slow: 10_000, fast: 1_000, plain: 1_000}),
        (700.0, dict.fromkeys((slow, fast), 700)),
    ):
        registry.promote("planar", slow)
        runtime = _load_runtime(registry.bundle_dir("planar", slow))
        server = PolicyServer(runtime, deadline_us=serve_deadline(given, runtime)[0])
        watcher = RegistryWatcher(
            server, registry.root, "planar", _load_runtime, poll_s=0.02, deadline=lambda rt: serve_deadline(given, rt)
        )
        loop = threading.Thread(target=server.serve_forever, kwargs={"poll_s": 0.01}, daemon=True)
        loop.start()
        watcher.start()
        try:
            with PolicyClient(*server.address, timeout_s=5.0) as client:
                assert client.status().bundle_version == slow and server.deadline_ns == 1000 * expected[slow]
                for version in [v for v in (fast, plain) if v in expected]:
                    registry.promote("planar", version)
                    until = time.monotonic() + 20.0
                    while client.act(np.zeros(4, np.float32)).bundle_version != version:
                        assert time.monotonic() < until, f"v{version} was never served"
                        time.sleep(0.01)
                    assert server.deadline_ns == 1000 * expected[version], (given, version)
        finally:
            watcher.stop()
            server.stop()
            loop.join(5.0)
            server.close()
