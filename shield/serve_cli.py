"""`sim2real serve` / `python -m shield.server`: the one definition of the command's arguments and its startup.

`add_serve_arguments(parser)` is used by both entry points (pipeline/cli.py and
shield.server.main), so their help never drifts. Startup refuses what would be
unsafe to run: a key file others can read or shorter than 32 bytes, a
non-loopback bind without a key (unless `--insecure`). `--realtime` asks the OS
for SCHED_FIFO, locked memory and a pinned CPU, and says what it did not get.

Stdlib at import (the parser is built on every `sim2real --help`).
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import math
import os
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shield.contract import describe as describe_contract

MIN_KEY_BYTES = 32
# A key of fewer distinct bytes than this is a placeholder (`aaaa...`, a repeated word), not random bytes: a
# random key of 32 bytes, or its 64 hex characters, has far more.
MIN_KEY_DISTINCT = 8
REALTIME_PRIORITY = 50  # SCHED_FIFO priority: above ordinary threads, below the kernel's own (99)


def serve_deadline(given: float | None, runtime) -> tuple[float, str]:
    """(the compute deadline in µs, why that one). Without --deadline-us: half the control period the bundle's
    contract states. A fixed 1000 µs was a whole period for a 1 kHz plant and a twentieth of a 50 Hz one, where a
    recurrent policy on a shared core overran it on 6 % of steps that had 19 ms to spare. Half a period leaves the
    other half to the network and the plant's own loop, so the action still lands in the step it was asked for
    (the latency the shield and the policy were trained with). A bundle without a contract keeps 1000 µs."""
    from shield.server import DEFAULT_DEADLINE_US

    if given is not None:
        return float(given), "--deadline-us"
    contract = runtime.bundle.manifest.get("contract") if runtime.bundle is not None else None
    period = (contract or {}).get("control_period_s")
    if isinstance(period, (int, float)) and not isinstance(period, bool) and math.isfinite(period) and period > 0:
        return 0.5e6 * float(period), f"half the contract's {1e3 * float(period):g} ms control period"
    return DEFAULT_DEADLINE_US, "the bundle states no control period"


def _positive(kind: type, what: str, smallest: float | None = None) -> Callable[[str], Any]:
    """argparse type: a finite number > 0 (a 0 or a negative here would silently mean something else), and at
    least `smallest` where the server counts in coarser units (a smaller value would round to 0)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number, got {text!r}") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"{what} must be finite and > 0, got {text!r}")
        if smallest is not None and value < smallest:
            raise argparse.ArgumentTypeError(
                f"{what} must be at least {smallest:g} (the server counts whole microseconds), got {text!r}"
            )
        return value

    return parse


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The `serve` arguments (docs/how-to/serve.md, "Running the server")."""
    p.add_argument("bundle", nargs="?", help="bundle directory (or use --registry)")
    p.add_argument(
        "--registry", metavar="TASK", help="serve TASK's production bundle and hot-reload on promote/rollback"
    )
    p.add_argument("--models", default="models", help="registry root for --registry (default models/)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="IPv4 address to bind (default 127.0.0.1; any other address needs --key-file or --insecure)",
    )
    p.add_argument("--port", type=int, default=9870, help="UDP port (default 9870; 0 picks a free one)")
    p.add_argument(
        "--mode",
        choices=["active", "shadow"],
        default="active",
        help="active: reply with the shielded action; shadow: echo the legacy action and log the "
        "candidate (needs --log)",
    )
    p.add_argument(
        "--key-file",
        help="pre-shared key: the file's bytes (not hex-decoded), >= 32 bytes, mode 0600; requests must be signed",
    )
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without a key")
    p.add_argument("--log", metavar="DIR", help="write shadow logs (NPZ) here (required with --mode shadow)")
    p.add_argument(
        "--deadline-us",
        type=_positive(float, "--deadline-us", 1.0),
        default=None,
        help="deadline from kernel receive to reply built (µs; default half the bundle's control period, 1000 for a "
        "bundle without a contract); overruns get the fallback",
    )
    p.add_argument(
        "--max-plants",
        type=_positive(int, "--max-plants"),
        default=64,
        help="plant sessions kept (default 64); a new plant takes the least recently seen one's place "
        "once that one has been silent for a second, and is refused (BUSY) until then",
    )
    p.add_argument(
        "--clock-window-ms",
        type=_positive(float, "--clock-window-ms", 0.001),
        default=1000.0,
        help="with a key: a request's seq must be within this of the server's clock (default 1000 ms)",
    )
    p.add_argument(
        "--realtime",
        action="store_true",
        help="SCHED_FIFO, mlockall and CPU pinning where permitted (docs/how-to/serve.md: what it needs)",
    )
    p.add_argument("--cpu", type=int, help="with --realtime: the CPU to pin the serving thread to")
    p.add_argument(
        "--busy-poll",
        action="store_true",
        help="spin on the socket instead of sleeping in the kernel: no wake-up latency per request, "
        "one CPU at 100 %% (pair with --realtime --cpu N)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="expose counters and the latency histogram for Prometheus on this TCP port (needs the `metrics` extra)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address of the metrics endpoint (default 127.0.0.1; any other address needs --key-file or "
        "--insecure, as --host does)",
    )


def read_key_file(path: str | Path) -> bytes:
    """The pre-shared key: the file's bytes without trailing whitespace; >= 32 bytes of at least MIN_KEY_DISTINCT
    different values, not readable by others."""
    path = Path(path)
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"{path}: key file is accessible to group/others (mode {stat.S_IMODE(mode):04o}); run `chmod 600 {path}`"
        )
    key = path.read_bytes().rstrip(b" \t\r\n")
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"{path}: key is {len(key)} bytes; use at least {MIN_KEY_BYTES} random bytes "
            f"(e.g. `openssl rand -hex 32 > {path}`: 64 characters, used as they are)"
        )
    if len(set(key)) < MIN_KEY_DISTINCT:
        raise ValueError(
            f"{path}: key has only {len(set(key))} distinct bytes: a placeholder, not a random key; use "
            f"`openssl rand -hex 32 > {path}`"
        )
    return key


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def is_loopback(host: str) -> bool:
    """True when `host` (address or name) is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


