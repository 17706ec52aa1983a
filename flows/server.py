"""The temporary Prefect server that `sim2real run` and `schedule --serve` start ends with the command, however it ends.

Without a `PREFECT_API_URL`, Prefect starts its own API server in a child process (`SubprocessASGIServer`, a
uvicorn) and stops it at interpreter exit. Ctrl-C and SIGTERM reach that exit (`pipeline.commands` turns SIGTERM
into an interrupt). SIGKILL does not: the OOM killer, `timeout -s KILL`, a container stopped hard. Then the
server outlives the command, owned by init, holding its port and its memory, and a nightly schedule leaves one
more every night.

So the server is started here, before the flow asks for it (Prefect's client then finds it running: one server
per process, keyed by port), with a watchdog beside it: a stdlib-only Python process reading a pipe whose writing
end only this process holds. It is told the server's pid as soon as Prefect has spawned it (a startup can take
up to its 120 s timeout, and a kill in that time must not leave the server either), and each pid again if Prefect
respawns it on another port. The kernel closes the pipe when this process dies, whatever killed it; the watchdog
then stops the last pid it was told (SIGTERM, then SIGKILL after 5 s). On a normal exit, once Prefect's own exit
hook has stopped the server, this process writes "stopped in order" to the pipe and the watchdog leaves without
touching a pid that may by then belong to another process. A pipe rather than Linux's `PR_SET_PDEATHSIG`: Prefect
spawns the server without a hook for it, and a pipe works on macOS too.

The server's URL is put in this process's environment (`PREFECT_API_URL`), so that the processes it starts (the
flow runs `schedule --serve` spawns) use this watched server instead of each starting its own. With
`PREFECT_API_URL` set beforehand (the user's own server) nothing is started: that server is not ours to stop.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading

IN_ORDER = b"x\n"

# Run by the watchdog (`python -c`). Each line on stdin is the server's pid, the last one current, until IN_ORDER
# (the command ended in order: nothing to do) or the end of the pipe (the command died: stop the server). /proc,
# where there is one, guards against a pid taken over meanwhile by another process.
WATCHDOG = r"""
import os, signal, sys, time
pid = None
for line in sys.stdin.buffer:
    if line == b"x\n":
        sys.exit(0)
    pid = int(line)
if pid is None:
    sys.exit(0)
def ours():
    if not os.path.isdir("/proc"):
        return True
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"prefect.server.api.server" in f.read()
    except OSError:
        return False
def alive():
    try:
        os.kill(pid, 0)
        return ours()
    except OSError:
        return False
if alive():
    os.kill(pid, signal.SIGTERM)
    for _ in range(50):
        time.sleep(0.1)
        if not alive():
            sys.exit(0)
    if alive():
        os.kill(pid, signal.SIGKILL)
"""


def prefect_defaults() -> None:
    """Settings for the temporary server, set before Prefect is imported (it reads them once): a slow machine's
    first start is given 120 s, and nothing is sent to Prefect's analytics. A value the user set is kept."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


_watched: set[int] = set()  # server pids with a watchdog


def ephemeral_server() -> int | None:
    """Start Prefect's temporary API server now, with a watchdog that stops it when this process dies; returns
    the server's pid, or None where a `PREFECT_API_URL` names a server (then nothing is started)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the instance Prefect's client asks for (port None)
    if server.running and server.server_process is not None and server.server_process.pid in _watched:
        return server.server_process.pid
    w, _ = watchdog()
    # Registered before the stop hook server.start() registers, so it runs after it (atexit is last in, first
    # out): "stopped in order" is said only once Prefect has stopped the server.
    atexit.register(_tell, w, IN_ORDER)
    told: list[int] = []

    def tell_pid() -> None:
        process = server.server_process
        if process is not None and (not told or told[-1] != process.pid):
            told.append(process.pid)
            _tell(w, b"%d\n" % process.pid)

    done = threading.Event()

    def follow() -> None:  # the pid, as soon as Prefect has spawned the server (and again if it respawns it)
        while not done.wait(0.02):
            tell_pid()

    follower = threading.Thread(target=follow, name="prefect-server-pid", daemon=True)
    follower.start()
    try:
        server.start()
    finally:
        done.set()
        follower.join()
    tell_pid()
    assert server.server_process is not None
    os.environ["PREFECT_API_URL"] = server.api_url  # what this process starts uses this server
    _watched.add(server.server_process.pid)
    return server.server_process.pid


_watchdogs: list[subprocess.Popen] = []  # kept: a watchdog runs until this process ends


def watchdog() -> tuple[int, subprocess.Popen]:
    """Start a watchdog (`WATCHDOG`); returns the writing end of its pipe, which this process keeps open until it
    exits, and the watchdog's process. Write each pid to stop as a line, and IN_ORDER when nothing is left to stop."""
    r, w = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", WATCHDOG],
            stdin=r,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C at the terminal is this process's to handle, not the watchdog's
        )
    finally:
        os.close(r)  # the watchdog holds its own copy
    _watchdogs.append(process)
    return w, process


def _tell(w: int, message: bytes) -> None:
    try:
        os.write(w, message)
    except OSError:  # the watchdog is gone
        pass
