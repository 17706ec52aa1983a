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
