"""Threads beside the serving loop: hot reload of a newly promoted bundle, and the watchdog.

Neither touches the hot path: `RegistryWatcher` loads and verifies the new
runtime in its own thread and hands it to `PolicyServer.swap_runtime`, which
swaps one reference between two requests; `Watchdog` only reads two timestamps.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Watchdog(threading.Thread):
    """Warns (stderr) when one request hangs the loop (`one request has taken N ms`), when no request
    has been accepted for `silence_s` after traffic (`no request for N s`: every plant went silent, or
    the network did; datagrams that fail authentication do not count), and when new plants were
    refused for want of a session (`N new plant request(s) refused`). Once per episode, not every tick."""

    def __init__(self, server: Any, *, stall_s: float = 0.5, silence_s: float = 1.0):
        super().__init__(name="serve-watchdog", daemon=True)
        self.server, self.stall_ns, self.silence_ns = server, int(stall_s * 1e9), int(silence_s * 1e9)
        self.refusal_every_ns = int(10e9)  # a plant refused at 1 kHz is said once in 10 s, with the count
        self._halt = threading.Event()
        self._stalled = self._silent = False
        self._refused = server.stats.plants_refused
        self._refusal_noted: int | None = None  # when refusals were last said; None: never, the first is said at once

    def run(self) -> None:
        while not self._halt.wait(0.1):
            self.check(time.perf_counter_ns())

    def check(self, now: int) -> None:
        """One tick at `now` (perf_counter ns): the thread calls it every 0.1 s; a test can call it with any clock."""
        busy, last, refused = self.server.busy_since_ns, self.server.last_request_ns, self.server.stats.plants_refused
        due = self._refusal_noted is None or now - self._refusal_noted > self.refusal_every_ns
        if refused != self._refused and due:
            print(
                f"serve: watchdog: {refused - self._refused} new plant request(s) refused "
                f"(BUSY): all {self.server.plants.capacity} plant sessions are held by plants heard from in "
                f"the last second; raise --max-plants",
                file=sys.stderr,
            )
            self._refused, self._refusal_noted = refused, now
        if busy and now - busy > self.stall_ns and not self._stalled:
            print(f"serve: watchdog: one request has taken {(now - busy) / 1e6:.0f} ms", file=sys.stderr)
        self._stalled = bool(busy and now - busy > self.stall_ns)
        quiet = bool(last and now - last > self.silence_ns)
        if quiet and not self._silent:
            print(f"serve: watchdog: no request for {(now - last) / 1e9:.1f} s", file=sys.stderr)
        self._silent = quiet

    def stop(self) -> None:
        self._halt.set()


class RegistryWatcher(threading.Thread):
    """Polls a task's production pointer; on a change, loads the new bundle off the hot path and hands it over.

    The pins the pointer holds are checked on the bytes the new runtime is built from
    (`loader(bundle_dir, pinned)`). A pointer that cannot be read is reported once (and
    again when it changes), never silently skipped; the old version keeps serving.
    """

    def __init__(
        self,
        server: Any,
        models_root: str | Path,
        task: str,
        loader: Callable[[Path, dict], Any],
        *,
        poll_s: float = 0.2,
        seen: bytes | None = None,
        deadline: Callable[[Any], tuple[float, str]] | None = None,
    ):
        """`seen`: the pointer's bytes as read before the served runtime was loaded (default: read now). A
        promote or rollback that lands while the server starts then differs from it and is applied.
        `deadline(runtime)`: (µs, why) of the compute deadline a new runtime is served with (None: it keeps the
        server's), so a bundle for a plant of another rate is not held to the old one's period."""
        super().__init__(name="serve-reload", daemon=True)
        self.server, self.root, self.task, self.loader, self.poll_s = server, Path(models_root), task, loader, poll_s
        self.pointer = self.root / task / "production"
        self._halt = threading.Event()
        self._problem: str | None = None
        self._seen = self._read() if seen is None else seen
        self.deadline = deadline

    def _read(self) -> bytes | None:
        try:
            data = self.pointer.read_bytes()
        except OSError as err:
            problem = f"cannot read {self.pointer} ({err.strerror}); still serving v{self.server.served.version}"
            if problem != self._problem:
                print(f"serve: reload watcher: {problem}", file=sys.stderr, flush=True)
            self._problem = problem
            return None
        self._problem = None
        return data

    def run(self) -> None:
        from shield.bundle import gate_note, production_target

        while not self._halt.wait(self.poll_s):
            current = self._read()
            if current == self._seen or current is None:
                continue
            self._seen = current
            try:
                bundle_dir, pinned = production_target(self.root, self.task)
                runtime = self.loader(bundle_dir, pinned)
                before_ns = self.server.deadline_ns
                deadline_us, why = self.deadline(runtime) if self.deadline is not None else (None, "")
                version = self.server.swap_runtime(runtime, deadline_us)
                print(f"serve: reloaded {self.task} v{version} from {bundle_dir}", flush=True)
                if deadline_us is not None and int(deadline_us * 1000) != before_ns:
                    print(f"serve: deadline: {deadline_us:g} µs ({why}) from v{version} on", flush=True)
                bundle = getattr(runtime, "bundle", None)
                note = gate_note(bundle.manifest if bundle is not None else None, self.root)
                if note:  # promoted by hand past its gate
                    print(f"serve: note: {note}", file=sys.stderr, flush=True)
            except Exception as err:  # a bad promote must not stop the plant: keep serving the old version
                print(
                    f"serve: reload failed, still serving v{self.server.served.version}: {err}",
                    file=sys.stderr,
                    flush=True,
                )

    def stop(self) -> None:
        self._halt.set()
