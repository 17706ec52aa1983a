"""Closed-loop serve benchmark: a simulated plant at 1 kHz / 5 kHz against a real `serve` subprocess.

Each control period the client reads the plant's state, sends it, waits for the
reply, applies the action and steps the plant (a planar double integrator,
the bundle's nominal model). The loop is paced by absolute deadlines: sleep
until shortly before the period starts, then spin, so a slow period does not
shift every later one. A deadline miss is a reply that arrives after the end
of its period (or never), or a period skipped because the loop was already
a whole period late. Baselines measured in the same run: the in-process
`EdgeRuntime.act` (the compute floor) back to back and once per period
(busy-waiting between calls: what the machine does to a call after a pause,
with no socket and no sleep), the server's own per-request cost
around an instant runtime, a bare UDP echo round trip, and how often the
platform itself stops a bare loop on the server's CPU for over 1 ms (a VM's
host taking the vCPU away): no closed loop on that box has fewer late replies.
The probe runs on every CPU at once and counts the stops that hit all of them
together (the whole VM): those not even a standby server on another CPU covers.

    python bench/bench_serve.py                      # 60 s at 1 kHz, then 60 s at 5 kHz
    python bench/bench_serve.py --seconds 5 --rates 1000 --json
    python bench/bench_serve.py --bundle models/cartpole/3   # any bundle (plant: its first 4 obs as p, v)
    python bench/bench_serve.py --realtime --cpu 1           # the server with `serve --realtime --cpu 1`
    python bench/bench_serve.py --realtime --cpu 1 --busy-poll   # ... and both ends spinning on their sockets
    python bench/bench_serve.py --bundle models/cartpole/3 --plant twin   # the bundle's own task as the plant

`--plant twin` steps the bundle's task env (its `reality` set) with each reply, so the
server sees the states a deployed policy produces (a trained policy rarely needs the
shield); the default planar plant with the tiny random-weight policy makes the shield
intervene on most steps: a worst case for the compute, not a deployment.

Reported per rate: replies later than 1 ms after their request was sent (the issue's
criterion, at every rate), replies after the end of their period (deadline misses),
round-trip and server-side (kernel receive -> reply built, from each reply's
`latency_us`) percentiles, beside the baselines measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shield.client import PolicyClient, PolicyTimeout  # noqa: E402
from shield.protocol import Status  # noqa: E402
from shield.runtime import EdgeRuntime  # noqa: E402

SPIN_MARGIN_S = 0.0003  # sleep until this long before a period starts, then busy-wait: sleep alone drifts


def percentiles(x_us: np.ndarray) -> dict:
    """p50/p99/p99.9/max of a latency sample (µs)."""
    if len(x_us) == 0:
        return {"p50": float("nan"), "p99": float("nan"), "p999": float("nan"), "max": float("nan")}
    p50, p99, p999 = np.percentile(x_us, [50, 99, 99.9])
    return {"p50": float(p50), "p99": float(p99), "p999": float(p999), "max": float(np.max(x_us))}


def wait_until(t: float) -> float:
    """Deadline pacing: sleep until shortly before perf_counter() reaches `t`, then spin; returns the time."""
    while True:
        now = time.perf_counter()
        if now >= t:
            return now
        if t - now > SPIN_MARGIN_S:
            time.sleep(t - now - SPIN_MARGIN_S)


def runtime_floor_us(bundle: Path, obs: np.ndarray, period_s: float = 0.0) -> dict:
    """In-process EdgeRuntime.act latency (µs) on the loop's own observations: what serving cannot beat.

    `period_s` > 0: one call per period, busy-waiting between calls (no sleep, no socket), as the
    server sees requests: what the machine does to a call that comes after a pause, without serving.
    """
    rt = EdgeRuntime.load(bundle)
    for o in obs[:100]:
        rt.act(o)
    out = np.empty(len(obs))
    period_ns, next_ns = int(period_s * 1e9), time.perf_counter_ns()
    for i, o in enumerate(obs):
        if period_ns:
            next_ns += period_ns
            while time.perf_counter_ns() < next_ns:
                pass
        t0 = time.perf_counter_ns()
        rt.act(o)
        out[i] = (time.perf_counter_ns() - t0) / 1e3
    return percentiles(out)


def server_overhead_us(obs_dim: int, act_dim: int, n: int = 20000) -> dict:
    """`PolicyServer.handle` around an instant runtime (µs): the cost of the protocol itself."""
    from shield.protocol import encode_act_request
    from shield.server import PolicyServer

    class InstantRuntime:
        def __init__(self):
            self.obs_dim, self.act_dim = obs_dim, act_dim
            self.action = np.zeros(act_dim, np.float32)
            self.info = {"intervened": False, "fallback": False, "bad_input": False}

        def act(self, obs):
            return self.action, self.action, self.info

    server = PolicyServer(InstantRuntime(), deadline_us=1e9)
    server.sock.close()
    frames = [encode_act_request(i + 1, 0, np.zeros(obs_dim, np.float32)) for i in range(n)]
    out = np.empty(n)
    for i, frame in enumerate(frames):
        t0 = time.perf_counter_ns()
        server.handle(frame, ("127.0.0.1", 1))
        out[i] = (time.perf_counter_ns() - t0) / 1e3
    return percentiles(out)


def udp_echo_floor_us(n: int = 5000) -> dict:
    """Bare loopback UDP round trip through a Python echo thread (µs): the transport floor."""
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    server.settimeout(0.5)
    stop = threading.Event()

    def echo():
        while not stop.is_set():
            try:
                data, addr = server.recvfrom(2048)
            except TimeoutError:
                continue
            server.sendto(data, addr)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.connect(server.getsockname())
    payload = bytes(68)
    out = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter_ns()
        client.send(payload)
        client.recv(2048)
        out[i] = (time.perf_counter_ns() - t0) / 1e3
    stop.set()
    thread.join()
    client.close()
    server.close()
    return percentiles(out)


_PACED_ECHO = """
import json, os, socket, sys, time
sys.path.insert(0, sys.argv[1])
from shield.server import SO_TIMESTAMPNS, _TIMESPEC
cpu, realtime, busy = int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
if realtime:
    from shield.serve_cli import go_realtime
    go_realtime(cpu if cpu >= 0 else None, spinning=busy)
