"""SAC through the whole flow from the command line (`sim2real run --config`), as a user's terminal-less job
runs it: the candidate a tiny budget trains fails the gate, and that expected "no" is one clear summary and
exit 1, with no traceback, no carriage return and no Ray token-authentication note on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(600)
def test_sac_flow_failing_its_gate_says_so_once_and_quietly(tmp_path):
    data = yaml.safe_load((ROOT / "configs" / "cartpole_sac.yaml").read_text())
    data["task"]["max_episode_steps"] = 100
    data["train"].update(num_actors=1, device="cpu")
    data["train"]["sac"].update(learning_starts=500, replay_ratio=8.0, log_every=20)
    data["train"]["replay"].update(num_shards=1)
    data["shadow"].update(episodes=2)
    data["falsify"] = {"candidates": 40, "episode_steps": 80, "episodes_per_candidate": 1}
    data["gate"]["min_return_ratio"] = 1000.0  # no policy passes: the gate's "no" is what is under test
    config = tmp_path / "sac.yaml"
    config.write_text(yaml.safe_dump(data))

    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "RAY_ADDRESS", "RAY_AUTH_MODE")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect"), PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "run",
            "--config",
            str(config),
            "--steps",
            "1500",
            "--models",
            str(tmp_path / "models"),
            "--runs",
            str(tmp_path / "runs"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert out.returncode == 1 and "gate FAIL" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "min_return_ratio" in out.stdout and "registered version 1" in out.stdout
    assert "Traceback" not in out.stderr, out.stderr
    assert "\r" not in out.stderr
    assert "train: " in out.stderr  # progress as plain lines
    assert "Token authentication is enabled" not in out.stderr
    manifest = yaml.safe_load(next((tmp_path / "models" / "cartpole").glob("*/manifest.json")).read_text())
    assert manifest["metrics"]["train"]["env_steps"] >= 1500 and manifest["metrics"]["gate"]["decision"] == "fail"
    assert manifest["metrics"]["train"]["algorithm"] == "sac"
