"""Crash safety: a registry writer SIGKILLed at random instants never leaves a broken registry."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.deployment.registry import Registry
from shield.bundle import Bundle, resolve_production
from tests.helpers.bundle_helpers import export_test_bundle

ROOT = Path(__file__).resolve().parents[3]
TRIALS = 60

# A long-lived writer: register / promote / rollback / annotate in a loop until killed.
WRITER = """
import random, sys
from pipeline.deployment.registry import Registry, RegistryError
root, source, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = random.Random(seed)
registry = Registry(root)
print("ready", flush=True)
while True:
    op = rng.choice(["register", "register", "promote", "promote", "rollback", "annotate"])
    versions = registry.versions("planar")
    try:
        if op == "register" or not versions:
            registry.register(source, metrics={"seed": seed}, extra={"flow_run_id": f"run-{seed}"})
        elif op == "promote":
            registry.promote("planar", rng.choice(versions))
        elif op == "rollback":
            registry.rollback("planar")
        else:
            registry.annotate("planar", rng.choice(versions), metrics={"gate": {"decision": "pass", "n": rng.random()}})
    except RegistryError:
        pass  # nothing to roll back to
"""


@pytest.fixture(scope="module")
def source_bundle(tmp_path_factory):
    return export_test_bundle(tmp_path_factory, "source")[0]


def _leftovers(task_dir: Path) -> list[str]:
    """Temp files/dirs of an interrupted write (invisible to readers)."""
    return [str(p.relative_to(task_dir)) for p in task_dir.rglob(".*") if p.name != ".lock"]


def test_sigkill_at_random_instants_leaves_the_registry_consistent(source_bundle, tmp_path):
    root = tmp_path / "models"
    registry = Registry(root)
    rng = random.Random(1234)
    interrupted, promoted_seen = 0, 0
    for trial in range(TRIALS):
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), str(source_bundle), str(trial)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert writer.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.12))
        finally:
            writer.send_signal(signal.SIGKILL)
            writer.wait()
            writer.stdout.close()
        assert writer.returncode == -signal.SIGKILL

        # Every version dir that is visible is whole and verifies; versions are 1..N with no gaps.
        versions = registry.versions("planar")
        assert versions == list(range(1, len(versions) + 1))
        registry.verify("planar")  # raises BundleError naming any bad file (and checks the pointer)
        production = registry.production("planar")
        if production is not None:
            promoted_seen += 1
            assert production in versions
            assert set(registry.pointer("planar")["history"]) <= set(versions)
            Bundle.load(resolve_production(root, "planar"))
        interrupted += bool(_leftovers(root / "planar"))

    assert len(registry.versions("planar")) >= 5, "the writer must have made real progress"
    assert promoted_seen >= TRIALS // 2
    # Not vacuous: some kills landed inside a write (a temp file or staging dir was left behind)...
    assert interrupted >= 1, interrupted
    # ...and the next writer cleans such leftovers up.
    registry.register(source_bundle)
    assert _leftovers(root / "planar") == []
    registry.verify("planar")
