"""The retrain flow under Prefect's test harness, and `sim2real schedule` against a real server."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.helpers.algorithm_configs import WIRING_GATE

ROOT = Path(__file__).resolve().parents[2]


def _tiny_config(tmp_path: Path, **gate) -> Path:
    """The cart-pole config on a tiny budget, with gate thresholds a barely trained policy can meet."""
    data = yaml.safe_load((ROOT / "configs" / "cartpole.yaml").read_text())
    data["task"]["max_episode_steps"] = 100
    data["train"].update(total_env_steps=4096, num_actors=1, envs_per_actor=4, checkpoint_every=1000)
    data["shadow"].update(episodes=2)
    # The search is a wall-clock budget spent in full when it finds nothing: these tests are about the flow (retries,
    # registry, gate, artifacts), not the search's reach (tests/pipeline/evaluation/test_falsify.py, and
    # test_a_falsified_candidate_fails_the_gate below with its own budget), so 3 s, as the nightly test here.
    data["falsify"] = {"candidates": 40, "episode_steps": 80, "episodes_per_candidate": 1}
    data["gate"].update({**WIRING_GATE, **gate})
    path = tmp_path / f"tiny-{len(gate)}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _task_runs(flow_run_id: str) -> dict[str, list]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read():
        async with get_client() as client:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            out: dict[str, list] = {}
            for r in runs:
                out.setdefault(r.name.rsplit("-", 1)[0], []).append(r)
            return out

    return asyncio.run(read())


def _artifacts(flow_run_id: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
            )

    return asyncio.run(read())


@pytest.fixture(scope="module")
def promoted(harness, tmp_path_factory):
    """One promoting retrain (its first export attempt fails on purpose), shared by the tests that need a registry."""
    from flows.retrain import FAULT_DRILL_ENV, retrain

    base = tmp_path_factory.mktemp("promoted")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_DRILL_ENV, "export:1")
        state = retrain(
            config_path=str(_tiny_config(base)),
            models_root=str(base / "models"),
            runs_dir=str(base / "runs"),
            return_state=True,
        )
    return SimpleNamespace(models=base / "models", state=state)


@pytest.mark.slow
def test_flow_promotes_and_retries_a_transient_failure(promoted):
    from pipeline.deployment.registry import Registry
    from shield.bundle import verify_bundle

    state = promoted.state
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["decision"] == "pass"
    registry = Registry(promoted.models)
    assert registry.production("cartpole") == summary["version"]
    registry.verify("cartpole", summary["version"])
    manifest = verify_bundle(registry.bundle_dir("cartpole", summary["version"]))
    assert manifest["extra"]["prefect_flow_run_id"] == summary["flow_run_id"]
    assert manifest["metrics"]["gate"]["decision"] == "pass"
    verdict = manifest["metrics"]["gate"]["verdict"]
    assert verdict.startswith(
        f"promoted v{summary['version']} (no production before): every check passed, against "
        "legacy; LOOSENED: gate.min_return_ratio="
    )  # the tiny config's wiring gate, named
    assert set(summary["comparison"]) == {"candidate", "legacy"}  # no production yet: two side by side
    # The bundle's monitor sees the envelope's edge: both its thresholds measured over the config's sets.
    spec = json.loads((registry.bundle_dir("cartpole", summary["version"]) / "shield.json").read_text())
    monitor = spec["assumptions"]["monitor"]
    assert monitor["measured"]["runs"] > 0 and len(monitor["dist_accel"]) == len(monitor["accel"])

    runs = _task_runs(summary["flow_run_id"])
    assert runs["export"][0].run_count == 2, "the failed export attempt was retried"
    assert all(r.state.is_completed() for rs in runs.values() for r in rs)
    keys = {a.key for a in _artifacts(summary["flow_run_id"])}
    assert {"retrain-summary", "shadow-metrics", "shadow-report"} <= keys
    assert Path(summary["report"]).is_file()


@pytest.mark.slow
def test_failing_gate_leaves_production_unchanged(promoted, tmp_path):
    from flows.retrain import retrain
    from pipeline.deployment.registry import Registry

    models = tmp_path / "models"
    shutil.copytree(promoted.models, models)  # a registry with a production version
    before = Registry(models).production("cartpole")
    assert before == promoted.state.result()["version"]

    forced = _tiny_config(tmp_path, max_violations=0, min_return_ratio=1000.0)
    state = retrain(
        config_path=str(forced), models_root=str(models), runs_dir=str(tmp_path / "runs"), return_state=True
    )
    assert state.is_failed()
    assert Registry(models).production("cartpole") == before
    # The run's one line: the verdict with the check that failed, and what production stays.
    assert state.message.startswith("cartpole: not promoted, v") and f"production stays v{before}" in state.message
    assert "FAIL gate.min_return_ratio" in state.message and "PASS " not in state.message
    failed = Registry(models).list("cartpole")[-1]
    assert "gate.min_return_ratio" in failed["metrics"]["gate"]["failing"]  # what `registry promote` names
    flow_run_id = str(state.state_details.flow_run_id)
    summary = next(a for a in _artifacts(flow_run_id) if a.key == "retrain-summary")
    assert "FAILED" in summary.data and "return" in summary.data
    # ... and what to do about it.
    assert "## Next\n- the candidate's return falls short of gate.min_return_ratio" in summary.data
    assert Registry(models).list("cartpole")[-1]["version"] > before, "the failed candidate is still registered"


def test_a_production_bundle_that_does_not_verify_stops_the_night_before_training(promoted, tmp_path):
    """helper-44 corrupted production's policy.onnx: the night trained, falsified and ended as "gate FAIL" naming
    nothing of it. Now it stops first, names the version and what to run, and trains nothing."""
    from flows.cli import _human_summary
    from flows.retrain import retrain
    from pipeline.deployment.registry import Registry

    models = tmp_path / "models"
    shutil.copytree(promoted.models, models)
    production = Registry(models).production("cartpole")
    onnx = Registry(models).bundle_dir("cartpole", production) / "policy.onnx"
    data = bytearray(onnx.read_bytes())
    data[len(data) // 2] ^= 0xFF
    onnx.write_bytes(bytes(data))
    runs = tmp_path / "runs"
    state = retrain(
        config_path=str(_tiny_config(tmp_path)), models_root=str(models), runs_dir=str(runs), return_state=True
    )
    assert state.is_failed()
    message = str(state.message)
    assert f"production v{production} does not verify" in message and "nothing was trained" in message
    assert "sim2real registry rollback cartpole" in message and "policy.onnx" in message
    assert not runs.exists() or not any(runs.iterdir())  # no run folder: nothing trained
    assert Registry(models).production("cartpole") == production
    said = _human_summary({"task": "cartpole", "decision": "fail", "state": "Failed", "error": message})
    assert said.startswith("sim2real run: cartpole: stopped before a gate decision")


@pytest.mark.slow
def test_a_nightly_candidate_worse_than_production_keeps_production(promoted, tmp_path, capsys):
    """Production is the incumbent: last night's version (here a copy of the legacy LQR, far better than a 4k-step
    policy) runs in the same paired episodes; tonight's candidate is registered, not promoted, and every place that
    reports the run says why."""
    from flows.retrain import retrain
    from pipeline.commands.registry import run as registry_cli
    from pipeline.config import load_config
    from pipeline.deployment.registry import Registry
    from pipeline.evaluation.shadow import night_seed
    from tests.helpers.cli_args import cli_args
    from tests.helpers.shadow_candidates import cartpole_config, write_lqr_bundle

    models = tmp_path / "models"
    shutil.copytree(promoted.models, models)
    registry = Registry(models)
    incumbent = registry.register(write_lqr_bundle(tmp_path / "lqr", cartpole_config()))
    registry.promote("cartpole", incumbent)

    config = yaml.safe_load(_tiny_config(tmp_path).read_text())
    config["falsify"]["candidates"] = 40
    path = tmp_path / "nightly.yaml"
    path.write_text(yaml.safe_dump(config))
    state = retrain(config_path=str(path), models_root=str(models), runs_dir=str(tmp_path / "runs"), return_state=True)
    assert state.is_completed(), state.message  # nothing went wrong: the candidate was just not better
    summary = state.result()
    assert summary["decision"] == "kept" and summary["production"] == incumbent == summary["previous_production"]
    assert summary["verdict"].startswith(
        f"kept v{incumbent}: v{summary['version']} not better (FAIL "
        "gate.min_return_ratio_production: candidate - production"
    )
    assert set(summary["comparison"]) == {"candidate", "legacy", "production"}
    assert summary["comparison"]["production"]["version"] == incumbent
    assert registry.production("cartpole") == incumbent
    manifest = registry.show("cartpole", summary["version"])
    assert manifest["metrics"]["gate"]["verdict"] == summary["verdict"]
    assert manifest["metrics"]["gate"]["against_production"] == incumbent
    page = Path(summary["report"]).read_text()
    assert f"production v{incumbent}" in page and "Same episodes, side by side" in page
    # Tonight's plants are its own: night 3's block of seeds, none of which night 1's gate ran on.
    seeds = manifest["metrics"]["shadow"]["seeds"]
    first = night_seed(load_config(path), summary["version"])
    assert summary["version"] == 3 and seeds == list(range(first, first + len(seeds)))
    assert not set(seeds) & set(registry.show("cartpole", 1)["metrics"]["shadow"]["seeds"])
    # ... and its own falsification search: night 1 searched from falsify.seed, night 3 from two seeds on.
    assert manifest["metrics"]["falsify"]["seed"] == load_config(path).falsify.seed + 2
    assert registry.show("cartpole", 1)["metrics"]["falsify"]["seed"] == load_config(path).falsify.seed
    assert f"seeds {seeds[0]}..{seeds[-1]}" in page

    assert registry_cli(cli_args("registry", "list", "--root", str(models))) == 0
    listing = capsys.readouterr().out
    assert f"why: kept v{incumbent}: v{summary['version']} not better" in listing
    # The incumbent was put there by hand (the pointer's log says so), not by a gate run.
    assert (
        f"why: no gate verdict recorded (registered outside the retrain flow); v{incumbent} promoted by hand" in listing
    )


def test_a_falsified_candidate_fails_the_gate(harness, tmp_path, monkeypatch):
    # A planted fault: no margin and no latency prediction, against sets with noise and 40 ms latency.
    # The envelope check would refuse it at export, so it is switched off here; falsify must catch it.
    from flows.retrain import retrain
    from pipeline.deployment.registry import Registry
    from pipeline.safety import shield_spec

    monkeypatch.setattr(shield_spec, "envelope_problems", lambda *a, **k: [])
    data = yaml.safe_load(_tiny_config(tmp_path).read_text())
    data["shield"].update(margin=0.0, latency_steps=0)
    data["falsify"].update(candidates=600)
    path = tmp_path / "faulty.yaml"
    path.write_text(yaml.safe_dump(data))
    models = tmp_path / "models"
    state = retrain(config_path=str(path), models_root=str(models), runs_dir=str(tmp_path / "runs"), return_state=True)
    assert state.is_failed() and "max_falsification_cases" in state.message
    assert Registry(models).production("cartpole") is None
    # The next step names this night's files: the first case, the config, the exported bundle's shield.
    summary = state.result(raise_on_failure=False)  # a gate's "no" ends Failed with the summary as its data
    (replay,) = [line for line in summary["next_steps"] if "--replay" in line]
    case = sorted((Path(summary["run_dir"]) / "falsify").glob("case-*.json"))[0]
    assert f"--config {path} --replay {case} --bundle {Path(summary['run_dir']) / 'bundle'}" in replay


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("algorithm", ["impala"])
def test_every_algorithm_goes_through_the_flow_to_promotion(harness, algorithm, tmp_path):
    """The retrain flow (`sim2real run --config`'s, as `promoted` runs it for APPO) with another algorithm:
    trained, exported, falsified, shadowed beside legacy, gated, registered and promoted, its bundle naming its
    algorithm. The off-policy family goes through the same flow from the command line with SAC, to its registered
    bundle (test_train_sac_flow.py), and TD3 through every command (test_train_algorithms_cli.py); registering and
    promoting do not depend on the algorithm."""
    from flows.retrain import retrain
    from pipeline.deployment.registry import Registry
    from shield.bundle import verify_bundle
    from tests.helpers.algorithm_configs import small_config

    config = small_config(
        tmp_path,
        algorithm,
        shadow={"episodes": 2},
        falsify={"candidates": 40, "episode_steps": 80, "episodes_per_candidate": 1},
        gate=WIRING_GATE,
    )
    state = retrain(
        config_path=str(config),
        models_root=str(tmp_path / "models"),
        runs_dir=str(tmp_path / "runs"),
        steps=1_000,
        return_state=True,
    )
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["decision"] == "pass", summary
    registry = Registry(tmp_path / "models")
    assert registry.production("cartpole") == summary["version"] == 1
    manifest = verify_bundle(registry.bundle_dir("cartpole", 1))
    assert manifest["metrics"]["train"]["algorithm"] == algorithm and manifest["metrics"]["train"]["env_steps"] >= 1_000


@pytest.fixture()
def prefect_server(tmp_path):
    port = _free_port()
    env = dict(
        os.environ,
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_API_URL="",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(1)
    else:
        proc.kill()
        pytest.fail("prefect server did not become healthy")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def test_schedule_creates_cron_deployment_on_a_real_server(prefect_server, tmp_path):
    env = dict(os.environ, PREFECT_API_URL=prefect_server, PREFECT_HOME=str(tmp_path / "client-home"))
    logs = tmp_path / "field-logs"  # where the plant's `serve --mode shadow` writes: each night reads it anew
    logs.mkdir()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "schedule",
            "--cron",
            "0 3 * * *",
            "--config",
            "configs/cartpole.yaml",
            "--from-log",
            str(logs),
            "--steps",
            "20000",
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])

    code = (
        "import asyncio, json\n"
        "from prefect.client.orchestration import get_client\n"
        "async def main():\n"
        "    async with get_client() as c:\n"
        "        d = await c.read_deployment_by_name('retrain/retrain-cartpole')\n"
        "        print(json.dumps({'id': str(d.id), 'pool': d.work_pool_name,\n"
        "                          'crons': [s.schedule.cron for s in d.schedules],\n"
        "                          'active': [s.active for s in d.schedules], 'parameters': d.parameters}))\n"
        "asyncio.run(main())\n"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    deployment = json.loads(shown.stdout.strip().splitlines()[-1])
    assert deployment["id"] == result["deployment_id"]
    assert deployment["crons"] == ["0 3 * * *"]
    assert deployment["active"] == [True]
    assert deployment["pool"] == "sim2real-process"
    assert deployment["parameters"] == {
        "config_path": "configs/cartpole.yaml",
        "models_root": "models",
        "runs_dir": "runs",
        "steps": 20000,
        "from_log": str(logs.resolve()),
    }


def test_schedule_refuses_field_logs_that_are_not_there(tmp_path):
    """A nightly run must not find out at 3 a.m. that its logs path is wrong: exit 2 now, naming it."""
    env = dict(os.environ, PREFECT_API_URL="http://127.0.0.1:9/api", PREFECT_HOME=str(tmp_path / "home"))
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "schedule", "--from-log", str(tmp_path / "nope")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("sim2real schedule: error: --from-log ") and str(tmp_path / "nope") in out.stderr


def test_two_nights_started_within_a_minute_train_into_their_own_folders(monkeypatch):
    """Prefect's task run ids are time-ordered: their first 8 hex digits, the run folder's whole tag before, were
    the same for every run started within about a minute, and two such nights trained into one folder and each
    registered the other's bundle (an outside user's audit). The tag keeps the id's random tail too."""
    import types
    import uuid

    import flows.retrain as retrain_module

    ids = [uuid.UUID("01a22bdb-7c00-7000-8000-" + tail) for tail in ("00000000a1b2", "00000000c3d4")]
    tags = []
    for run_id in ids:
        context = types.SimpleNamespace(task_run=types.SimpleNamespace(id=run_id))
        monkeypatch.setattr(retrain_module, "get_run_context", lambda context=context: context)
        tags.append(retrain_module._run_tag())
    assert ids[0].hex[:8] == ids[1].hex[:8] and tags[0] != tags[1]
    assert all(tag.startswith("01a22bdb-") for tag in tags)  # still sorted by start time


