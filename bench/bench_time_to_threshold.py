"""Wall-clock time to a return threshold: sim2real (Ray actor-learner) vs Stable-Baselines3 PPO.

Both run on this machine in the same invocation, on the same envs (same
domain randomization), and both are judged the same way: the mean return of
the last 20 finished training episodes. Each run stops at the threshold or at
`--budget-s`, whichever comes first; the table reports what was reached.
`--runs N` repeats both with seeds 0..N-1 (ours: train.seed; SB3: its seed) and
compares the medians: one run of either is a noisy figure.

Tasks:
  cartpole     sim2real/CartPoleRail-v0 under `train` randomization; threshold =
               0.9 x the legacy LQR's mean return on the same domains (measured here).
  halfcheetah  HalfCheetah-v5, threshold 1500 (may need far more than a 2-core budget).

    python bench/bench_time_to_threshold.py [--tasks cartpole halfcheetah] [--runs 5] [--budget-s 300]
                                            [--skip-sb3] [--json]
    python bench/bench_time_to_threshold.py --learner-only --device cuda   # learner samples/s, CUDA vs CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from pipeline.config import load_config
from pipeline.training.rollout import make_env

WINDOW = 20


def legacy_return(env_id, randomization, episodes=10) -> float:
    import envs

    controller, env = envs.legacy_controller(env_id), make_env(env_id, randomization)
    returns = []
    for seed in range(episodes):
        obs, _ = env.reset(seed=50_000 + seed)
        controller.reset()
        total, done = 0.0, False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(controller(obs[None].astype(np.float32))[0])
            total, done = total + reward, terminated or truncated
        returns.append(total)
    return float(np.mean(returns))


def task_setup(name: str):
    """(config, threshold, note) for a bench task."""
    cfg = load_config("configs/cartpole.yaml")
    if name == "cartpole":
        rand = cfg.randomization["train"].model_dump(mode="json")
        legacy = legacy_return(cfg.task.env_id, rand)
        return cfg, 0.9 * legacy, f"0.9 x legacy LQR return {legacy:.0f}"
    if name == "halfcheetah":
        from envs.randomization import RandomizationSet

        cfg.task.name, cfg.task.env_id = "halfcheetah", "HalfCheetah-v5"
        cfg.randomization["train"] = RandomizationSet()  # the plain gymnasium task, as SB3's zoo trains it
        t = cfg.train
        t.hidden_sizes, t.lr, t.num_epochs, t.batches_per_update = [256, 256], 3e-4, 4, 4
        t.rollout_length, t.envs_per_actor, t.log_std_init, t.total_env_steps = 64, 4, 0.0, 10_000_000
        return cfg, 1500.0, "fixed 1500"
    raise SystemExit(f"unknown task {name!r}; choose cartpole or halfcheetah")


def run_sim2real(cfg, threshold, budget_s, out_dir, seed: int = 0) -> dict:
    from pipeline.training.train import train

    cfg = cfg.model_copy(deep=True)
    cfg.train.seed = seed
    start = time.perf_counter()
    state = dict(best=-np.inf, reached_s=None)

    def stop_at_threshold(s):
        recent = s["metrics"].get("episode_return_recent")  # mean of the last 20 episodes
        if recent is not None:
            state["best"] = max(state["best"], recent)
            if recent >= threshold:
                state["reached_s"] = time.perf_counter() - start
                return True
        return time.perf_counter() - start > budget_s

    result = train(cfg, out_dir=out_dir, progress=False, callback=stop_at_threshold)
    return dict(
        impl="sim2real appo (ray)",
        seed=seed,
        reached_s=state["reached_s"],
        env_steps=result.env_steps,
        best_mean_return=state["best"],
        wall_s=time.perf_counter() - start,
    )


def run_sb3(cfg, threshold, budget_s, seed: int = 0) -> dict:
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    torch.set_num_threads(1)  # same as our learner on a full machine; more threads thrash on 2 busy cores
    rand = cfg.randomization["train"].model_dump(mode="json")
    n_envs = cfg.train.num_actors * cfg.train.envs_per_actor
    vec = make_vec_env(lambda: make_env(cfg.task.env_id, rand, cfg.task.max_episode_steps), n_envs=n_envs, seed=seed)
    start = time.perf_counter()
    state = dict(best=-np.inf, reached_s=None)

    class StopAtThreshold(BaseCallback):
        def _on_step(self) -> bool:
            buf = self.model.ep_info_buffer
            if len(buf) >= WINDOW:
                state["best"] = max(state["best"], float(np.mean([e["r"] for e in list(buf)[-WINDOW:]])))
                if state["best"] >= threshold:
                    state["reached_s"] = time.perf_counter() - start
                    return False
            return time.perf_counter() - start < budget_s

    model = PPO("MlpPolicy", vec, seed=seed, device="cpu", n_steps=max(2048 // n_envs, 16), verbose=0)
    model.learn(total_timesteps=10**9, callback=StopAtThreshold())
    vec.close()
    return dict(
        impl="stable-baselines3 PPO (1 process)",
        seed=seed,
        reached_s=state["reached_s"],
        env_steps=model.num_timesteps,
        best_mean_return=state["best"],
        wall_s=time.perf_counter() - start,
    )


def learner_throughput(device: str, seconds: float = 5.0) -> float:
    """Learner samples/s on a synthetic cartpole-sized batch (no Ray, no envs)."""
    import torch

    from pipeline.training.learner import Learner, appo_policy_loss

    cfg = load_config("configs/cartpole.yaml").train
    T, B, obs_dim, act_dim = cfg.rollout_length, cfg.envs_per_actor, 5, 1
    rng = np.random.default_rng(0)
    batch = dict(
        obs=rng.normal(size=(T + 1, B, obs_dim)).astype(np.float32),
        actions=rng.normal(size=(T, B, act_dim)).astype(np.float32),
        behaviour_logp=np.full((T, B), -1.0, np.float32),
        behaviour_mean=np.zeros((T, B, act_dim), np.float32),
        behaviour_log_std=np.full(act_dim, -0.5, np.float32),
        rewards=rng.normal(size=(T, B)).astype(np.float32),
        terminated=np.zeros((T, B), bool),
        truncated=np.zeros((T, B), bool),
        final_obs=np.zeros((T, B, obs_dim), np.float32),
    )
    spec = dict(obs_dim=obs_dim, act_dim=act_dim, hidden_sizes=cfg.hidden_sizes, action_low=[-1.0], action_high=[1.0])
    torch.set_num_threads(1)  # as the driver does on a machine its actors fill
    learner = Learner(spec, cfg, torch.device(device), appo_policy_loss)
    batches = [batch] * cfg.batches_per_update
    learner.update(batches)
    samples, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        samples += learner.update(batches)["samples"]
    if device == "cuda":
        torch.cuda.synchronize()
    return samples / (time.perf_counter() - start)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["cartpole"], choices=["cartpole", "halfcheetah"])
    parser.add_argument("--runs", type=int, default=3, help="runs per implementation (seeds 0..N-1); medians compared")
    parser.add_argument("--budget-s", type=float, default=300.0, help="wall-clock cap per run (s)")
    parser.add_argument("--skip-sb3", action="store_true", help="only run sim2real")
    parser.add_argument("--learner-only", action="store_true", help="only measure learner samples/s")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="learner device for --learner-only")
    parser.add_argument("--out", default="runs/bench", help="run directories go here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    if args.learner_only:
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            print("no CUDA device: skipping the CUDA learner measurement", file=sys.stderr)
            return 0
        cpu = learner_throughput("cpu")
        rows = [dict(device="cpu", samples_per_s=cpu, ratio=1.0)]
        if args.device == "cuda":
            cuda = learner_throughput("cuda")
            rows.append(dict(device="cuda", samples_per_s=cuda, ratio=cuda / cpu))
        print(
            json.dumps(rows)
            if args.json
            else "\n".join(
                f"learner on {r['device']}: {r['samples_per_s']:.0f} samples/s (x{r['ratio']:.2f} vs cpu)" for r in rows
            )
        )
        return 0

    report = []
    for name in args.tasks:
        cfg, threshold, note = task_setup(name)
        runs = []
        for seed in range(args.runs):  # interleaved, so a slow spell of the machine hits both
            runs.append(
                run_sim2real(
                    cfg, threshold, args.budget_s, os.path.join(args.out, f"{name}-{seed}-{int(time.time())}"), seed
                )
            )
            if not args.skip_sb3:
                runs.append(run_sb3(cfg, threshold, args.budget_s, seed))
        report.append(
            dict(
                task=name,
                env_id=cfg.task.env_id,
                threshold=threshold,
                threshold_note=note,
                budget_s=args.budget_s,
                runs=runs,
                summary=summarize(runs),
            )
        )
        if not args.json:
            print_task(report[-1])
    if args.json:
        print(json.dumps(report))
    return 0


def summarize(runs: list[dict]) -> list[dict]:
    """Per implementation: runs, how many reached the threshold, median time and env steps to it (a run that
    did not reach it counts with its whole wall time, so the median never flatters a failing implementation)."""
    rows = []
    for impl in dict.fromkeys(r["impl"] for r in runs):
        mine = [r for r in runs if r["impl"] == impl]
        times = [r["reached_s"] if r["reached_s"] is not None else r["wall_s"] for r in mine]
        rows.append(
            dict(
                impl=impl,
                runs=len(mine),
                reached=sum(r["reached_s"] is not None for r in mine),
                median_s=float(np.median(times)),
                median_env_steps=float(np.median([r["env_steps"] for r in mine])),
            )
        )
    return rows


def print_task(task: dict) -> None:
    """One line per run, then the medians; ratio = median time to threshold / SB3's (the last implementation)."""
    print(
        f"{task['env_id']}: threshold {task['threshold']:.0f} ({task['threshold_note']}), budget "
        f"{task['budget_s']:.0f} s"
    )
    for r in task["runs"]:
        reached = f"{r['reached_s']:.1f} s" if r["reached_s"] is not None else "not reached"
        print(
            f"  {r['impl']:<36} seed {r['seed']:>2} {reached:>12}  steps {r['env_steps']:>9}  "
            f"best mean return {r['best_mean_return']:.0f}  (wall {r['wall_s']:.0f} s)",
            flush=True,
        )
    base = task["summary"][-1]["median_s"]
    for row in task["summary"]:
        print(
            f"  median {row['impl']:<29} {row['median_s']:>8.1f} s  x{row['median_s'] / base:.2f}  "
            f"steps {row['median_env_steps']:>9.0f}  reached {row['reached']}/{row['runs']}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
