"""The temporary Prefect server that `sim2real run` and `schedule --serve` start ends with the command, however it ends.

Without a `PREFECT_API_URL`, Prefect starts its own API server in a child process (`SubprocessASGIServer`, a
uvicorn) and stops it at interpreter exit. Ctrl-C and SIGTERM reach that exit (`pipeline.commands` turns SIGTERM
into an interrupt). SIGKILL does not: the OOM killer, `timeout -s KILL`, a container stopped hard. Then the
server outlives the command, owned by init, holding its port and its memory, and a nightly schedule leaves one
more every night.

So the server is started here, before the flow asks for it (Prefect's client then finds it running: one server
per process, keyed by port), and a watchdog is started beside it: a stdlib-only Python process that reads a pipe
whose writing end only this process holds. The kernel closes that end when this process dies, whatever killed
it; the watchdog then stops the server (SIGTERM, then SIGKILL after 5 s). On a normal exit, once Prefect's own
exit hook has stopped the server, this process writes one byte to the pipe ("stopped in order"), and the
watchdog leaves without touching a pid that may by then belong to another process. A pipe rather than Linux's
`PR_SET_PDEATHSIG`: Prefect starts the server without a hook for it, and a pipe works on macOS too.

With `PREFECT_API_URL` set (the user's own server) nothing is started: that server is not ours to stop.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys

# Run by the watchdog (`python -c`): argv[1] is the server's pid. It waits for the pipe on stdin to close; a byte
# first means the command ended in order. /proc, where there is one, guards against a pid taken over meanwhile.
WATCHDOG = r"""
import os, signal, sys, time
pid = int(sys.argv[1])
if sys.stdin.buffer.read(1):
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
    r, w = os.pipe()
    # Registered before the stop hook server.start() registers, so it runs after it (atexit is last in, first
    # out): the byte says "stopped in order" only once Prefect has stopped the server.
    atexit.register(_in_order, w)
    try:
        server.start()
        assert server.server_process is not None
        pid = server.server_process.pid
        subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, str(pid)],
            stdin=r,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C at the terminal is this process's to handle, not the watchdog's
        )
    finally:
        os.close(r)  # the watchdog holds its own copy; this process keeps only the writing end
    _watched.add(pid)
    return pid


def _in_order(w: int) -> None:
    try:
        os.write(w, b"x")
        os.close(w)
    except OSError:  # no watchdog reads it (the server never started)
        pass
