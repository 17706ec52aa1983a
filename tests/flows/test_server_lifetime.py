"""The temporary Prefect server a command starts ends with the command: killed with SIGKILL (the OOM killer, a
container stopped hard) or ended in order, nothing of it is left running (`flows.server`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What `sim2real run` does before its flow, then a long wait standing for the flow.
COMMAND = (
    "import sys, time\n"
    "from flows.server import ephemeral_server, prefect_defaults\n"
    "prefect_defaults()\n"
    "print(ephemeral_server(), flush=True)\n"
    "if sys.argv[1] == 'wait':\n"
    "    time.sleep(600)\n"
)


def _running(pid: int, marker: bytes) -> bool:
    """The process `pid` runs and its command line holds `marker` (a zombie's is empty: it runs nothing)."""
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _watchdogs(server: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            watchdog = len(argv) > 3 and argv[1] == b"-c" and b"stdin.buffer.read" in argv[2]
            if watchdog and argv[3] == str(server).encode():
                out.append(int(entry.name))
    return out


def _gone(pid: int, marker: bytes, within_s: float = 60.0) -> bool:
    deadline = time.monotonic() + within_s  # a liveness bound, not a speed claim: the watchdog acts within 5 s
    while time.monotonic() < deadline:
        if not _running(pid, marker):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads processes from /proc")
@pytest.mark.parametrize("end", ["sigkill", "in order"])
def test_the_temporary_prefect_server_ends_with_the_command(end, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PYTHONPATH=str(ROOT))
    cmd = subprocess.Popen(
        [sys.executable, "-c", COMMAND, "wait" if end == "sigkill" else "exit"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    server = int(cmd.stdout.readline())
    marker = b"prefect.server.api.server"
    try:
        assert _watchdogs(server), "no watchdog beside the server"
        if end == "sigkill":
            assert _running(server, marker)
            cmd.send_signal(signal.SIGKILL)
        assert cmd.wait(timeout=120) == (-signal.SIGKILL if end == "sigkill" else 0)
        assert _gone(server, marker), "the Prefect server outlived the command that started it"
        watchdogs = _watchdogs(server)
        assert not watchdogs or all(_gone(w, b"stdin.buffer.read") for w in watchdogs)
    finally:
        if _running(server, marker):
            os.kill(server, signal.SIGKILL)
