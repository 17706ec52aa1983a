"""A real `serve` subprocess on 127.0.0.1: Python and C clients get exactly the in-process shielded action;
with a key, forged and replayed packets never reach the policy; shadow mode logs readable NPZ."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from shield.client import PolicyClient
from shield.protocol import HEADER, MAC_SIZE, Status, decode_act_reply, encode_act_request
from shield.runtime import EdgeRuntime
from shield.shadowlog import COLUMNS, read_shadow_log
from tests.helpers.serve_bundles import ServerProcess, write_key_file, write_tiny_bundle

pytestmark = pytest.mark.timeout(120)  # a hung server fails the test instead of the CI job

REPO = Path(__file__).resolve().parents[2]
C_SOURCE = REPO / "examples" / "c_client" / "s2r_client.c"
# The status bits protocol.md says a controller treats as alarms (bits 1-3, 5-7, 9 and 13): the C client exits 5.
C_ALARMS = 0x2 | 0x4 | 0x8 | 0x20 | 0x40 | 0x80 | 0x200 | 0x2000
NO_DEADLINE = ("--deadline-us", "1e7")  # the parity tests must not depend on this machine's load


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return write_tiny_bundle(tmp_path_factory.mktemp("serve") / "bundle", seed=11, version=4)


@pytest.fixture(scope="module")
def c_client(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on this machine")
    exe = tmp_path_factory.mktemp("cc") / "s2r_client"
    subprocess.run([cc, "-O2", "-Wall", "-Wextra", "-Werror", "-std=c99", "-o", str(exe), str(C_SOURCE)], check=True)
    return exe


def observations(n: int, seed: int = 0) -> np.ndarray:
    """Observations across the planar task's state space, some near constraints (the shield intervenes)."""
    rng = np.random.default_rng(seed)
    return rng.uniform([-1.9, -1.9, -2, -2], [1.9, 1.9, 2, 2], (n, 4)).astype(np.float32)


def run_c(exe, server, obs, key_file=None, legacy=None) -> dict:
    args = [str(exe)] + (["-k", str(key_file)] if key_file else [])
    if legacy is not None:
        args += ["-l", ",".join(repr(float(v)) for v in legacy)]
    out = subprocess.run(
        args + [server.host, str(server.port)] + [repr(float(v)) for v in obs],
        capture_output=True,
        text=True,
        timeout=10,
    )
    fields = out.stdout.split(" bits=")
    assert out.returncode in (0, 5) and len(fields) == 2, out.stderr
    bits = np.array([int(w, 16) for w in fields[1].split()], dtype=np.uint32).view(np.float32)
    status = int(fields[0].split("status=")[1].split()[0], 16)
    assert out.returncode == (5 if status & C_ALARMS else 0), (out.returncode, hex(status))  # an alarm says so
    version = int(fields[0].split("version=")[1].split()[0])
    return {"action": bits, "status": status, "version": version}


def test_python_and_c_clients_get_the_in_process_shielded_action(bundle, c_client):
    reference = EdgeRuntime.load(bundle)
    obs_set = observations(40)
    expected = [reference.act(o) for o in obs_set]
    assert any(info["intervened"] for _, _, info in expected), "the set should exercise the shield"
    with (
        ServerProcess(str(bundle), *NO_DEADLINE) as server,
        PolicyClient(server.host, server.port, timeout_s=5.0) as client,
    ):
        for obs, (safe, _, info) in zip(obs_set, expected):
            reply = client.act(obs)
            assert reply.action.tobytes() == safe.tobytes()
            assert bool(reply.status & Status.INTERVENED) == bool(info["intervened"])
            assert reply.bundle_version == 4
        for obs, (safe, _, _) in list(zip(obs_set, expected))[:12]:  # a process per request: keep it short
            got = run_c(c_client, server, obs)
            assert got["action"].tobytes() == safe.tobytes() and got["version"] == 4
        server.stop()


