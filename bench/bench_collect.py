"""Collection throughput: K Ray rollout actors (policy in the loop, no learning) vs one plain process.

Baseline, measured in the same run: the same M envs stepped in a plain Python
loop with random actions, in one process. Figures are env steps/s; the ratio
column is (K actors) / baseline. On an idle machine the ideal is ratio ~ K x
(policy cost), so the ratio per actor shows what Ray + the policy cost.

    python bench/bench_collect.py [--config configs/cartpole.yaml] [--envs-per-actor 8] [--seconds 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import ray

from pipeline.config import load_config
from pipeline.training.model import ActorCritic
from pipeline.training.rollout import RolloutActor, make_env
from pipeline.training.scaffold import model_spec_for


def plain_steps_per_s(env_id, randomization, num_envs, seconds) -> float:
    envs = [make_env(env_id, randomization) for _ in range(num_envs)]
    for i, env in enumerate(envs):
        env.reset(seed=i)
        env.action_space.seed(i)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for env in envs:
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            if terminated or truncated:
                env.reset()
        steps += num_envs
    return steps / (time.perf_counter() - start)


def in_process_actor_steps_per_s(cfg, spec, randomization, num_envs, seconds) -> float:
    """The RolloutActor's own loop without Ray: isolates the policy's cost from Ray's."""
    actor = RolloutActor(
        0, cfg.task.env_id, randomization, cfg.task.max_episode_steps, num_envs, cfg.train.rollout_length, 0, spec
    )
    actor.set_weights(0, ActorCritic(**spec).state_dict())
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        steps += actor.rollout()["rewards"].size
    return steps / (time.perf_counter() - start)


def ray_actors_steps_per_s(cfg, spec, randomization, k, num_envs, seconds) -> float:
    weights = ray.put(ActorCritic(**spec).state_dict())
    actor_cls = ray.remote(RolloutActor).options(num_cpus=cfg.ray.actor_num_cpus)
    actors = [
        actor_cls.remote(
            i, cfg.task.env_id, randomization, cfg.task.max_episode_steps, num_envs, cfg.train.rollout_length, 0, spec
        )
        for i in range(k)
    ]
    ray.get([a.rollout.remote((0, [weights])) for a in actors])  # warm-up: envs built, weights loaded
    pending = {a.rollout.remote(): a for a in actors for _ in range(2)}  # 2 in flight per actor
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        ready, _ = ray.wait(list(pending), num_returns=1)
        actor = pending.pop(ready[0])
        steps += ray.get(ready[0])["rewards"].size
        pending[actor.rollout.remote()] = actor
    rate = steps / (time.perf_counter() - start)
    for a in actors:
        ray.kill(a)
    return rate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/cartpole.yaml")
    parser.add_argument("--envs-per-actor", type=int, default=8)
    parser.add_argument("--max-actors", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seconds", type=float, default=10.0, help="measuring time per configuration (s)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    cfg = load_config(args.config)
    spec, randomization = model_spec_for(cfg)
    m = args.envs_per_actor
    baseline = plain_steps_per_s(cfg.task.env_id, randomization, m, args.seconds)
    in_process = in_process_actor_steps_per_s(cfg, spec, randomization, m, args.seconds)
    rows = [
        dict(setup=f"plain loop, {m} envs, random actions (baseline)", steps_per_s=baseline, ratio=1.0),
        dict(setup=f"RolloutActor without Ray, {m} envs, policy", steps_per_s=in_process, ratio=in_process / baseline),
    ]
    ray.init(address="local", num_cpus=args.max_actors, include_dashboard=False, log_to_driver=False)
    try:
        for k in range(1, args.max_actors + 1):
            rate = ray_actors_steps_per_s(cfg, spec, randomization, k, m, args.seconds)
            rows.append(dict(setup=f"{k} Ray actor(s) x {m} envs, policy", steps_per_s=rate, ratio=rate / baseline))
    finally:
        ray.shutdown()

    if args.json:
        print(json.dumps(dict(env_id=cfg.task.env_id, cpus=os.cpu_count(), rows=rows)))
    else:
        print(f"{cfg.task.env_id}, {os.cpu_count()} CPUs; ratio = steps/s over the plain single-process baseline")
        for row in rows:
            print(f"  {row['setup']:<48} {row['steps_per_s']:>10.0f} steps/s   x{row['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
