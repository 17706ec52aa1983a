"""`PolicyServer`: serve a shielded policy to a plant's controller over UDP.

One request, one reply, every control period (README.md, "Wire protocol"). The serving
loop is a single thread, so each request sees exactly one runtime: a hot reload
(`RegistryWatcher`, polling the registry's production pointer) builds the new
runtime in its own thread and swaps one reference between two requests.

Nothing a client sends can crash the loop or reach the policy unchecked: short
datagrams are dropped, everything else is answered; a rejected request gets the
fallback safe action with the status bit that says why. Only stdlib + numpy
here (the runtime brings onnxruntime and daqp).

`run_cli(args)` is `sim2real serve`; `python -m shield.server` is the same
command for an edge box that has only `pip install .[edge]`.
"""

from __future__ import annotations

import argparse
import gc
import hmac
import signal
import socket
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from shield.protocol import (ACT_REPLY_HEAD, ACT_REQUEST_HEAD, COUNTER_NAMES, HEADER, HEADER_SIZE, LATENCY_BINS,
                             MAC_SIZE, MAGIC, PROTOCOL_VERSION, Flags, MsgType, Status, encode_status_reply,
                             latency_bin, sign)
from shield.watchers import RegistryWatcher, Watchdog

_U32_MAX = 2**32 - 1
# Plain ints on the hot path: IntFlag arithmetic costs a microsecond per operation.
_INTERVENED, _FALLBACK, _BAD_INPUT, _AUTH_FAILED = (int(Status.INTERVENED), int(Status.FALLBACK),
                                                    int(Status.BAD_INPUT), int(Status.AUTH_FAILED))
_SHADOW, _STALE, _DEADLINE, _INFERENCE_ERROR = (int(Status.SHADOW), int(Status.STALE), int(Status.DEADLINE),
                                                int(Status.INFERENCE_ERROR))
_HMAC = int(Flags.HMAC)
_ACT_REQUEST, _ACT_REPLY = int(MsgType.ACT_REQUEST), int(MsgType.ACT_REPLY)
_STATUS_REQUEST = int(MsgType.STATUS_REQUEST)
MIN_KEY_BYTES = 16


class ServeStats:
    """Counters (names as in protocol.COUNTER_NAMES) and a log2 latency histogram (µs)."""

    def __init__(self):
        for name in COUNTER_NAMES:
            setattr(self, name, 0)
        self.histogram = [0] * LATENCY_BINS
        self.started = time.monotonic()

    def as_dict(self) -> dict[str, int]:
        """Counters by name."""
        return {name: getattr(self, name) for name in COUNTER_NAMES}

    def latency_percentile_us(self, q: float) -> float:
        """Upper edge (µs) of the histogram bin holding quantile q in [0, 1]."""
        total = sum(self.histogram)
        if total == 0:
            return float("nan")
        acc = 0
        for i, count in enumerate(self.histogram):
            acc += count
            if acc >= q * total:
                return float(2**i)
        return float("inf")

    def summary(self) -> str:
        """One line for the log: non-zero counters and latency bins."""
        counters = " ".join(f"{k}={v}" for k, v in self.as_dict().items() if v)
        return (f"stats: {counters or 'no requests'} latency_p50<={self.latency_percentile_us(0.5):g}us "
                f"p99<={self.latency_percentile_us(0.99):g}us")


class ReplayWindow:
    """Last sequence number per client; LRU-bounded so spoofed sources cannot grow it without limit.

    With a key the client is the header's authenticated `client_id`, so a captured
    packet replayed from another address is still a replay; without one it is the
    sender's address.
    """

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._last: OrderedDict[Any, int] = OrderedDict()

    def accept(self, addr: Any, seq: int) -> bool:
        """True (and remembered) if seq is newer than this address's last one."""
        last = self._last.get(addr)
        if last is not None and seq <= last:
            return False
        self._last[addr] = seq
        self._last.move_to_end(addr)
        if len(self._last) > self.capacity:
            self._last.popitem(last=False)
        return True


