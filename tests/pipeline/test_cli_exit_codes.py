"""One exit-code policy for every `sim2real` command (pipeline.commands): 0 ok, 1 the check said no,
2 a user error in one line on stderr, 130 interrupted; a bug keeps its traceback."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.cli import main
from pipeline.commands import emit, guarded

ROOT = Path(__file__).resolve().parents[2]


def _one_error_line(err: str, command: str) -> None:
    assert err.startswith(f"sim2real {command}: error: ") and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "argv,culprit",
    [
        (["config", "--check", "no/such.yaml"], "no/such.yaml"),
        (["eval", "--policy", "legacy", "some/bundle"], "BUNDLE"),
        (["eval", "--policy", "legacy", "--episodes", "0"], "--episodes"),
        (["falsify", "--budget-s", "0"], "--budget-s"),
        (["falsify", "--candidates", "0"], "--candidates"),
        (["shadow", "no/such/bundle", "--episodes", "1"], "no/such/bundle"),
        (["export", "no/such/run"], "no/such/run"),
        (["calibrate", "--from-log", "no/such/log.npz"], "no/such/log.npz"),
        (["train", "--config", "no/such.yaml"], "no/such.yaml"),
    ],
)
def test_a_user_error_is_exit_2_and_one_line_naming_the_culprit(argv, culprit, capsys, tmp_path):
    assert main(argv) == 2
    captured = capsys.readouterr()
    _one_error_line(captured.err, argv[0])
    assert culprit in captured.err and captured.out == ""


def test_registry_refusals_are_user_errors_and_a_failed_verify_is_exit_1(tmp_path, capsys):
    root = str(tmp_path / "models")
    assert main(["registry", "rollback", "cartpole", "--root", root]) == 2
    _one_error_line(capsys.readouterr().err, "registry")
    assert main(["registry", "verify", "--root", root, "--json"]) == 0  # an empty registry verifies
    assert json.loads(capsys.readouterr().out) == {"ok": True, "tasks": []}
    (tmp_path / "models" / "cartpole" / "1").mkdir(parents=True)  # a version without its files
    # --models names the registry root as in `run` and `serve`; --root, above, still does.
    assert main(["registry", "verify", "--models", root, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["tasks"][0]["task"] == "cartpole"


def test_interrupt_is_130_and_a_bug_keeps_its_traceback(capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    def buggy(args):
        raise RuntimeError("a bug, not the user's")

    assert guarded("train", interrupted, argparse.Namespace()) == 130
    assert capsys.readouterr().err == "interrupted\n"
    with pytest.raises(RuntimeError, match="a bug"):
        guarded("train", buggy, argparse.Namespace())


def test_the_console_script_exits_with_the_policy_code():
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "config", "--check", "no/such.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    _one_error_line(out.stderr, "config")


def test_a_reader_that_closes_the_pipe_early_ends_the_command_quietly():
    """`sim2real config | head -1`: the reader takes one line and goes; no BrokenPipeError traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "config"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does after its line
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_json_output_is_one_object_with_numpy_values_as_lists(capsys):
    emit(
        argparse.Namespace(json=True),
        {"rmse": np.array([0.5, 0.25], dtype=np.float32), "n": np.int64(3), "path": Path("runs/x")},
        "human text",
    )
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and json.loads(out) == {"rmse": [0.5, 0.25], "n": 3, "path": "runs/x"}
    emit(argparse.Namespace(json=False), {"n": 1}, "human text")
    assert capsys.readouterr().out == "human text\n"


@pytest.mark.timeout(300)
def test_sigterm_mid_training_is_an_interrupt_not_an_abort(tmp_path):
    """helper-55 stopped a night with SIGTERM (what cron and systemd send): Ray's driver handler aborted the process
    with a stack dump (exit 134), and a `kill` after training left the temporary Prefect server running. A command
    takes SIGTERM as Ctrl-C: its cleanup runs, it says "interrupted", exit 130; the handler before is put back."""
    import os
    import signal

    before = signal.getsignal(signal.SIGTERM)
    assert guarded("config", lambda args: 0, argparse.Namespace()) == 0
    assert signal.getsignal(signal.SIGTERM) is before
    import yaml

    root = Path(__file__).resolve().parents[2]
    data = yaml.safe_load((root / "configs" / "cartpole.yaml").read_text())
    data["plant"]["mjcf"] = str(root / "configs" / data["plant"]["mjcf"])
    data["train"].update(num_actors=1, envs_per_actor=4, device="cpu")
    config = tmp_path / "cartpole.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "train", "--config", str(config), "--steps", "100000"],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    seen = []
    for line in proc.stderr:  # training under way: Ray is up, its actors stepping
        seen.append(line)
        if line.startswith("train: "):
            break
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 130, "".join(seen) + rest
    assert rest.rstrip().endswith("interrupted") and "SIGTERM received" not in rest, rest[-2000:]