def test_a_retried_train_step_continues_the_failed_attempt_and_run_resume_a_stopped_one(monkeypatch, tmp_path):
    """A retry of the train step keeps its task run's id, so its folder is the failed attempt's: it trained over
    it from update 1 (two attempts' checkpoints, numbered alike, in one folder). It now continues from the failed
    attempt's last checkpoint, and `sim2real run --resume RUN_DIR` continues a night stopped while it trained."""
    import logging
    import types
    import uuid

    import flows.retrain as retrain_module
    from pipeline.training.checkpoint import list_checkpoints

    context = types.SimpleNamespace(task_run=types.SimpleNamespace(id=uuid.uuid4(), run_count=1))
    monkeypatch.setattr(retrain_module, "get_run_context", lambda: context)
    monkeypatch.setattr(retrain_module, "get_run_logger", lambda: logging.getLogger("test"))
    config, runs = str(_tiny_config(tmp_path)), str(tmp_path / "runs")
    import ray

    started = not ray.is_initialized()
    if started:  # one local Ray for the three trainings (each would start and stop its own)
        ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        first = retrain_module.train_step.fn(config, runs, 1_024, None)  # the attempt that failed after 1,024 steps
        context.task_run.run_count = 2
        retried = retrain_module.train_step.fn(config, runs, 2_048, None)
        metrics = (Path(first["run_dir"]) / "metrics.jsonl").read_text().splitlines()
        # What a night killed some updates after its last checkpoint leaves: records the resumed run logs again,
        # and a line the kill cut short.
        last = json.loads(metrics[-1])
        with open(Path(first["run_dir"]) / "metrics.jsonl", "a") as f:
            f.write(json.dumps({**last, "updates": last["updates"] + 1, "env_steps": last["env_steps"] + 64}) + "\n")
            f.write('{"updates": ')
        resumed = retrain_module.train_step.fn(config, runs, 3_072, None, resume=first["run_dir"])
    finally:
        if started:
            ray.shutdown()
    assert retried["run_dir"] == first["run_dir"] and retried["updates"] > first["updates"]
    assert [json.loads(r)["updates"] for r in metrics] == list(range(1, retried["updates"] + 1))  # one run, continued
    assert resumed["run_dir"] == first["run_dir"] and resumed["updates"] > retried["updates"]
    assert resumed["env_steps"] >= 3_072 and len(list(Path(runs).iterdir())) == 1
    records = [json.loads(r) for r in (Path(first["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["updates"] for r in records] == list(range(1, resumed["updates"] + 1))  # none twice, none cut short
    assert list_checkpoints(first["run_dir"])[-1].name == f"ckpt_{resumed['updates']:08d}.pt"


def test_run_resume_refuses_a_folder_it_cannot_continue_before_a_flow_starts(tmp_path, capsys):
    from pipeline.cli import main

    empty = tmp_path / "not-a-run"
    empty.mkdir()
    assert main(["run", "--resume", str(empty), "--models", str(tmp_path / "models")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sim2real run: error: no checkpoint in ") and "\n" not in err, err
    assert main(["run", "--resume", str(tmp_path / "typo"), "--models", str(tmp_path / "models")]) == 2
    assert "typo: no such folder" in capsys.readouterr().err
    assert not (tmp_path / "models").exists()