def fallback_action(runtime: Any) -> np.ndarray:
    """The runtime's fallback safe action: its own if it has one, else the shield spec's, else zeros in bounds."""
    getter = getattr(runtime, "fallback_action", None)
    if callable(getter):
        return np.asarray(getter(), dtype=np.float32).reshape(runtime.act_dim)
    spec = getattr(getattr(runtime, "shield", None), "spec", None)
    if spec is not None:
        if spec.fallback_action is not None:
            return np.asarray(spec.fallback_action, dtype=np.float32)
        return np.clip(np.zeros(spec.act_dim), spec.action_low, spec.action_high).astype(np.float32)
    return np.zeros(runtime.act_dim, dtype=np.float32)


class ServedBundle:
    """Everything the hot path needs from one runtime, computed once when it is loaded or swapped in."""

    def __init__(self, runtime: Any):
        self.runtime = runtime
        self.obs_dim, self.act_dim = int(runtime.obs_dim), int(runtime.act_dim)
        if callable(getattr(runtime, "reset", None)):
            # The first calls into onnxruntime and the QP solver are slow: pay them here, off the
            # hot path (a reload happens in the watcher thread), then forget the warm-up state.
            for _ in range(3):
                runtime.act(np.zeros(self.obs_dim, dtype=np.float32))
            runtime.reset()
        bundle = getattr(runtime, "bundle", None)
        self.version = int(getattr(bundle, "version", None) or getattr(runtime, "version", 0) or 0)
        self.fallback = fallback_action(runtime)
        self.fallback_bytes = self.fallback.astype("<f4").tobytes()
        shield = getattr(runtime, "shield", None)
        spec = getattr(shield, "spec", None)
        self.constraint_names = list(getattr(shield, "constraint_names", []) or [])
        self.meta = {"task": getattr(bundle, "task", "") or "", "bundle_version": self.version,
                     "control_period_s": float(getattr(spec, "dt", float("nan"))),
                     "constraint_names": self.constraint_names, "source": "serve"}


