"""The temporary Prefect server a command starts ends with the command: killed with SIGKILL (the OOM killer, a
container stopped hard), nothing of it is left running; ended in order, its watchdog touches nothing
(`flows.server`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.server import IN_ORDER, _tell, watchdog

ROOT = Path(__file__).resolve().parents[2]
MARKER = b"prefect.server.api.server"

# What `sim2real run` does before its flow, then a long wait standing for the flow.
COMMAND = (
    "import time\n"
    "from flows.server import ephemeral_server, prefect_defaults\n"
    "prefect_defaults()\n"
    "print(ephemeral_server(), flush=True)\n"
    "time.sleep(600)\n"
)

needs_proc = pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads processes from /proc")


def _running(pid: int, marker: bytes = MARKER) -> bool:
    """The process `pid` runs and its command line holds `marker` (a zombie's is empty: it runs nothing)."""
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _gone(pid: int, marker: bytes = MARKER, within_s: float = 60.0) -> bool:
    deadline = time.monotonic() + within_s  # a liveness bound, not a speed claim: the watchdog acts within 5 s
    while time.monotonic() < deadline:
        if not _running(pid, marker):
            return True
        time.sleep(0.2)
    return False


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


@needs_proc
def test_a_command_killed_with_sigkill_leaves_no_prefect_server(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PYTHONPATH=str(ROOT))
    cmd = subprocess.Popen(
        [sys.executable, "-c", COMMAND], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    server = int(cmd.stdout.readline())
    try:
        assert _running(server)
        watchdogs = [p for p in _children(cmd.pid) if _running(p, b"stdin.buffer")]
        assert len(watchdogs) == 1, "no watchdog beside the server"
        cmd.send_signal(signal.SIGKILL)
        assert cmd.wait(timeout=120) == -signal.SIGKILL
        assert _gone(server), "the Prefect server outlived the command that started it"
        assert _gone(watchdogs[0], b"stdin.buffer"), "the watchdog outlived the server"
    finally:
        if _running(server):
            os.kill(server, signal.SIGKILL)


@needs_proc
@pytest.mark.parametrize("end", ["died", "in order"])
def test_the_watchdog_stops_the_last_pid_it_was_told_only_when_its_command_died(end):
    """The watchdog's protocol on a stand-in server (a sleeping process whose command line reads like the server's):
    the pipe closed without a word stops the last pid told; "stopped in order" first leaves it alone (by then the
    pid may belong to another process)."""
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", MARKER.decode()])
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", MARKER.decode()])
    try:
        w, dog = watchdog()
        _tell(w, b"%d\n" % decoy.pid)  # a pid Prefect replaced (a respawn on another port)
        _tell(w, b"%d\n" % stand_in.pid)
        if end == "in order":
            _tell(w, IN_ORDER)
        os.close(w)
        assert dog.wait(timeout=60) == 0
        if end == "died":
            assert stand_in.wait(timeout=60) == -signal.SIGTERM
        else:
            assert stand_in.poll() is None
        assert decoy.poll() is None  # only the last pid told is the server's
    finally:
        for p in (stand_in, decoy):
            p.kill()
            p.wait()