_LATENCY_QOS: list = []  # the open /dev/cpu_dma_latency: the request holds while it stays open


RT_THROTTLE_FILES = ("/proc/sys/kernel/sched_rt_runtime_us", "/proc/sys/kernel/sched_rt_period_us")


def rt_throttle() -> tuple[int, int] | None:
    """(runtime, period) in µs: the kernel lets real-time threads run at most `runtime` of every `period` on a CPU
    (`kernel.sched_rt_runtime_us`, default 950000 of 1000000); None when that throttle is off (-1). Unreadable:
    assume the default."""
    try:
        runtime, period = (int(Path(f).read_text()) for f in RT_THROTTLE_FILES)
    except (OSError, ValueError):
        return 950_000, 1_000_000
    return None if runtime < 0 else (runtime, period)


def go_realtime(cpu: int | None, helpers: tuple[int, ...] = (), spinning: bool = False) -> list[str]:
    """SCHED_FIFO, mlockall(current|future), CPU affinity, idle CPUs kept out of sleep states (PM QoS
    /dev/cpu_dma_latency = 0, held for the process's life); returns one line per thing that was not permitted.

    `helpers`: native ids of this process's other threads (the watchdog, the reload watcher). They share
    the GIL with the serving thread: left as ordinary threads on another CPU, one preempted while it holds
    the GIL would stall the serving thread for up to a scheduler slice (milliseconds). They get the same
    CPU and SCHED_FIFO one below the serving thread, so they run only while it waits, and no ordinary
    thread can preempt one holding the GIL; the GIL's switch interval drops to 100 µs, bounding the wait
    behind a reload.

    `spinning` (a thread that never sleeps: `--busy-poll`): under the kernel's real-time throttle (`rt_throttle`)
    a SCHED_FIFO thread that never sleeps is stopped for the rest of every period once it used its runtime:
    measured here, 50 ms every second, on an otherwise idle CPU. Such a thread stays an ordinary one, on its CPU
    and memory-locked, and that is said as one of the returned lines. The helpers still get SCHED_FIFO: they
    sleep almost always, and when one wakes it now runs at once, before the spinning thread, not while it waits.
    """
    problems = []
    if not _LATENCY_QOS:
        # A sleeping (halted) CPU takes tens of µs to wake on bare metal and ~100 µs on a VM before the
        # server even runs; with a 0 µs latency request the idle loop polls instead (cyclictest does the same).
        try:
            fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
            os.write(fd, (0).to_bytes(4, sys.byteorder))
            _LATENCY_QOS.append(fd)
        except OSError as err:
            problems.append(
                f"/dev/cpu_dma_latency: {err.strerror} (needs root; without it an idle CPU may sleep between requests)"
            )
    if cpu is not None:
        try:
            os.sched_setaffinity(0, {cpu})
        except (OSError, AttributeError) as err:
            problems.append(f"CPU affinity to {cpu}: {getattr(err, 'strerror', err)}")
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mlockall(1 | 2) != 0:  # MCL_CURRENT | MCL_FUTURE: no page fault on the hot path
            problems.append(
                f"mlockall: {os.strerror(ctypes.get_errno())} (needs CAP_IPC_LOCK or a large enough `ulimit -l`)"
            )
    except (OSError, AttributeError) as err:
        problems.append(f"mlockall: {err}")
    throttle = rt_throttle() if spinning else None
    if throttle is not None:
        runtime, period = throttle
        problems.append(
            f"SCHED_FIFO for a thread that spins (--busy-poll): the kernel stops real-time threads "
            f"after {runtime} of every {period} µs (kernel.sched_rt_runtime_us), so a spinning one "
            f"would stall {(period - runtime) / 1000:g} ms every {period / 1e6:g} s; it spins as an "
            f"ordinary thread on its CPU instead (set kernel.sched_rt_runtime_us = -1 for both)"
        )
    try:
        if throttle is None:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))
        for tid in helpers:
            os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY - 1))
            if cpu is not None:
                os.sched_setaffinity(tid, {cpu})
        sys.setswitchinterval(1e-4)
    except (OSError, AttributeError) as err:
        problems.append(
            f"SCHED_FIFO priority {REALTIME_PRIORITY}: {getattr(err, 'strerror', err)} (needs "
            f"CAP_SYS_NICE, root, or `ulimit -r` >= {REALTIME_PRIORITY})"
        )
    return problems


