"""Shared fixtures: one trained cart-pole policy per test session.

Training is the expensive part of the suite, so the learning test, the shield's
"return kept" test and the gate's "trained candidate passes" test all use the
same run: the default config, a fixed seed, a fixed step budget.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parents[1]

# The property tests draw the same examples on every run (the suite's result is a function of the commit, and a
# CI failure replays as it was); `pytest --hypothesis-profile=explore` (`--hypothesis-seed=N` to replay) draws new ones
# to search: a random CI run found a degenerate row of the one-condition projection (tests/shield/test_shield_cbf.py).
settings.register_profile("default", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("default")


def pytest_configure(config):
    """Tests name the shipped files as a user does, from the repository root (`configs/cartpole.yaml`), and the
    commands they start run there: the suite runs so from any working directory (`pytest /path/to/tests`)."""
    os.chdir(ROOT)


# ~250k steps take ~1.5-2 min on a quiet 2-core machine (validation included); export
# takes the checkpoint with the best validation return, reached at ~150-300k steps.
TRAINED_STEP_BUDGET = 250_000


def run_shared_dir(tmp_path_factory) -> Path:
    """This test run's temporary folder, shared by its workers (under xdist each has its own basetemp below it)."""
    shared = tmp_path_factory.getbasetemp()
    return shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared


@pytest.fixture(scope="session", autouse=True)
def synthesis_cache(tmp_path_factory):
    """Shield synthesis results (pipeline.safety.cache) shared by this run's workers and the commands they start,
    not the user's ~/.cache: a run starts from none, so every synthesis the suite checks is computed in it."""
    os.environ["SIM2REAL_CACHE_DIR"] = str(run_shared_dir(tmp_path_factory) / "cache")
    yield


@pytest.fixture(scope="session")
def trained_cartpole(tmp_path_factory):
    """The default cart-pole config trained once (fixed seed and budget), and its exported (selected) bundle.

    The README's test command runs the suite on several workers (pytest-xdist, one module per unit of work), and
    three modules use this run: the first worker to need it trains it under a file lock in the run's shared
    temporary directory, the others wait there and read what it wrote."""
    from filelock import FileLock

    from pipeline.config import load_config
    from pipeline.deployment.export import export_policy
    from pipeline.training.checkpoint import list_checkpoints
    from pipeline.training.scaffold import TrainResult
    from pipeline.training.train import train

    cfg = load_config(ROOT / "configs" / "cartpole.yaml")
    shared = run_shared_dir(tmp_path_factory)
    base, done = shared / "trained-cartpole", shared / "trained-cartpole.json"
    with FileLock(str(shared / "trained-cartpole.lock")):
        if not done.is_file():
            # A worker whose test timed out while it trained (a slow machine) left a run with checkpoints: the
            # next one continues it, as a night is resumed, instead of each starting over past its own timeout.
            resume = base / "run" if list_checkpoints(base / "run") else None
            if resume is None:
                shutil.rmtree(base, ignore_errors=True)
            else:
                shutil.rmtree(base / "bundle", ignore_errors=True)
            run = train(cfg, out_dir=base / "run", resume=resume, steps=TRAINED_STEP_BUDGET, progress=False)
            exported = export_policy(run.run_dir, out_dir=base / "bundle")
            done.write_text(json.dumps({"run": run.to_dict(), "export": exported}, default=str))
    data = json.loads(done.read_text())
    run, exported = TrainResult(**data["run"]), data["export"]
    return SimpleNamespace(
        cfg=cfg, run=run, run_dir=Path(run.run_dir), bundle=Path(exported["bundle"]), export=exported
    )


# One Prefect test server for every test that runs a flow (tests/flows/test_flows.py, the calibrated flow in
# tests/pipeline/calibration/test_calibrate.py): it takes 10-15 s to start. It starts with the first test that needs
# it and stops after the last one (counted at collection), so no other test runs with it up after that.
_HARNESS = {"stack": None, "users": 0}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    _HARNESS["users"] = sum("harness" in item.fixturenames for item in items)


@pytest.fixture(scope="session")
def harness():
    """Flows run against a temporary Prefect server and database (prefect_test_harness), shared by the session."""
    from prefect.testing.utilities import prefect_test_harness

    if _HARNESS["stack"] is None:
        stack = ExitStack()
        stack.enter_context(prefect_test_harness(server_startup_timeout=180))
        _HARNESS["stack"] = stack
    yield
    _stop_harness()


def _stop_harness():
    stack, _HARNESS["stack"] = _HARNESS["stack"], None
    if stack is not None:
        stack.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if "harness" in item.fixturenames:
        _HARNESS["users"] -= 1
        if _HARNESS["users"] <= 0:
            _stop_harness()