def nothing_received(sock) -> bool:
    """True when no datagram is waiting on `sock` (call after a round trip that follows what was sent)."""
    sock.setblocking(False)
    try:
        sock.recv(4096)
        return False
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)


def test_auth_drops_forged_packets_and_refuses_replays_before_the_policy(bundle, c_client, tmp_path):
    key = os.urandom(32).hex().encode()
    key_file = write_key_file(tmp_path / "psk", key + b"\n")
    reference = EdgeRuntime.load(bundle)
    obs = observations(1, seed=5)[0]
    with ServerProcess(str(bundle), "--key-file", str(key_file), *NO_DEADLINE) as server:
        client = PolicyClient(server.host, server.port, key=key, timeout_s=5.0)
        captured = [
            encode_act_request(client.next_seq(), 0, o, key=key, client_id=client.client_id)
            for o in observations(20, seed=6)
        ]
        raw = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        raw.settimeout(5.0)
        for frame in captured:  # genuine packets, sent once
            raw.sendto(frame, (server.host, server.port))
            assert decode_act_reply(raw.recv(2048), key).status & Status.AUTH_FAILED == 0
        assert client.act(obs).action.tobytes() == reference.act(obs)[0].tobytes()
        assert run_c(c_client, server, obs, key_file=key_file)["action"].tobytes() == reference.act(obs)[0].tobytes()
        before = client.status().counters
        assert before["policy_calls"] == len(captured) + 2

        rng = np.random.default_rng(0)
        forged = []
        for frame in captured:
            flipped = bytearray(frame)
            flipped[rng.integers(0, len(frame))] ^= 1 << int(rng.integers(0, 8))
            forged += [
                bytes(flipped),
                frame[:-MAC_SIZE] + os.urandom(MAC_SIZE),
                frame[:-MAC_SIZE],
                encode_act_request(
                    client.next_seq(), 0, obs, key=b"not the key at all, sorry, not at all", client_id=client.client_id
                ),
                encode_act_request(client.next_seq(), 0, obs),
            ]  # unsigned
        attacker = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # another address: still a replay
        attacker.settimeout(5.0)
        for i, frame in enumerate(forged):
            (attacker if i % 2 else raw).sendto(frame, (server.host, server.port))
        mid = client.status().counters  # a round trip after the forgeries: anything they got back is queued
        assert nothing_received(raw) and nothing_received(attacker), "an unauthenticated datagram was answered"
        accepted_forgeries = mid["policy_calls"] - before["policy_calls"]
        assert accepted_forgeries == 0 and mid["auth_failures"] == len(forged)
        assert mid["dropped"] - before["dropped"] == len(forged)
        replays = captured * 3
        for i, frame in enumerate(replays):  # authenticated but old: refused, signed, before the policy
            sock = attacker if i % 2 else raw
            sock.sendto(frame, (server.host, server.port))
            reply = decode_act_reply(sock.recv(2048), key)
            assert reply.status == Status.STALE | Status.FALLBACK and reply.action.tolist() == [0.0, 0.0]
        stats = client.status().counters
        assert stats["policy_calls"] == before["policy_calls"], "a replayed packet reached the policy"
        assert stats["stale"] == len(replays)
        # The C client without the key is not answered at all.
        out = subprocess.run(
            [str(c_client), server.host, str(server.port), *map(str, obs)], capture_output=True, text=True
        )
        assert out.returncode == 2 and "timeout" in out.stderr
        raw.close()
        attacker.close()
        client.close()
        server.stop()


RESTART = 170