class PolicyServer:
    """UDP server: act requests in, shielded (or, in shadow mode, legacy) actions out."""

    def __init__(self, runtime: Any, *, host: str = "127.0.0.1", port: int = 0, mode: str = "active",
                 key: bytes | None = None, shadow_log: Any = None, deadline_us: float = 1000.0):
        if mode not in ("active", "shadow"):
            raise ValueError(f"mode must be 'active' or 'shadow', got {mode!r}")
        self.mode, self.key, self.shadow_log = mode, key, shadow_log
        self.deadline_ns = int(deadline_us * 1000)
        self.stats = ServeStats()
        self.window = ReplayWindow()
        self.served = ServedBundle(runtime)
        self._clients: dict[Any, list[int]] = {}  # shadow log: addr -> [episode index, step]
        self._client_id = 0
        self._stop = threading.Event()
        self.busy_since_ns = 0  # watchdog: when the current request started, 0 when idle
        self.last_request_ns = 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        # A burst (or a fuzzer) must queue, not be dropped by the kernel.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind((host, port))
        self.address: tuple[str, int] = self.sock.getsockname()

    # ---- reload ----------------------------------------------------------------
    def swap_runtime(self, runtime: Any) -> None:
        """Serve `runtime` from the next request on (one reference swap; call from any thread)."""
        new = ServedBundle(runtime)
        if (new.obs_dim, new.act_dim) != (self.served.obs_dim, self.served.act_dim):
            raise ValueError(f"new bundle is obs {new.obs_dim}/act {new.act_dim}, the plant speaks "
                             f"obs {self.served.obs_dim}/act {self.served.act_dim}; refusing to switch")
        self.served = new
        self.stats.reloads += 1

    # ---- one datagram ----------------------------------------------------------
    def handle(self, data: bytes, addr: Any, t0_ns: int | None = None) -> bytes | None:
        """The reply to one datagram, or None when it is dropped (shorter than a header)."""
        t0 = time.perf_counter_ns() if t0_ns is None else t0_ns
        stats = self.stats
        stats.requests += 1
        if len(data) < HEADER_SIZE:
            stats.dropped += 1
            return None
        srv = self.served  # one snapshot per request: a reload never mixes versions in a reply
        magic, version, msg_type, flags, seq, ts, payload_len, client_id = HEADER.unpack_from(data)
        self._client_id = client_id  # echoed in the reply
        key, body_end = self.key, len(data)
        if key is not None:
            if (not flags & _HMAC or body_end < HEADER_SIZE + MAC_SIZE
                    or not hmac.compare_digest(sign(key, data[:-MAC_SIZE]), data[-MAC_SIZE:])):
                return self._reject(srv, seq, ts, _AUTH_FAILED, t0)
            body_end -= MAC_SIZE
        elif flags & _HMAC:
            return self._reject(srv, seq, ts, _AUTH_FAILED, t0)  # signed, but this server has no key
        if magic != MAGIC or version != PROTOCOL_VERSION or payload_len != body_end - HEADER_SIZE:
            return self._reject(srv, seq, ts, _BAD_INPUT, t0)
        status = 0
        if not self.window.accept(client_id if key is not None else addr, seq):
            if key is not None:  # authenticated but old: a replay
                return self._reject(srv, seq, ts, _AUTH_FAILED | _STALE, t0)
            status = _STALE  # unauthenticated: answered, flagged so the controller can drop it
            stats.stale += 1
        if msg_type == _STATUS_REQUEST and payload_len == 0:
            stats.status_requests += 1
            stats.answered += 1
            return encode_status_reply(seq, ts, srv.version, int((time.monotonic() - stats.started) * 1e6),
                                       stats.as_dict(), stats.histogram, key, client_id)
        if msg_type != _ACT_REQUEST or payload_len < ACT_REQUEST_HEAD.size:
            return self._reject(srv, seq, ts, _BAD_INPUT | status, t0)
        n_obs, n_legacy = ACT_REQUEST_HEAD.unpack_from(data, HEADER_SIZE)
        shadow = self.mode == "shadow"
        if (n_obs != srv.obs_dim or n_legacy not in ((srv.act_dim,) if shadow else (0, srv.act_dim))
                or payload_len != ACT_REQUEST_HEAD.size + 4 * (n_obs + n_legacy)):
            return self._reject(srv, seq, ts, _BAD_INPUT | status, t0)
        floats = np.frombuffer(data, dtype="<f4", count=n_obs + n_legacy, offset=HEADER_SIZE + ACT_REQUEST_HEAD.size)
        if not np.isfinite(floats).all():
            return self._reject(srv, seq, ts, _BAD_INPUT | status, t0)
        obs = floats[:n_obs].astype(np.float32)
        stats.policy_calls += 1
        raised = False
        try:
            safe, raw, info = srv.runtime.act(obs)
            safe = np.asarray(safe, dtype="<f4").reshape(srv.act_dim)
            failed = not np.isfinite(safe).all()
        except Exception:  # any runtime failure is answered with the fallback, never a crash
            failed = raised = True
        if failed:
            stats.inference_errors += 1
            safe = raw = np.full(srv.act_dim, np.nan, np.float32)
            info = {"fallback": True}
        late = time.perf_counter_ns() - t0 > self.deadline_ns
        if late:
            stats.deadline_misses += 1
        # The shield predicts through the actions the plant really got: tell it when that
        # was not its own output. (A runtime that raised may not have filtered: nothing to correct.)
        note_sent = getattr(srv.runtime, "note_sent", None) if (shadow or late or failed) and not raised else None
        if shadow:  # the candidate's failures and delays are logged; the plant keeps its legacy action
            legacy = floats[n_obs:]
            self._log(srv, addr, obs, legacy, raw, safe, info, t0)
            if note_sent is not None:
                note_sent(legacy)
            return self._reply(srv, seq, ts, status | _SHADOW, legacy.tobytes(), t0)
        if note_sent is not None:
            note_sent(srv.fallback)
        if failed:
            return self._reject(srv, seq, ts, _INFERENCE_ERROR | status, t0)
        if late:
            return self._reject(srv, seq, ts, _DEADLINE | _FALLBACK | status, t0)
        if info.get("intervened"):
            status |= _INTERVENED
            stats.interventions += 1
        if info.get("fallback"):
            status |= _FALLBACK
        if info.get("bad_input"):  # the request was checked finite: the policy's own output was not
            status |= _INFERENCE_ERROR
            stats.inference_errors += 1
        return self._reply(srv, seq, ts, status, safe.tobytes(), t0)

    def _reject(self, srv: ServedBundle, seq: int, ts: int, status: int, t0: int) -> bytes:
        return self._reply(srv, seq, ts, status | _FALLBACK, srv.fallback_bytes, t0)

    def _reply(self, srv: ServedBundle, seq: int, ts: int, status: int, action: bytes, t0: int) -> bytes:
        stats = self.stats
        latency_us = min((time.perf_counter_ns() - t0) // 1000, _U32_MAX)
        stats.answered += 1
        stats.histogram[latency_bin(latency_us)] += 1
        if status & _FALLBACK:
            stats.fallbacks += 1
        if status & _BAD_INPUT:
            stats.bad_inputs += 1
        if status & _AUTH_FAILED:
            stats.auth_failures += 1
        key = self.key
        frame = (HEADER.pack(MAGIC, PROTOCOL_VERSION, _ACT_REPLY, _HMAC if key is not None else 0,
                             seq, ts, ACT_REPLY_HEAD.size + len(action), self._client_id)
                 + ACT_REPLY_HEAD.pack(int(status), latency_us, srv.version, len(action) // 4, 0) + action)
        return frame + sign(key, frame) if key is not None else frame

    def _log(self, srv: ServedBundle, addr: Any, obs, legacy, raw, safe, info: dict, t0: int) -> None:
        if self.shadow_log is None:
            return
        client = self._clients.get(addr)
        if client is None:
            client = self._clients[addr] = [len(self._clients), 0]
        h = info.get("h")
        h = (np.full(len(srv.constraint_names), np.nan, np.float32) if h is None
             else np.asarray(h, dtype=np.float32).reshape(-1))
        self.shadow_log.append(srv.meta, time.time(), client[0], client[1], obs, legacy.copy(),
                               np.asarray(raw, np.float32).reshape(-1), safe, bool(info.get("intervened")),
                               bool(info.get("fallback")), h, (time.perf_counter_ns() - t0) / 1000.0)
        client[1] += 1

    # ---- the loop ---------------------------------------------------------------
    def serve_forever(self, poll_s: float = 0.1) -> None:
        """Answer datagrams until `stop()`; never raises on a client's input."""
        sock, stats = self.sock, self.stats
        sock.settimeout(poll_s)
        while not self._stop.is_set():
            try:
                data, addr = sock.recvfrom(65535)
            except socket.timeout:
                if self.shadow_log is not None:
                    self.shadow_log.flush_if_due()  # a plant that stopped talking still gets its log on disk
                continue
            except OSError:
                if self._stop.is_set():
                    break
                continue  # e.g. an ICMP error queued on the socket: nothing to answer
            t0 = self.busy_since_ns = time.perf_counter_ns()
            self.last_request_ns = t0
            try:
                reply = self.handle(data, addr, t0)
            except Exception as err:  # a bug here must cost one reply, not the plant's controller
                print(f"serve: internal error on a {len(data)}-byte datagram: {err!r}", file=sys.stderr)
                reply = None
                stats.dropped += 1
            if reply is not None:
                try:
                    sock.sendto(reply, addr)
                except OSError:
                    pass  # the client is gone; its next request gets the next reply
            self.busy_since_ns = 0

    def stop(self) -> None:
        """Ask the loop to finish after the current request (signal-safe)."""
        self._stop.set()

    def close(self) -> None:
        """Flush the shadow log (waiting for it) and close the socket."""
        self._stop.set()
        if self.shadow_log is not None:
            self.shadow_log.close()
        self.sock.close()


def read_key_file(path: str | Path) -> bytes:
    """The pre-shared HMAC key: the file's bytes without trailing whitespace (>= 16 bytes)."""
    key = Path(path).read_bytes().rstrip(b" \t\r\n")
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{path}: key is {len(key)} bytes; use at least {MIN_KEY_BYTES} random bytes")
    return key


def _load_runtime(bundle_dir: Path) -> Any:
    from shield.runtime import EdgeRuntime

    return EdgeRuntime.load(bundle_dir)


def run_cli(args: argparse.Namespace) -> int:
    """`sim2real serve`: load a verified bundle, answer the plant until SIGTERM/SIGINT, print stats."""
    from shield.bundle import BundleError, resolve_production

    bundle, task = getattr(args, "bundle", None), getattr(args, "registry", None)
    mode, log_dir = getattr(args, "mode", "active"), getattr(args, "log", None)
    if bool(bundle) == bool(task):
        print("serve: give exactly one of BUNDLE or --registry TASK", file=sys.stderr)
        return 2
    if mode == "shadow" and not log_dir:
        print("serve: --mode shadow needs --log DIR (the shadow log is the point of shadow mode)", file=sys.stderr)
        return 2
    models = Path(getattr(args, "models", None) or "models")
    try:
        key = read_key_file(args.key_file) if getattr(args, "key_file", None) else None
        bundle_dir = resolve_production(models, task) if task else Path(bundle)
        runtime = _load_runtime(bundle_dir)
    except (BundleError, OSError, ValueError) as err:
        print(f"serve: {err}", file=sys.stderr)
        return 2
    shadow_log = None
    if mode == "shadow":
        from shield.shadowlog import ShadowLogWriter

        shadow_log = ShadowLogWriter(log_dir)
    try:
        server = PolicyServer(runtime, host=getattr(args, "host", "127.0.0.1"), port=int(getattr(args, "port", 9870)),
                              mode=mode, key=key, shadow_log=shadow_log,
                              deadline_us=float(getattr(args, "deadline_us", None) or 1000.0))
    except OSError as err:
        print(f"serve: cannot bind {getattr(args, 'host', '')}:{getattr(args, 'port', '')}: {err.strerror}",
              file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    helpers: list[Any] = [Watchdog(server)]
    if task:
        helpers.append(RegistryWatcher(server, models, task, _load_runtime))
    for h in helpers:
        h.start()
    # Everything loaded so far lives as long as the server: keep the cyclic GC from rescanning it
    # on the hot path (fewer, shorter collector pauses between control periods).
    gc.collect()
    gc.freeze()
    host, port = server.address
    print(f"serve: listening udp://{host}:{port} task={server.served.meta['task']} "
          f"version={server.served.version} mode={mode} auth={'hmac' if key else 'off'}", flush=True)
    try:
        server.serve_forever()
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
    p.add_argument("bundle", nargs="?", help="bundle directory (or use --registry)")
    p.add_argument("--registry", metavar="TASK", help="serve TASK's production bundle and hot-reload on promote")
    p.add_argument("--models", default="models", help="registry root for --registry (default models/)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=9870, help="UDP port (default 9870; 0 picks a free one)")
    p.add_argument("--mode", choices=["active", "shadow"], default="active")
    p.add_argument("--key-file", help="pre-shared HMAC-SHA256 key file; requests must be signed")
    p.add_argument("--log", metavar="DIR", help="write shadow logs (NPZ) here")
    p.add_argument("--deadline-us", type=float, default=1000.0, help="per-request compute deadline (µs)")
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
