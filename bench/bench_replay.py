"""Prioritized replay throughput: in-process buffer, then 1 and K Ray shards (insert and sample).

In-process: `PrioritizedReplay.add` of 256-transition batches and `sample(256)`
(with the IS-weight inputs) on a 1e6-slot buffer, one core.
Ray shards: K shard actors; inserts come as 256-transition batches from the
driver, `--inflight` calls per shard outstanding at a time; sampling is the
learner's path (`ReplayClient`: allocation by shard mass, `--prefetch`
minibatches of 256 per request, one request in flight). Figures are
transitions/s. Efficiency = rate(K) / (K x rate(1)).

    python bench/bench_replay.py [--shards 1 2] [--seconds 5] [--obs-dim 17] [--act-dim 6] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import numpy as np

from pipeline.training.replay import PrioritizedReplay, ReplayShard

BATCH = 256


def transitions(n, obs_dim, act_dim, rng):
    return dict(
        obs=rng.standard_normal((n, obs_dim), np.float32),
        action=rng.uniform(-1, 1, (n, act_dim)).astype(np.float32),
        reward=rng.standard_normal(n).astype(np.float32),
        next_obs=rng.standard_normal((n, obs_dim), np.float32),
        discount=np.full(n, 0.97, np.float32),
    )


def timed(fn, seconds):
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        n += fn()
    return n / (time.perf_counter() - start)


def in_process(args) -> dict:
    rng = np.random.default_rng(0)
    replay = PrioritizedReplay(1_000_000, args.obs_dim, args.act_dim)
    batch = transitions(BATCH, args.obs_dim, args.act_dim, rng)
    for _ in range(200_000 // BATCH):
        replay.add(batch)
    insert = timed(lambda: replay.add(batch), args.seconds)

    def sample_and_update():
        s = replay.sample(BATCH)
        replay.update_priorities(s["index"], s["generation"], rng.exponential(size=BATCH))
        return BATCH

    return dict(insert_per_s=insert, sample_update_per_s=timed(sample_and_update, args.seconds), size=replay.size)


def ray_shards(k: int, args) -> dict:
    import ray

    from pipeline.training.replay import ReplayClient

    rng = np.random.default_rng(k)
    cls = ray.remote(ReplayShard).options(num_cpus=0)
    shards = [cls.remote(i, 1_000_000 // k, args.obs_dim, args.act_dim, 0.6, 0) for i in range(k)]
    batch_ref = ray.put(transitions(BATCH, args.obs_dim, args.act_dim, rng))
    ray.get([s.add.remote(batch_ref) for s in shards for _ in range(100_000 // BATCH // k)])

    def insert_round():
        ray.get([s.add.remote(batch_ref) for s in shards for _ in range(args.inflight)])
        return BATCH * k * args.inflight

    insert = timed(insert_round, args.seconds)
    client = ReplayClient(shards, BATCH, args.prefetch, seed=0)
    client.poll()

    def sample_round():
        b = client.sample(0.4)
        client.update_priorities(b, rng.exponential(size=len(b["reward"])))
        return len(b["reward"])

    sample = timed(sample_round, args.seconds)
    for s in shards:
        ray.kill(s)
    return dict(shards=k, insert_per_s=insert, sample_update_per_s=sample)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--obs-dim", type=int, default=17)
    parser.add_argument("--act-dim", type=int, default=6)
    parser.add_argument("--inflight", type=int, default=4)
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import ray

    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    local = in_process(args)
    ray.init(
        address="local", num_cpus=max(args.shards + [os.cpu_count() or 1]), include_dashboard=False, log_to_driver=False
    )
    rows = [ray_shards(k, args) for k in args.shards]
    ray.shutdown()
    base = next((r for r in rows if r["shards"] == 1), None)
    for r in rows:
        for key in ("insert_per_s", "sample_update_per_s"):
            r[key.replace("_per_s", "_efficiency")] = r[key] / (r["shards"] * base[key]) if base else None
    if args.json:
        print(json.dumps(dict(load=load, cpus=os.cpu_count(), in_process=local, ray=rows)))
        return
    print(f"machine: {os.cpu_count()} CPUs; {load}")
    print(
        f"in-process (1e6 slots, batch {BATCH}, obs {args.obs_dim}, act {args.act_dim}): "
        f"insert {local['insert_per_s']:,.0f}/s, sample+priority update {local['sample_update_per_s']:,.0f}/s"
    )
    print(f"{'shards':>6} {'insert/s':>12} {'eff':>6} {'sample+update/s':>16} {'eff':>6}")
    for r in rows:
        print(
            f"{r['shards']:>6} {r['insert_per_s']:>12,.0f} {r['insert_efficiency'] or 0:>6.2f} "
            f"{r['sample_update_per_s']:>16,.0f} {r['sample_update_efficiency'] or 0:>6.2f}"
        )


if __name__ == "__main__":
    main()