def test_shadow_mode_returns_legacy_and_logs_the_candidate(bundle, c_client, tmp_path):
    reference = EdgeRuntime.load(bundle)
    obs_set = observations(300, seed=9)
    legacy = np.tanh(obs_set[:, :2] * 0.7).astype(np.float32)
    with ServerProcess(str(bundle), "--mode", "shadow", "--log", str(tmp_path / "logs"), *NO_DEADLINE) as server:
        with PolicyClient(server.host, server.port, timeout_s=5.0) as client:
            for i, (obs, u) in enumerate(zip(obs_set, legacy)):
                reply = client.act(obs, legacy_action=u, new_episode=i == RESTART)  # the plant was reset there
                assert reply.action.tobytes() == u.tobytes() and reply.status & Status.SHADOW
            assert client.act(obs_set[0]).status & Status.BAD_INPUT  # shadow mode needs the legacy action
        from_c = run_c(c_client, server, obs_set[0], legacy=legacy[0])
        assert from_c["status"] == Status.SHADOW and from_c["action"].tobytes() == legacy[0].tobytes()
        text = server.stop()
    assert "stats:" in text and "shadow log" in text
    cols, meta = read_shadow_log(tmp_path / "logs")
    assert set(COLUMNS) <= set(cols)
    assert {c: cols[c].dtype.str[1:] for c in COLUMNS} == {c: np.dtype(d).str[1:] for c, d in COLUMNS.items()}
    assert len(cols["t"]) == len(obs_set) + 1 and cols["episode"][-1] == 2  # the C client is a third episode
    cols = {c: v[:-1] for c, v in cols.items()}
    assert cols["obs"].tobytes() == obs_set.tobytes() and cols["legacy_action"].tobytes() == legacy.tobytes()
    expected = [reference.act(o) for o in obs_set]
    assert np.stack([e[0] for e in expected]).tobytes() == cols["candidate_action"].tobytes()
    assert np.stack([e[1] for e in expected]).tobytes() == cols["candidate_raw"].tobytes()
    assert cols["intervened"].tolist() == [bool(e[2]["intervened"]) for e in expected]
    assert cols["h"].shape == (len(obs_set), 4) and np.isnan(cols["reward"]).all()
    # RESET_STATE starts an episode on the same socket: a calibration must not fit the reset's jump as dynamics.
    assert cols["episode"].tolist() == [0] * RESTART + [1] * (len(obs_set) - RESTART)
    assert cols["step"].tolist() == list(range(RESTART)) + list(range(len(obs_set) - RESTART))
    assert meta["task"] == "planar" and meta["bundle_version"] == 4
    assert meta["constraint_names"] == ["fence", "diagonal_wall", "pillar", "speed_limit"]


