"""Off-policy (SAC + sharded prioritized replay) benchmarks: same-wall-time returns, and scaling.

`--compare`: HalfCheetah-v5 (plain gymnasium task, no randomization). Ours
(`train.algorithm: sac`, Ray actors + replay shards), Stable-Baselines3 SAC
and SB3 PPO (their default hyperparameters, one env) each train for
`--budget-s` seconds of wall time in this one invocation; then each final
deterministic policy is evaluated on the same `--eval-episodes` seeds.

`--scaling`: collection throughput of K exploring actors inserting into K
shards (learning off), K = 1 .. `--max-k` (default: all cores), and the
learner-side sample + priority-update rate from K shards; efficiency =
throughput(K) / (K x throughput(1)). Run it on the largest machine you have:
a 2-core figure says little.

    python bench/bench_offpolicy.py --compare [--budget-s 300] [--eval-episodes 5]
    python bench/bench_offpolicy.py --compare --parallel --budget-s 900   # the three at once, on disjoint cores
    python bench/bench_offpolicy.py --scaling [--max-k 16 | --ks 1 2 4 8 16] [--steps-per-actor 20000]

`--parallel` runs the three trainings at the same time on disjoint cores of this
process's affinity set (SB3 SAC and SB3 PPO a quarter each, ours the other half),
so one invocation of B seconds compares B seconds of each: same machine, same
wall-clock window.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ENV_ID = "HalfCheetah-v5"
CONFIGS = dict(appo="configs/cartpole.yaml", sac="configs/cartpole_sac.yaml", td3="configs/cartpole_td3.yaml")
EVAL_SEED = 70_000


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def evaluate(act, episodes: int) -> float:
    """Mean return of a deterministic `act(obs[1, d]) -> action[1, a]` over fixed seeds."""
    import gymnasium as gym

    env, returns = gym.make(ENV_ID), []
    for k in range(episodes):
        obs, _ = env.reset(seed=EVAL_SEED + k)
        total, done = 0.0, False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(np.asarray(act(obs[None].astype(np.float32)))[0])
            total, done = total + reward, terminated or truncated
        returns.append(total)
    env.close()
    return float(np.mean(returns))


def halfcheetah_config(algorithm: str = "sac"):
    """Our HalfCheetah-v5 config for `algorithm`: its cart-pole config on the plain gymnasium task (no
    randomization, shield or validation), [256, 256] nets; APPO as before, SAC/TD3 with SB3 SAC's defaults
    (batch 256, one gradient step per env step, lr 3e-4, 1-step returns) and one actor of one env."""
    from envs.randomization import RandomizationSet
    from pipeline.config import load_config

    cfg = load_config(CONFIGS[algorithm])
    cfg.task.name, cfg.task.env_id = "halfcheetah", ENV_ID
    for name in cfg.randomization:  # the cart-pole's sets name bodies the cheetah lacks (preflight runs them all)
        cfg.randomization[name] = RandomizationSet()
    cfg.shield.enabled = cfg.validation.enabled = False  # the final policy is evaluated here
    t = cfg.train
    t.hidden_sizes, t.total_env_steps = [256, 256], 10_000_000
    if algorithm == "appo":
        t.lr, t.num_epochs, t.batches_per_update = 3e-4, 4, 4
        t.rollout_length, t.envs_per_actor, t.log_std_init = 64, 4, 0.0
    else:
        s = getattr(t, algorithm)
        s.batch_size, s.replay_ratio, s.lr, s.learning_starts, s.n_step = 256, 256.0, 3e-4, 1000, 1
        s.log_every, s.checkpoint_every = 10, 10**9  # a record (and the stop rule) every 10 learner steps
        t.num_actors, t.envs_per_actor, t.rollout_length = 1, 1, 64
        t.replay.capacity, t.replay.num_shards, t.replay.checkpoint = 1_000_000, 1, False
        cfg.ray.actor_num_cpus = 0.5
    return cfg


def run_ours(budget_s: float, episodes: int, out_dir: str) -> dict:
    import torch

    from pipeline.training.policy import load_policy
    from pipeline.training.train import train

    start = time.perf_counter()
    result = train(
        halfcheetah_config(),
        out_dir=out_dir,
        progress=False,
        callback=lambda s: time.perf_counter() - start >= budget_s,
    )
    policy, _ = load_policy(result.run_dir)
    ret = evaluate(lambda o: policy(torch.from_numpy(o)).detach().numpy(), episodes)
    return dict(
        name="ours SAC (Ray, 1 actor, 1 shard)",
        env_steps=result.env_steps,
        wall_s=result.wall_s,
        eval_return=ret,
        train_return_recent=result.final_return,
    )


def run_sb3(algo: str, budget_s: float, episodes: int) -> dict:
    import gymnasium as gym
    from stable_baselines3 import PPO, SAC
    from stable_baselines3.common.callbacks import BaseCallback

    class WallClock(BaseCallback):
        def _on_step(self) -> bool:
            return time.perf_counter() - self.start < budget_s

        def _on_training_start(self) -> None:
            self.start = time.perf_counter()

    import torch

    # The torch thread count our learner uses beside its one actor (train.py's rule), so neither
    # side's thread pool oversubscribes the cores the other lacks.
    from pipeline.training.learner import usable_cpus

    torch.set_num_threads(max(1, usable_cpus() - 1))
    model = (SAC if algo == "sac" else PPO)("MlpPolicy", gym.make(ENV_ID), seed=0, verbose=0)
    start = time.perf_counter()
    model.learn(total_timesteps=10_000_000, callback=WallClock())
    wall = time.perf_counter() - start
    ret = evaluate(lambda o: model.predict(o, deterministic=True)[0], episodes)
    return dict(
        name=f"SB3 {algo.upper()} (defaults, 1 env)", env_steps=int(model.num_timesteps), wall_s=wall, eval_return=ret
    )


RUNS = ("ours", "sac", "ppo")


def run_one(which: str, budget_s: float, episodes: int, out_dir: str) -> dict:
    return run_ours(budget_s, episodes, out_dir) if which == "ours" else run_sb3(which, budget_s, episodes)


def core_split(cores: list[int]) -> dict[str, list[int]]:
    """Disjoint sets of `cores` for the parallel comparison: SB3's runs a quarter each, ours the rest."""
    quarter = max(1, len(cores) // 4)
    return {"sac": cores[:quarter], "ppo": cores[quarter : 2 * quarter], "ours": cores[2 * quarter :] or cores[:1]}


def compare(args) -> list[dict]:
    import tempfile

    if not args.parallel:
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for which in RUNS:
                rows.append(run_one(which, args.budget_s, args.eval_episodes, f"{tmp}/ours"))
                print(json.dumps(rows[-1]), file=sys.stderr)
        return rows
    split, procs = core_split(sorted(os.sched_getaffinity(0))), {}
    with tempfile.TemporaryDirectory() as tmp:
        for which in RUNS:
            cmd = [
                sys.executable,
                __file__,
                "--one",
                which,
                "--budget-s",
                str(args.budget_s),
                "--eval-episodes",
                str(args.eval_episodes),
                "--out",
                f"{tmp}/{which}",
                "--cpus",
                ",".join(map(str, split[which])),
            ]
            procs[which] = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        rows = []
        for which, proc in procs.items():
            out, _ = proc.communicate()
            if proc.returncode != 0:
                raise SystemExit(f"bench_offpolicy: the {which} run failed (exit {proc.returncode})")
            rows.append(dict(json.loads(out.strip().splitlines()[-1]), cores=len(split[which])))
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def scaling(args) -> list[dict]:
    import tempfile

    import ray

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_replay import ray_shards

    from pipeline.config import load_config
    from pipeline.training.train import train

    rows = []
    ray.init(
        address="local", num_cpus=max(os.cpu_count() or 1, args.max_k), include_dashboard=False, log_to_driver=False
    )
    try:
        for k in args.ks or range(1, args.max_k + 1):
            cfg = load_config("configs/cartpole_sac.yaml")
            cfg.train.num_actors, cfg.train.replay.num_shards = k, k
            cfg.train.sac.learning_starts = 10**9  # collection only
            cfg.train.replay.checkpoint = False
            cfg.ray.actor_num_cpus, cfg.train.replay.shard_num_cpus = 1.0, 0.0
            with tempfile.TemporaryDirectory() as tmp:
                result = train(cfg, out_dir=tmp, steps=args.steps_per_actor * k, progress=False)
            shard_rates = ray_shards(
                k, argparse.Namespace(obs_dim=5, act_dim=1, seconds=args.seconds, inflight=4, prefetch=4)
            )
            rows.append(
                dict(
                    k=k,
                    collect_steps_per_s=result.env_steps_per_s,
                    sample_update_per_s=shard_rates["sample_update_per_s"],
                    insert_per_s=shard_rates["insert_per_s"],
                )
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        ray.shutdown()
    for r in rows:
        for key in ("collect_steps_per_s", "insert_per_s", "sample_update_per_s"):
            r[key.replace("_per_s", "_efficiency")] = r[key] / (r["k"] * rows[0][key])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--scaling", action="store_true")
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--eval-episodes", type=int, default=5)
    parser.add_argument("--max-k", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--steps-per-actor", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=3.0, help="per replay-rate measurement")
    parser.add_argument("--ks", type=int, nargs="+", help="scaling: these K only (K=1 first: the baseline)")
    parser.add_argument("--parallel", action="store_true", help="compare: the three runs at once on disjoint cores")
    parser.add_argument("--one", choices=RUNS, help=argparse.SUPPRESS)  # a --parallel child
    parser.add_argument("--cpus", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.one:
        cpus = [int(c) for c in args.cpus.split(",")]
        os.sched_setaffinity(0, cpus)  # inherited by Ray's workers; our learner and SB3 size their threads by it
        print(json.dumps(run_one(args.one, args.budget_s, args.eval_episodes, args.out)))
        return
    if args.ks and args.ks[0] != 1:
        parser.error("--ks must start with 1 (efficiency is relative to K = 1)")
    if not (args.compare or args.scaling):
        parser.error("choose --compare and/or --scaling")
    import torch

    out = dict(machine=f"{os.cpu_count()} CPUs, CUDA: {torch.cuda.is_available()}", load_before=uptime())
    if args.compare:
        out["compare"] = compare(args)
    if args.scaling:
        out["scaling"] = scaling(args)
    out["load_after"] = uptime()
    if args.json:
        print(json.dumps(out))
        return
    print(f"machine: {out['machine']}\nload before: {out['load_before']}\nload after:  {out['load_after']}")
    if args.compare:
        print(
            f"\n{ENV_ID}, {args.budget_s:.0f} s of wall time "
            f"each{' (at once, disjoint cores)' if args.parallel else ''}; eval = deterministic policy, "
            f"{args.eval_episodes} episodes, same seeds"
        )
        print(f"{'run':<36} {'env steps':>10} {'wall s':>7} {'eval return':>12}")
        for r in out["compare"]:
            print(f"{r['name']:<36} {r['env_steps']:>10,} {r['wall_s']:>7.0f} {r['eval_return']:>12.1f}")
    if args.scaling:
        print(
            f"\n{'K':>3} {'collect steps/s':>16} {'eff':>5} {'shard insert/s':>15} {'eff':>5} {'sample+upd/s':>13} "
            f"{'eff':>5}"
        )
        for r in out["scaling"]:
            print(
                f"{r['k']:>3} {r['collect_steps_per_s']:>16,.0f} {r['collect_steps_efficiency']:>5.2f} "
                f"{r['insert_per_s']:>15,.0f} "
                f"{r['insert_efficiency']:>5.2f} {r['sample_update_per_s']:>13,.0f} "
                f"{r['sample_update_efficiency']:>5.2f}"
            )


if __name__ == "__main__":
    main()