def _user_error(message: str) -> int:
    """A user error (argument, key file, bundle, address): one line on stderr, exit status 2 (as `sim2real`'s
    other commands: docs/get-started.md, "The CLI")."""
    print(f"serve: error: {message}", file=sys.stderr)
    return 2


def _load_runtime(bundle_dir: Path, pinned: dict | None = None) -> Any:
    from shield.runtime import EdgeRuntime

    return EdgeRuntime.load(bundle_dir, pinned=pinned)


def run_cli(args: argparse.Namespace) -> int:
    """`sim2real serve`: load a verified bundle, answer the plants until SIGTERM/SIGINT, print stats."""
    from shield.bundle import PRODUCTION_FILE, BundleError, production_target
    from shield.server import PolicyServer
    from shield.watchers import RegistryWatcher, Watchdog

    bundle, task = getattr(args, "bundle", None), getattr(args, "registry", None)
    mode, log_dir = getattr(args, "mode", "active"), getattr(args, "log", None)
    host = getattr(args, "host", "127.0.0.1")
    if bool(bundle) == bool(task):
        return _user_error("give exactly one of BUNDLE or --registry TASK")
    if mode == "shadow" and not log_dir:
        return _user_error("--mode shadow needs --log DIR (the shadow log is the point of shadow mode)")
    open_ok = bool(getattr(args, "key_file", None) or getattr(args, "insecure", False))
    if not open_ok and not is_loopback(host):
        return _user_error(
            f"--host {host} is not loopback and no --key-file is given: anyone on that network could "
            f"drive the plant. Give a key, or --insecure on a closed control network."
        )
    metrics_host = getattr(args, "metrics_host", "127.0.0.1")
    if getattr(args, "metrics_port", None) is not None and not open_ok and not is_loopback(metrics_host):
        return _user_error(
            f"--metrics-host {metrics_host} is not loopback and no --key-file is given: anyone on that "
            f"network could read the plant's counters. Give a key, or --insecure on a closed control "
            f"network (the endpoint itself has no authentication: put it behind your own)."
        )
    models = Path(getattr(args, "models", None) or "models")
    try:
        key = read_key_file(args.key_file) if getattr(args, "key_file", None) else None
        # The pointer as it is before the load: a promote landing during startup then reads as a change.
        seen = _read_or_none(models / task / PRODUCTION_FILE) if task else None
        if task:
            bundle_dir, pinned = production_target(models, task)
        else:
            assert bundle is not None  # the parser asks for one of BUNDLE and --registry
            bundle_dir, pinned = Path(bundle), None
        runtime = _load_runtime(bundle_dir, pinned)
    except (BundleError, OSError, ValueError) as err:
        return _user_error(str(err))
    deadline_us, deadline_why = serve_deadline(getattr(args, "deadline_us", None), runtime)
    shadow_log = None
    if mode == "shadow":
        from shield.shadowlog import ShadowLogWriter

        assert log_dir  # refused above when missing
        shadow_log = ShadowLogWriter(log_dir)
    try:
        server = PolicyServer(
            runtime,
            host=host,
            port=int(getattr(args, "port", 9870)),
            mode=mode,
            key=key,
            shadow_log=shadow_log,
            deadline_us=deadline_us,
            max_plants=int(getattr(args, "max_plants", 64)),
            clock_window_us=round(1000 * float(getattr(args, "clock_window_ms", 1000.0))),
        )
    except OSError as err:
        return _user_error(f"cannot bind {host}:{getattr(args, 'port', '')}: {err.strerror}")
    except ValueError as err:
        return _user_error(str(err))
    metrics = None
    if getattr(args, "metrics_port", None) is not None:
        from shield.metrics import MetricsError, start_metrics_server

        try:
            metrics = start_metrics_server(server, args.metrics_port, metrics_host)
        except MetricsError as err:
            server.close()
            return _user_error(str(err))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    helpers: list[Any] = [Watchdog(server)]
    if task:
        given = getattr(args, "deadline_us", None)
        helpers.append(
            RegistryWatcher(
                server, models, task, _load_runtime, seen=seen, deadline=lambda rt: serve_deadline(given, rt)
            )
        )
    for h in helpers:
        h.start()
    if getattr(args, "realtime", False):
        for problem in go_realtime(
            getattr(args, "cpu", None), tuple(h.native_id for h in helpers), spinning=getattr(args, "busy_poll", False)
        ):
            print(f"serve: --realtime: not permitted: {problem}; continuing without it", file=sys.stderr)
    elif getattr(args, "cpu", None) is not None:
        print("serve: --cpu only applies with --realtime", file=sys.stderr)
    if key is not None:
        # Requests with seq below the start floor are refused (replay protection across restarts):
        # start answering once a client with a synchronised clock is above it.
        wait_s = (server.guard.not_before_us - server.wall_clock_ns() // 1000) / 1e6
        if wait_s > 0:
            time.sleep(wait_s)
    # Everything loaded so far lives as long as the server: keep the cyclic GC from rescanning it
    # on the hot path (fewer, shorter collector pauses between control periods).
    gc.collect()
    gc.freeze()
    bound_host, port = server.address
    for line in describe_contract(runtime.bundle.manifest.get("contract") if runtime.bundle is not None else None):
        print(f"serve: contract: {line}", flush=True)  # what the plant's controller must send, and at which rate
    print(f"serve: deadline: {deadline_us:g} µs ({deadline_why}); a later reply is the fallback", flush=True)
    from shield.bundle import gate_note

    # Served by path: a registry's version directory is ROOT/TASK/VERSION, so its registry is two levels up.
    root = models if task else Path(bundle_dir).resolve().parent.parent
    note = gate_note(runtime.bundle.manifest if runtime.bundle is not None else None, root)
    if note:
        print(f"serve: note: {note}", file=sys.stderr, flush=True)
    extra = f" metrics=http://{metrics[0]}:{metrics[1]}/metrics" if metrics else ""
    if runtime.shielded:  # how many observations in a row the plant may miss before its replies say stop
        blind = server.served.blind_horizon
        print(
            f"serve: blind horizon: {blind} step(s): "
            + (
                "a missed observation (OBS_MISSING) is answered BLIND_PAST_HORIZON at once: stop the plant then"
                if blind == 0
                else f"up to {blind} missed observations in a row are dead-reckoned; then BLIND_PAST_HORIZON"
            ),
            flush=True,
        )
    print(
        f"serve: listening udp://{bound_host}:{port} task={server.served.meta['task']} "
        f"version={server.served.version} mode={mode} auth={'hmac' if key else 'off'}"
        f" timestamps={'kernel' if server.kernel_timestamps else 'dequeue'}{extra}",
        flush=True,
    )
    try:
        server.serve_forever(busy_poll=getattr(args, "busy_poll", False))
    finally:
        for h in helpers:
            h.stop()
        for h in helpers:
            h.join(timeout=5.0)  # a reload in progress finishes before the process exits
        server.close()
        print(f"serve: {server.stats.summary()}", flush=True)
        if shadow_log is not None:
            print(f"serve: shadow log: {len(shadow_log.written)} part(s) in {shadow_log.dir}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m shield.server`: the same as `sim2real serve`, for an edge box without pipeline/."""
    p = argparse.ArgumentParser(prog="python -m shield.server", description=run_cli.__doc__)
    add_serve_arguments(p)
    return run_cli(p.parse_args(argv))