elif cpu >= 0:
    os.sched_setaffinity(0, {cpu})
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("127.0.0.1", 0))
sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
sock.setblocking(not busy)
print(sock.getsockname()[1], flush=True)
buf = bytearray(2048)
anc = socket.CMSG_SPACE(_TIMESPEC.size)
while True:
    try:
        n, ancdata, _, addr = sock.recvmsg_into([buf], anc)
    except BlockingIOError:
        continue
    held_ns = time.time_ns()
    if n == 1:
        break
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            sec, nsec = _TIMESPEC.unpack_from(data)
            held_ns -= sec * 1_000_000_000 + nsec
    sock.sendto(held_ns.to_bytes(8, "little", signed=True), addr)
"""


def paced_echo_us(rate_hz: float, seconds: float, cpu: int | None, realtime: bool, busy_poll: bool) -> dict:
    """Baseline: a bare UDP echo server (another process, scheduled as the server is: same CPU, realtime and
    polling) answered once per control period by a client paced as the closed loop is. Its server side, from the
    kernel's receive timestamp to the datagram in the process's hands, is what the platform alone adds to the
    server's figure after each pause: the wake-up and the receive, with no work at all (µs). Its replies later
    than 1 ms (the closed loop's criterion: lost replies count, skipped periods do not; the client spins when
    `busy_poll`) are what a server that does nothing gets from this machine at this pace."""
    root = str(Path(__file__).resolve().parents[1])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _PACED_ECHO,
            root,
            str(-1 if cpu is None else cpu),
            "1" if realtime else "0",
            "1" if busy_poll else "0",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        client.connect(("127.0.0.1", int(proc.stdout.readline())))
        client.settimeout(0.0 if busy_poll else 0.05)
        period, n = 1.0 / rate_hz, int(seconds * rate_hz)
        held, rtt, payload = np.full(n, np.nan), np.full(n, np.nan), bytes(68)  # an act request's size
        start = time.perf_counter() + 0.05
        for k in range(n):
            t_start = start + k * period
            if wait_until(t_start) > t_start + period:
                continue  # a whole period late: skipped, as the closed loop does
            t0 = time.perf_counter_ns()
            client.send(payload)
            try:
                reply = client.recv(64) if not busy_poll else spin_recv(client, t0 + 50_000_000)
            except TimeoutError:
                rtt[k] = np.inf  # lost: late, as the closed loop counts a timeout
                continue
            rtt[k], held[k] = (time.perf_counter_ns() - t0) / 1e3, int.from_bytes(reply, "little", signed=True) / 1e3
        client.send(b"x")  # stop
        proc.wait(timeout=10)
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
    return {
        "server_us": percentiles(held[np.isfinite(held)]),
        "rtt_us": percentiles(rtt[np.isfinite(rtt)]),
        "periods": n,
        "later_than_1ms": int(np.sum(rtt > 1000.0)),
    }  # NaN: skipped (no request), as the loop


def spin_recv(sock: socket.socket, deadline_ns: int) -> bytes:
    """A datagram from a non-blocking socket, spinning until `deadline_ns` (perf_counter) as a busy-poll client."""
    while True:
        try:
            return sock.recv(64)
        except BlockingIOError:
            if time.perf_counter_ns() > deadline_ns:
                raise TimeoutError from None


_STALL_PROBE = """
import json, os, sys, time
seconds, cpu, realtime = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
if cpu >= 0:
    os.sched_setaffinity(0, {cpu})