def test_serve_refuses_a_tampered_bundle(bundle, tmp_path):
    bad = tmp_path / "tampered"
    shutil.copytree(bundle, bad)
    data = bytearray((bad / "policy.onnx").read_bytes())
    data[-1] ^= 0xFF
    (bad / "policy.onnx").write_bytes(bytes(data))
    out = subprocess.run(
        [sys.executable, "-m", "shield.server", str(bad), "--port", "0"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "policy.onnx" in out.stderr and "Traceback" not in out.stderr


def test_edge_modules_import_nothing_heavy():
    code = (
        "import sys, shield.server, shield.client, shield.protocol, shield.shadowlog;"
        "heavy = {'torch', 'ray', 'mujoco', 'gymnasium', 'prefect', 'pydantic', 'yaml', 'pipeline', 'envs'}"
        " & set(sys.modules);"
        "print(sorted(heavy)); sys.exit(1 if heavy else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_status_counts_match_traffic(bundle):
    with (
        ServerProcess(str(bundle), *NO_DEADLINE) as server,
        PolicyClient(server.host, server.port, timeout_s=5.0) as client,
    ):
        for obs in observations(10, seed=1):
            client.act(obs)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.sendto(b"short", (server.host, server.port))  # dropped, not answered
        sock.sendto(b"\x00" * HEADER.size, (server.host, server.port))  # dropped: shorter than an act request
        sock.sendto(b"\x00" * 64, (server.host, server.port))  # dropped: type 0 is not a request
        sock.sendto(b"\x00" * 4 + b"\x02\x01" + b"\x00" * 58, (server.host, server.port))  # answered: bad input
        sock.settimeout(5.0)
        assert decode_act_reply(sock.recv(2048)).status & Status.BAD_INPUT
        time.sleep(0.05)
        stats = client.status().counters
        assert (stats["requests"], stats["answered"], stats["dropped"], stats["policy_calls"], stats["bad_inputs"]) == (
            15,
            12,
            3,
            10,
            1,
        )
        sock.close()
        server.stop()


def test_serve_cli_errors_are_one_clear_line(bundle, tmp_path, capsys):
    from argparse import Namespace

    from shield.server import run_cli

    def args(**kw):
        base = dict(
            bundle=None,
            registry=None,
            models=str(tmp_path / "models"),
            host="127.0.0.1",
            port=0,
            mode="active",
            key_file=None,
            log=None,
            deadline_us=1000.0,
        )
        return Namespace(**{**base, **kw})

    short_key = write_key_file(tmp_path / "short", b"0123456789abcdef0123456789abcde\n")  # 31 bytes
    open_key = tmp_path / "open"
    open_key.write_bytes(b"k" * 32)
    open_key.chmod(0o640)
    cases = [
        (args(), "exactly one of BUNDLE or --registry"),
        (args(bundle=str(bundle), registry="planar"), "exactly one of BUNDLE or --registry"),
        (args(bundle=str(bundle), mode="shadow"), "--mode shadow needs --log"),
        (args(registry="planar"), "no production version"),
        (args(bundle=str(tmp_path / "nope")), "not a bundle directory"),
        (args(bundle=str(bundle), key_file=str(short_key)), "at least 32"),
        (args(bundle=str(bundle), key_file=str(open_key)), "chmod 600"),
        (args(bundle=str(bundle), host="0.0.0.0"), "not loopback and no --key-file"),
        (args(bundle=str(bundle), metrics_port=0, metrics_host="0.0.0.0"), "--metrics-host 0.0.0.0 is not loopback"),
    ]
    for a, message in cases:
        assert run_cli(a) == 2
        err = capsys.readouterr().err
        assert err.startswith("serve: error: ") and err.count("\n") == 1, err  # one line, as every command's
        assert message in err and "Traceback" not in err, err


def test_serve_numbers_are_checked_not_silently_replaced(bundle, capsys):
    """A 0 used to mean "the default" (`or 1000`), inf crashed at startup, a negative window refused every
    request, and a value under the server's microsecond (--clock-window-ms 0.0004) rounded to a 0 window that
    refused every request: each is now an error that names the flag."""
    import argparse

    from shield.serve_cli import add_serve_arguments

    parser = argparse.ArgumentParser(prog="serve")
    add_serve_arguments(parser)
    for flag, too_fine in (("--deadline-us", "0.0004"), ("--max-plants", "0.5"), ("--clock-window-ms", "0.0004")):
        for bad in ("0", "-5", "inf", "nan", "ten", too_fine):
            with pytest.raises(SystemExit) as exit_:
                parser.parse_args(["b", flag, bad])
            assert exit_.value.code == 2 and flag in capsys.readouterr().err
    from shield.server import PolicyServer

    for bad in ({"clock_window_us": 0}, {"clock_window_us": 0.5}, {"deadline_us": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PolicyServer(EdgeRuntime.load(bundle), **bad)
    ok = parser.parse_args(["b", "--deadline-us", "250", "--max-plants", "3", "--clock-window-ms", "0.5"])
    assert (ok.deadline_us, ok.max_plants, ok.clock_window_ms) == (250.0, 3, 0.5)


def test_a_client_takes_only_its_own_reply(bundle, c_client, tmp_path):
    """Two plants' seqs (wall-clock µs) meet now and then: a reply with the right seq but another plant's
    client_id (here handed over by a relay, first) must be skipped by the Python and the C client alike. With
    a key, so must a forged reply to the very request (the genuine one with its action changed): a client that
    gave up on it would let anyone who can send it a datagram cost the plant its period."""
    import threading

    from shield.server import PolicyServer

    key = b"relay-test-key-0123456789abcdef-0123"
    key_file = write_key_file(tmp_path / "relay.key", key)
    for k in (None, key):
        server = PolicyServer(EdgeRuntime.load(bundle), key=k, deadline_us=1e9, not_before_us=0)
        server.sock.close()
        relay = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        relay.bind(("127.0.0.1", 0))
        relay.settimeout(10.0)
        other_obs = np.array([1.5, -1.5, 1.0, 1.0], np.float32)

        def serve_one():
            request, addr = relay.recvfrom(4096)
            seq, client_id = HEADER.unpack_from(request)[4], HEADER.unpack_from(request)[7]
            other = encode_act_request(seq, 0, other_obs, key=k, client_id=client_id ^ 1)
            relay.sendto(server.handle(other, ("127.0.0.1", 1)), addr)  # genuine, signed, same seq: not its own
            genuine = server.handle(request, addr)
            if k is not None:
                forged = bytearray(genuine)
                forged[HEADER.size + 16] ^= 0x40  # a bit of the first action: the MAC no longer holds
                relay.sendto(bytes(forged), addr)
            relay.sendto(genuine, addr)

        host, port = relay.getsockname()
        obs = observations(1, seed=3)[0]
        expected = EdgeRuntime.load(bundle).act(obs)[0]
        assert expected.tobytes() != EdgeRuntime.load(bundle).act(other_obs)[0].tobytes()
        thread = threading.Thread(target=serve_one)
        thread.start()
        with PolicyClient(host, port, key=k, timeout_s=5.0) as client:
            reply = client.act(obs)
        thread.join()
        assert reply.action.tobytes() == expected.tobytes() and reply.client_id == client.client_id
        thread = threading.Thread(target=serve_one)
        thread.start()
        got = run_c(c_client, SimpleNamespace(host=host, port=port), obs, key_file=key_file if k else None)
        thread.join()
        assert got["action"].tobytes() == expected.tobytes()
        relay.close()


def test_watchdog_says_each_episode_once_with_its_count(bundle, capsys):
    """Driven on its own clock, tick by tick: the thread's 0.1 s period plays no part in what is said."""
    from shield.server import PolicyServer
    from shield.watchers import Watchdog

    server = PolicyServer(EdgeRuntime.load(bundle), deadline_us=1e7)
    server.close()
    dog = Watchdog(server, silence_s=0.05)
    t = 10**12
    server.last_request_ns = t  # the plant's last request
    for _ in range(5):
        t += 10**8
        dog.check(t)
    server.last_request_ns = t  # it came back ...
    dog.check(t + 10**7)
    dog.check(t + 2 * 10**8)  # ... and went silent again: a second episode
    first = capsys.readouterr().err
    assert first.count("no request for") == 2 and "no request for 0.1 s" in first
    for _ in range(5):  # a new plant refused at every tick: said once, with that tick's count
        server.stats.plants_refused += 3
        t += 10**8
        dog.check(t)
    server.stats.plants_refused += 2
    dog.check(t + 11 * 10**9)  # 10 s on: the refusals since, all counted
    server.busy_since_ns = t
    for k in range(1, 6):  # one request hangs the loop: said once
        dog.check(t + k * 2 * 10**8)
    err = capsys.readouterr().err
    assert err.count("refused (BUSY)") == 2 and "--max-plants" in err
    assert "3 new plant request(s) refused" in err and "14 new plant request(s) refused" in err
    assert err.count("one request has taken") == 1 and "one request has taken 600 ms" in err


def test_watchdog_thread_reports_a_plant_gone_silent(bundle, capsys):
    from shield.server import PolicyServer
    from shield.watchers import Watchdog

    server = PolicyServer(EdgeRuntime.load(bundle), deadline_us=1e7)
    server.close()
    server.last_request_ns = time.perf_counter_ns() - 10**9  # the plant's last request, a second ago
    dog = Watchdog(server, silence_s=0.05)
    dog.start()
    err = ""
    for _ in range(100):  # until the thread has ticked (10 s at most)
        err += capsys.readouterr().err
        if err:
            break
        time.sleep(0.1)
    dog.stop()
    dog.join()
    assert err.count("no request for") == 1


def test_serve_has_one_argument_definition_for_both_entry_points():
    import argparse

    from pipeline.cli import build_parser
    from shield.serve_cli import add_serve_arguments

    parser, _ = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    edge = argparse.ArgumentParser()
    add_serve_arguments(edge)

    def options(p):
        return sorted((tuple(a.option_strings), a.dest, a.default, a.help) for a in p._actions if a.dest != "help")

    assert options(sub) == options(edge)


def _realtime_threads(pid: int) -> list[tuple[int, int, str]]:
    """(scheduling policy, rt priority, allowed CPUs) of each thread of process `pid` (Linux /proc)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        cpus = next(
            line.split()[1]
            for line in (task / "status").read_text().splitlines()
            if line.startswith("Cpus_allowed_list")
        )
        out.append((int(fields[38]), int(fields[37]), cpus))  # stat fields 41 (policy) and 40 (rt_priority)
    return out


def test_realtime_mode_serves_and_says_what_it_was_not_permitted(bundle):
    with ServerProcess(str(bundle), "--realtime", "--cpu", "0", *NO_DEADLINE) as server:
        with PolicyClient(server.host, server.port, timeout_s=5.0) as client:
            obs = observations(1)[0]
            assert client.act(obs).action.tobytes() == EdgeRuntime.load(bundle).act(obs)[0].tobytes()
        threads = _realtime_threads(server.proc.pid)
        text = server.stop()
    # Either it got SCHED_FIFO, mlockall and the CPU, or each refusal is one clear line (never a traceback).
    for line in text.splitlines():
        if "--realtime" in line:
            assert line.startswith("serve: --realtime: not permitted: ") and "continuing without it" in line
    assert "Traceback" not in text
    if "SCHED_FIFO" not in text:
        # The serving thread at priority 50 and the threads sharing its GIL (watchdog) at 49, all on its CPU:
        # an ordinary thread holding the GIL elsewhere could be preempted and stall it for milliseconds.
        fifo = sorted((prio, cpus) for policy, prio, cpus in threads if policy == os.SCHED_FIFO)
        assert fifo == [(49, "0"), (50, "0")], threads


def test_a_spinning_realtime_server_is_not_left_to_the_kernels_real_time_throttle(bundle):
    """`serve --realtime --busy-poll`: a SCHED_FIFO thread that never sleeps is stopped by the kernel's real-time
    throttle (kernel.sched_rt_runtime_us: 50 ms of every second by default, measured on this VM with the other
    CPU idle), which at 1 kHz is 50 replies in a row lost every second. Under that throttle the serving thread
    spins as an ordinary thread on its CPU, and the server says so; its helper still gets SCHED_FIFO."""
    from shield.serve_cli import rt_throttle

    if rt_throttle() is None:
        pytest.skip("kernel.sched_rt_runtime_us = -1: this machine does not throttle real-time threads")
    with ServerProcess(str(bundle), "--realtime", "--cpu", "0", "--busy-poll", *NO_DEADLINE) as server:
        with PolicyClient(server.host, server.port, timeout_s=5.0, busy_poll=True) as client:
            obs = observations(1)[0]
            assert client.act(obs).action.tobytes() == EdgeRuntime.load(bundle).act(obs)[0].tobytes()
        serving_policy = os.sched_getscheduler(server.proc.pid)  # the main thread serves
        threads = _realtime_threads(server.proc.pid)
        text = server.stop()
    assert serving_policy != os.SCHED_FIFO
    assert "spins as an ordinary thread" in text and "kernel.sched_rt_runtime_us" in text
    assert "Traceback" not in text
    if "SCHED_FIFO priority" not in text:  # permitted: the watchdog sharing its GIL is SCHED_FIFO on its CPU
        assert [(prio, cpus) for policy, prio, cpus in threads if policy == os.SCHED_FIFO] == [(49, "0")], threads


def test_busy_poll_server_and_client_answer_byte_exact(bundle):
    """`serve --busy-poll` and `PolicyClient(busy_poll=True)` spin instead of sleeping: same replies, same state."""
    reference = EdgeRuntime.load(bundle)
    obs_set = observations(30)
    expected = [reference.act(o)[0] for o in obs_set]  # one plant: the shield's state carries over the sequence
    with ServerProcess(str(bundle), "--busy-poll", *NO_DEADLINE) as server:
        with PolicyClient(server.host, server.port, timeout_s=5.0, busy_poll=True) as client:
            for obs, safe in zip(obs_set, expected):
                assert client.act(obs).action.tobytes() == safe.tobytes()
            assert client.status().counters["policy_calls"] == len(obs_set)
        text = server.stop()
    assert "Traceback" not in text


@pytest.mark.parametrize("busy_poll", [False, True])
def test_a_client_that_gets_no_reply_raises_policy_timeout(busy_poll):
    """A server that never answers (a real UDP socket that reads and drops): both waits end in PolicyTimeout,
    the one error a control loop catches to count a miss. The spinning client's socket is non-blocking: with a
    timeout set, Python polls before every recv (so it would sleep, not spin) and raises its own TimeoutError."""
    from shield.client import PolicyTimeout

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.1", 0))
        with PolicyClient(*silent.getsockname(), timeout_s=0.05, busy_poll=busy_poll) as client:
            assert client.sock.gettimeout() == (0.0 if busy_poll else 0.05)
            with pytest.raises(PolicyTimeout):
                client.act(np.zeros(4, np.float32))
            with pytest.raises(PolicyTimeout):
                client.status()
            assert len(silent.recv(65535)) > 0  # the request went out
    with pytest.raises(ValueError, match="timeout_s"):
        PolicyClient("127.0.0.1", 9, timeout_s=0)


def test_a_stale_datagram_does_not_restart_the_blocking_clients_wait(monkeypatch):
    """The blocking client's deadline is one `timeout_s` from the request, however many stale datagrams (late
    replies to earlier requests) arrive meanwhile: each recv waits only for what is left. The clock is the
    client's own, advanced by the socket below (no timing here): a stale datagram at 0.3 s of a 0.4 s timeout
    leaves the next recv 0.1 s, not a fresh 0.4 s."""
    from shield import client as client_module
    from shield.client import PolicyTimeout

    now = [100.0]
    monkeypatch.setattr(
        client_module,
        "time",
        SimpleNamespace(monotonic=lambda: now[0], time_ns=time.time_ns, monotonic_ns=time.monotonic_ns),
    )

    class Recorded:
        """The client's real socket; each recv first takes 0.3 s on the client's clock."""

        def __init__(self, sock):
            self.sock, self.timeouts = sock, []

        def settimeout(self, value):
            self.timeouts.append(value)
            self.sock.settimeout(value)

        def recv(self, n):
            now[0] += 0.3
            return self.sock.recv(n)

        def __getattr__(self, name):
            return getattr(self.sock, name)

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind(("127.0.0.1", 0))
        with PolicyClient(*server.getsockname(), timeout_s=0.4) as client:
            client.sock = recorded = Recorded(client.sock)
            seq = client.send_act(np.zeros(4, np.float32))
            _, address = server.recvfrom(65535)
            server.sendto(b"\x00" * 40, address)  # stale: not a reply to this request
            with pytest.raises(PolicyTimeout):
                client.recv_reply(seq)
    assert recorded.timeouts[0] == pytest.approx(0.4)
    assert recorded.timeouts[1:] == [pytest.approx(0.1)]  # what is left of the deadline, then none