if realtime:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    except OSError:
        pass
stalls = []  # (start, length) on CLOCK_MONOTONIC: every stop of over 0.5 ms
end = time.monotonic() + seconds
last = time.monotonic()
while last < end:
    spin_until = last + 0.0008
    while True:  # 0.8 ms of work
        now = time.monotonic()
        if now - last > 0.0005:
            stalls.append((last, now - last))
        last = now
        if now >= spin_until:
            break
    time.sleep(0.0002)  # 0.2 ms asleep, as a server waiting for its next request
    now = time.monotonic()
    if now - last - 0.0002 > 0.0005:
        stalls.append((last, now - last - 0.0002))
    last = now
print(json.dumps(stalls))
"""


def platform_stalls(seconds: float, cpu: int | None, realtime: bool, cpus: list[int]) -> dict:
    """Baseline: a loop that needs nothing but its CPU (0.8 ms of work, 0.2 ms asleep, a 1 kHz server's duty), on
    every CPU in `cpus` at once, under the server's scheduling: how often the platform itself stops it for over
    1 ms (a VM's host taking the vCPU away, say). A closed loop cannot have fewer late replies than the server's
    CPU has such stops; a stop on every CPU at once (the whole VM) a standby server on another CPU could not
    cover either."""
    probes = {
        c: subprocess.Popen(
            [sys.executable, "-c", _STALL_PROBE, str(seconds), str(c), "1" if realtime else "0"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for c in cpus
    }
    stalls = {c: json.loads(p.communicate()[0]) for c, p in probes.items()}
    over = {c: [(t, d) for t, d in ev if d > 0.001] for c, ev in stalls.items()}

    def everywhere(t: float, d: float, c: int) -> bool:  # the others were stopped (> 0.5 ms) during it too
        return all(any(s < t + d and t < s + e for s, e in stalls[o]) for o in cpus if o != c)

    server = cpu if cpu in over else max(over, key=lambda c: len(over[c]))  # no --cpu: the worst CPU
    return {
        "seconds": seconds,
        "cpu": server,
        "stalls_over_1ms": len(over[server]),
        "max_stall_us": round(max([d for _, d in stalls[server]], default=0.0) * 1e6, 1),
        "per_cpu_over_1ms": {str(c): len(ev) for c, ev in over.items()},
        "every_cpu_at_once_over_1ms": sum(everywhere(t, d, server) for t, d in over[server]),
    }


class PlanarPlant:
    """A planar double integrator at the control rate (the tiny bundle's nominal model)."""

    def __init__(self, obs_dim: int, period: float):
        self.period, self.obs = period, np.zeros(obs_dim, np.float32)
        self.p, self.v = np.array([-1.0, 1.0]), np.zeros(2)  # clear of the planar spec's pillar and fence
        self.rng = np.random.default_rng(0)

    def observe(self) -> np.ndarray:
        self.obs[:4] = np.concatenate([self.p, self.v]) + self.rng.normal(0, 1e-3, 4)
        return self.obs

    def apply(self, action: np.ndarray) -> None:
        a = 4.0 * np.clip(action[:2], -1, 1)  # the planar spec: 4 m/s^2 per unit action
        self.v = self.v + self.period * a
        self.p = np.clip(self.p + self.period * self.v, -3, 3)


class TwinPlant:
    """The bundle's own task env (`reality` randomization), one env step per control period, reset on episode end."""

    def __init__(self, env_id: str, seed: int = 0):
        from pipeline.training.rollout import make_env

        self.env, self.seed = make_env(env_id, "reality"), seed
        self.obs, _ = self.env.reset(seed=seed)
        self.episodes = 0

    def observe(self) -> np.ndarray:
        return np.asarray(self.obs, np.float32)

    def apply(self, action: np.ndarray) -> None:
        self.obs, _, terminated, truncated, _ = self.env.step(np.asarray(action, np.float32))
        if terminated or truncated:
            self.episodes += 1
            self.obs, _ = self.env.reset(seed=self.seed + self.episodes)


def closed_loop(host: str, port: int, rate_hz: float, seconds: float, plant, busy_poll: bool = False) -> dict:
    """Drive `plant` at rate_hz for `seconds` through the server; returns round-trip figures (µs)."""
    period = 1.0 / rate_hz
    client = PolicyClient(host, port, timeout_s=max(10 * period, 0.05), busy_poll=busy_poll)
    n = int(seconds * rate_hz)
    rtt, server_us = np.empty(n), np.empty(n)
    sent = np.zeros((n, len(plant.observe())), np.float32)
    misses = timeouts = alarms = late_1ms = intervened = 0
    start = time.perf_counter() + 0.05
    skipped = 0
    # As a real-time control loop in Python does: nothing here needs the cyclic GC (reference counting frees
    # every per-period object), and a full collection would stall one period by milliseconds.
    gc.collect()
    gc.disable()
    for k in range(n):
        t_start = start + k * period
        now = wait_until(t_start)
        if now > t_start + period:
            # Overran a whole period (the last reply, or this process, was late): a real-time
            # controller skips to the next period boundary rather than run a backlog.
            skipped += 1
            misses += 1
            rtt[k], server_us[k] = np.nan, np.nan
            continue
        obs = plant.observe()
        sent[k] = obs
        t0 = time.perf_counter_ns()
        try:
            reply = client.act(obs)
        except PolicyTimeout:
            timeouts += 1
            misses += 1
            late_1ms += 1
            rtt[k], server_us[k] = np.nan, np.nan
            continue
        t1 = time.perf_counter_ns()
        rtt[k], server_us[k] = (t1 - t0) / 1e3, reply.latency_us
        if t1 / 1e9 > t_start + period:
            misses += 1
        if t1 - t0 > 1_000_000:
            late_1ms += 1
        if reply.status & (Status.FALLBACK | Status.BAD_INPUT | Status.AUTH_FAILED):
            alarms += 1
        if reply.status & Status.INTERVENED:
            intervened += 1
        plant.apply(reply.action)
    elapsed = time.perf_counter() - start
    gc.enable()
    client.close()
    ok = rtt[np.isfinite(rtt)]
    return {
        "rate_hz": rate_hz,
        "seconds": elapsed,
        "periods": n,
        "deadline_misses": misses,
        "timeouts": timeouts,
        "later_than_1ms": late_1ms,
        "skipped_periods": skipped,
        "intervened_replies": intervened,
        "fallback_or_alarm_replies": alarms,
        "rtt_us": percentiles(ok),
        "server_us": percentiles(server_us[np.isfinite(server_us)]),
        "observations": sent[np.isfinite(rtt)],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="duration per rate (s)")
    p.add_argument("--rates", default="1000,5000", help="control rates to run (Hz), comma-separated")
    p.add_argument("--bundle", help="bundle to serve (default: a tiny planar double-integrator bundle)")
    p.add_argument(
        "--plant",
        choices=["planar", "twin"],
        default="planar",
        help="planar: a double integrator (the tiny bundle's model); twin: the bundle's task env",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=None,
        help="niceness for the server and this client (e.g. -10; negative needs root): on a shared "
        "machine it measures the server rather than the neighbours",
    )
    p.add_argument(
        "--realtime",
        action="store_true",
        help="start the server with --realtime (SCHED_FIFO, mlockall, idle CPUs polling) and run this "
        "client (the plant's controller) the same way, on the other CPUs",
    )
    p.add_argument("--cpu", type=int, help="with --realtime: pin the server to this CPU")
    p.add_argument(
        "--busy-poll",
        action="store_true",
        help="server (`serve --busy-poll`) and client spin on their sockets instead of sleeping",
    )
    p.add_argument(
        "--probe-seconds",
        type=float,
        default=20.0,
        help="baseline: how long a bare loop on the server's CPU is watched for platform stalls (s)",
    )
    p.add_argument(
        "--echo-seconds",
        type=float,
        default=None,
        help="baseline per rate: how long a bare echo server is driven at the loop's pace (s; default "
        "--seconds, so its replies later than 1 ms compare with the loop's)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)

    from tests.helpers.serve_bundles import ServerProcess, write_tiny_bundle

    if args.nice is not None:
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)  # inherited by the server subprocess
    client_realtime = []
    cpus = sorted(os.sched_getaffinity(0))  # every CPU this bench may use: the stall probe watches each
    if args.realtime:
        from shield.serve_cli import go_realtime

        others = sorted(set(cpus) - {args.cpu})
        if args.cpu is not None and others:
            os.sched_setaffinity(0, others)  # the plant's side: never on the server's CPU
        client_realtime = go_realtime(None, spinning=args.busy_poll)
        for problem in client_realtime:
            print(f"bench_serve: --realtime client: not permitted: {problem}", file=sys.stderr)
    tmp = tempfile.TemporaryDirectory()
    bundle = Path(args.bundle) if args.bundle else write_tiny_bundle(Path(tmp.name) / "bundle", seed=0, version=1)
    probe = EdgeRuntime.load(bundle)
    obs_dim = probe.obs_dim
    result = {
        "bundle": str(bundle),
        "plant": args.plant,
        "busy_poll": args.busy_poll,
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "realtime": args.realtime,
        "client_realtime_not_permitted": client_realtime,
        "load_average_before": os.getloadavg(),
        "udp_echo_us": udp_echo_floor_us(),
        "protocol_overhead_us": server_overhead_us(obs_dim, probe.act_dim),
        "platform_stalls": platform_stalls(args.probe_seconds, args.cpu, args.realtime, cpus),
        "loops": [],
    }
    for rate in (float(r) for r in args.rates.split(",")):
        # The server's compute deadline is the control period: a later reply is useless to the plant.
        extra = (
            (["--realtime"] if args.realtime else [])
            + (["--cpu", str(args.cpu)] if args.cpu is not None else [])
            + (["--busy-poll"] if args.busy_poll else [])
        )
        with ServerProcess(str(bundle), "--deadline-us", str(1e6 / rate), *extra) as server:
            plant = (
                TwinPlant(probe.bundle.manifest["env_id"]) if args.plant == "twin" else PlanarPlant(obs_dim, 1.0 / rate)
            )
            loop = closed_loop(server.host, server.port, rate, args.seconds, plant, args.busy_poll)
            with PolicyClient(server.host, server.port) as client:
                loop["server_counters"] = client.status().counters
            server.stop()
        sample = loop.pop("observations")
        sample = sample[np.random.default_rng(0).choice(len(sample), min(len(sample), 5000), replace=False)]
        loop["runtime_act_us"] = runtime_floor_us(bundle, sample)  # same states, no server, no socket
        loop["runtime_act_paced_us"] = runtime_floor_us(bundle, sample[:2000], 1.0 / rate)  # ... one per period
        loop["echo_paced_us"] = paced_echo_us(
            rate, args.echo_seconds or args.seconds, args.cpu, args.realtime, args.busy_poll
        )
        result["loops"].append(loop)
    tmp.cleanup()
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    echo, proto, stalls = result["udp_echo_us"], result["protocol_overhead_us"], result["platform_stalls"]
    print(
        f"plant {result['plant']}; niceness {result['nice']}; realtime server and client {result['realtime']}; load "
        f"average "
        f"{result['load_average_before'][0]:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs"
    )
    print(
        f"baseline: bare UDP echo p50 {echo['p50']:.1f} us, p99 {echo['p99']:.1f} us; "
        f"server protocol overhead (instant runtime) p50 {proto['p50']:.1f} us, p99 {proto['p99']:.1f} us; "
        f"a bare loop on the server's CPU was stopped for over 1 ms {stalls['stalls_over_1ms']} times in "
        f"{stalls['seconds']:.0f} s (longest {stalls['max_stall_us'] / 1e3:.1f} ms; "
        f"{stalls['every_cpu_at_once_over_1ms']} of them on every CPU at once; per CPU "
        f"{stalls['per_cpu_over_1ms']})"
    )
    for loop in result["loops"]:
        r, s, act, paced = loop["rtt_us"], loop["server_us"], loop["runtime_act_us"], loop["runtime_act_paced_us"]
        held, echo_rtt = loop["echo_paced_us"]["server_us"], loop["echo_paced_us"]["rtt_us"]
        print(
            f"{loop['rate_hz']:.0f} Hz x {loop['seconds']:.1f} s ({loop['periods']} periods): "
            f"round trip p50 {r['p50']:.1f} p99 {r['p99']:.1f} p99.9 {r['p999']:.1f} max {r['max']:.1f} us; "
            f"server p50 {s['p50']:.0f} p99 {s['p99']:.0f} us; replies later than 1 ms {loop['later_than_1ms']}; "
            f"deadline misses {loop['deadline_misses']} "
            f"({100 * loop['deadline_misses'] / loop['periods']:.3f} %; {loop['skipped_periods']} skipped), "
            f"timeouts {loop['timeouts']}, "
            f"intervened replies {loop['intervened_replies']}, fallback replies {loop['fallback_or_alarm_replies']}; "
            f"in-process act on the same states p50 {act['p50']:.0f} p99 {act['p99']:.0f} us back to back, "
            f"p50 {paced['p50']:.0f} p99 {paced['p99']:.0f} us one per period; a bare echo server at this pace: "
            f"kernel receive -> datagram in hand p50 {held['p50']:.0f} p99 {held['p99']:.0f} us, round trip "
            f"p50 {echo_rtt['p50']:.0f} p99 {echo_rtt['p99']:.0f} us, replies later than 1 ms "
            f"{loop['echo_paced_us']['later_than_1ms']} of {loop['echo_paced_us']['periods']}; "
            f"p50 round trip = {r['p50'] / act['p50']:.2f}x in-process act, "
            f"{r['p50'] / echo['p50']:.2f}x bare UDP echo"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
