"""Wall-clock benchmarks: sim2real (Ray actor-learner; APPO, SAC, TD3) vs Stable-Baselines3, same run, same cores.

Every arm runs on this machine in the same invocation, on the same envs (same
domain randomization), and every arm is judged the same way (`Stopper`): the
mean return of the last 20 finished training episodes. Runs are interleaved per
seed across all arms (seed 0 of every arm, then seed 1, ...), so a slow spell of
the machine hits all of them; seeds 0..N-1 (ours: train.seed; SB3: its seed).
Our loops consult the rule only at their metrics records (APPO: every update;
SAC/TD3: every log_every learner steps, none before learning_starts) and SB3 PPO
not during its update, so a run can pass `--budget-s`: each row's wall_s says by how much.

Tasks:
  cartpole     sim2real/CartPoleRail-v0 under configs/cartpole.yaml's `train` randomization; threshold =
               0.9 x the legacy LQR's mean return on the same domains (measured here). Each run stops at the
               threshold or at `--budget-s`, whichever first. Arms:
                 ours `--algorithms` (default appo sac td3): configs/cartpole.yaml, cartpole_sac.yaml,
                   cartpole_td3.yaml as shipped, except that all train on cartpole.yaml's `train` set (the
                   off-policy configs train with reality's milder pushes), the set the threshold is measured on;
                 sb3-ppo-matched: SB3 PPO with cartpole.yaml's train.gamma and train.clip_param, else SB3 defaults;
                 sb3-ppo-default: SB3 PPO defaults.
               Both SB3 arms step cartpole.yaml's num_actors x envs_per_actor envs in one process, n_steps =
               2048 / n_envs (SB3's default rollout of 2048 samples). Summary per arm: reached/runs, median time
               to threshold (a run that did not reach it counts with its whole wall time), median env steps,
               and the ratio of the median time to sb3-ppo-default's.
  halfcheetah  HalfCheetah-v5 (plain gymnasium task), after the same wall time: every arm trains for exactly
               `--budget-s` s; figures: the mean return of the last 20 finished training episodes at the end,
               and a deterministic evaluation of the final policy on 5 fixed seeds (bench_offpolicy.evaluate).
               Arms: ours `--hc-algorithm` (default sac; hyperparameters: bench_offpolicy.halfcheetah_config, printed),
               sb3-sac-default and sb3-ppo-default (SB3 defaults, 1 env).

The figures (2 cores here; each line is one invocation):
    python bench/bench_time_to_threshold.py --tasks cartpole --runs 5 --budget-s 300 [--json]
    python bench/bench_time_to_threshold.py --tasks halfcheetah --runs 5 --budget-s 900 [--hc-algorithm sac] [--json]
    python bench/bench_time_to_threshold.py --learner-only --device cuda   # learner samples/s, CUDA vs CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

import numpy as np
from bench_offpolicy import CONFIGS  # bench/ is on the path when a bench runs

from pipeline.config import load_config
from pipeline.training.rollout import make_env

WINDOW = 20
EVAL_EPISODES = 5
SB3_DEFAULT = "sb3-ppo-default"  # the arm ratios are taken against


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


class Stopper:
    """The one stop rule of every arm: stop once the mean return of the last WINDOW finished training episodes
    (None until WINDOW have finished) reaches `threshold`, or `budget_s` wall seconds after construction (start-up
    included). A row's wall_s is the time the rule stopped the run (else its end), total_s includes the teardown
    (our final checkpoint and validation, Ray's shutdown)."""

    def __init__(self, threshold: float, budget_s: float):
        self.threshold, self.budget_s, self.start = threshold, budget_s, time.perf_counter()
        self.best, self.reached_s, self.stopped_s = None, None, None

    def __call__(self, recent: float | None) -> bool:
        elapsed = time.perf_counter() - self.start
        if recent is not None:
            self.best = recent if self.best is None else max(self.best, recent)
            if recent >= self.threshold:
                self.reached_s = self.stopped_s = elapsed
                return True
        if elapsed >= self.budget_s:
            self.stopped_s = elapsed
        return self.stopped_s is not None

    def row(self, **figures) -> dict:
        total = time.perf_counter() - self.start
        wall = total if self.stopped_s is None else self.stopped_s
        return dict(reached_s=self.reached_s, best_mean_return=self.best, wall_s=wall, total_s=total, **figures)


def cartpole_arms(algorithms: list[str], sb3: bool) -> tuple[dict, float, str]:
    """(arms, threshold, note); arms: name -> run(threshold, budget_s, seed, out_dir, evaluate) -> row."""
    base = load_config(CONFIGS["appo"])
    train_set = base.randomization["train"]
    legacy = legacy_return(base.task.env_id, train_set.model_dump(mode="json"))
    matched = dict(gamma=base.train.gamma, clip_range=base.train.clip_param)
    arms = {}
    for name in algorithms:
        cfg = load_config(CONFIGS[name])
        cfg.randomization["train"] = train_set.model_copy(deep=True)  # every arm on the threshold's domains
        # every arm may use as many env steps as APPO's shipped budget, so the wall-clock budget (not the
        # off-policy configs' shorter step count) is what ends a run that has not reached the threshold
        cfg.train.total_env_steps = max(cfg.train.total_env_steps, base.train.total_env_steps)
        arms[f"sim2real {name}"] = partial(run_sim2real, cfg)
    if sb3:
        n_envs = base.train.num_actors * base.train.envs_per_actor
        arms["sb3-ppo-matched"] = partial(run_sb3, base, "ppo", n_envs, matched)
        arms[SB3_DEFAULT] = partial(run_sb3, base, "ppo", n_envs, {})
    return arms, 0.9 * legacy, f"0.9 x legacy LQR return {legacy:.0f}; sb3-ppo-matched: {matched}"


def halfcheetah_arms(algorithm: str, sb3: bool) -> tuple[dict, float, str]:
    """(arms, threshold, note): same wall time, so no threshold stops a run."""
    from bench_offpolicy import halfcheetah_config

    cfg = halfcheetah_config(algorithm)
    arms = {f"sim2real {algorithm}": partial(run_sim2real, cfg)}
    if sb3:
        arms["sb3-sac-default"] = partial(run_sb3, cfg, "sac", 1, {})
        arms[SB3_DEFAULT] = partial(run_sb3, cfg, "ppo", 1, {})
    return arms, float("inf"), f"ours: train {json.dumps(cfg.train.model_dump(mode='json'))}"


def evaluate_final(act) -> float:
    """Mean return of a deterministic `act(obs[1, d]) -> action[1, a]` on bench_offpolicy's fixed HalfCheetah seeds."""
    from bench_offpolicy import evaluate

    return evaluate(act, EVAL_EPISODES)


def run_sim2real(cfg, threshold, budget_s, seed, out_dir, evaluate=False) -> dict:
    from pipeline.training.train import train

    cfg = cfg.model_copy(deep=True)
    cfg.train.seed = seed
    stop = Stopper(threshold, budget_s)
    result = train(
        cfg, out_dir=out_dir, progress=False, callback=lambda s: stop(s["metrics"].get("episode_return_recent"))
    )
    row = stop.row(env_steps=result.env_steps, final_return=result.final_return)
    if evaluate:
        import torch

        from pipeline.training.policy import load_policy

        policy, _ = load_policy(result.run_dir, "latest")  # the final weights, not validation's pick
        row["eval_return"] = evaluate_final(lambda o: policy(torch.from_numpy(o)).detach().numpy())
    return row


def run_sb3(cfg, algo, n_envs, hyper, threshold, budget_s, seed, out_dir=None, evaluate=False) -> dict:
    import torch
    from stable_baselines3 import PPO, SAC
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    torch.set_num_threads(1)  # same as our learner on a full machine; more threads thrash on 2 busy cores
    rand = cfg.randomization["train"].model_dump(mode="json")
    vec = make_vec_env(lambda: make_env(cfg.task.env_id, rand, cfg.task.max_episode_steps), n_envs=n_envs, seed=seed)
    stop = Stopper(threshold, budget_s)

    def recent(model, full: bool = True) -> float | None:
        last = [e["r"] for e in list(model.ep_info_buffer)[-WINDOW:]]
        return float(np.mean(last)) if last and (len(last) == WINDOW or not full) else None

    class StopAtThreshold(BaseCallback):
        def _on_step(self) -> bool:
            return not stop(recent(self.model))

    if algo == "ppo":
        hyper = dict(n_steps=max(2048 // n_envs, 16), **hyper)  # SB3's rollout of 2048 samples over n_envs
    model = dict(ppo=PPO, sac=SAC)[algo]("MlpPolicy", vec, seed=seed, device="cpu", verbose=0, **hyper)
    model.learn(total_timesteps=10**9, callback=StopAtThreshold())
    vec.close()
    row = stop.row(env_steps=int(model.num_timesteps), final_return=recent(model, full=False))
    if evaluate:
        row["eval_return"] = evaluate_final(lambda o: model.predict(o, deterministic=True)[0])
    return row


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
    parser.add_argument("--algorithms", nargs="+", default=["appo", "sac", "td3"], choices=list(CONFIGS))
    parser.add_argument("--hc-algorithm", default="sac", choices=list(CONFIGS), help="ours on halfcheetah")
    parser.add_argument("--runs", type=int, default=5, help="runs per arm (seeds 0..N-1); medians compared")
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
        cheetah = name == "halfcheetah"
        arms, threshold, note = (
            halfcheetah_arms(args.hc_algorithm, not args.skip_sb3)
            if cheetah
            else cartpole_arms(args.algorithms, not args.skip_sb3)
        )
        task = dict(
            task=name,
            env_id="HalfCheetah-v5" if cheetah else load_config(CONFIGS["appo"]).task.env_id,
            threshold=None if cheetah else threshold,
            note=note,
            budget_s=args.budget_s,
            runs=[],
        )
        if not args.json:
            print_header(task)
        for seed in range(args.runs):  # interleaved, so a slow spell of the machine hits every arm
            for arm, run in arms.items():
                out_dir = os.path.join(args.out, f"{name}-{arm.replace(' ', '-')}-{seed}-{int(time.time())}")
                task["runs"].append(dict(arm=arm, seed=seed, **run(threshold, args.budget_s, seed, out_dir, cheetah)))
                if not args.json:
                    print_run(task["runs"][-1])
        task["summary"] = summarize(task["runs"])
        report.append(task)
        if not args.json:
            print_summary(task["summary"])
    if args.json:
        print(json.dumps(report))
    return 0


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def summarize(runs: list[dict]) -> list[dict]:
    """Per arm: runs, how many reached the threshold, median time and env steps to it (a run that did not reach
    it counts with its whole wall time, so the median never flatters a failing arm), median final training
    return (last WINDOW episodes) and evaluation return; ratio = median time / sb3-ppo-default's."""
    rows = []
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        rows.append(
            dict(
                arm=arm,
                runs=len(mine),
                reached=sum(r["reached_s"] is not None for r in mine),
                median_s=median(r["reached_s"] if r["reached_s"] is not None else r["wall_s"] for r in mine),
                median_env_steps=median(r["env_steps"] for r in mine),
                median_final_return=median(r["final_return"] for r in mine),
                median_eval_return=median(r.get("eval_return") for r in mine),
            )
        )
    base = next((row["median_s"] for row in rows if row["arm"] == SB3_DEFAULT), None)
    for row in rows:
        row["ratio_vs_sb3_default"] = row["median_s"] / base if base else None
    return rows


def fmt(value, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def print_header(task: dict) -> None:
    goal = f"threshold {task['threshold']:.0f}" if task["threshold"] is not None else "same wall time"
    print(f"{task['env_id']}: {goal}, budget {task['budget_s']:.0f} s; {task['note']}", flush=True)


def print_run(r: dict) -> None:
    reached = f"{r['reached_s']:.1f} s" if r["reached_s"] is not None else "not reached"
    print(
        f"  {r['arm']:<18} seed {r['seed']:>2} {reached:>12}  steps {r['env_steps']:>9}  best mean return "
        f"{fmt(r['best_mean_return'])}  final {fmt(r['final_return'])}  eval {fmt(r.get('eval_return'))}  "
        f"(wall {r['wall_s']:.0f} s, with teardown {r['total_s']:.0f} s)",
        flush=True,
    )


def print_summary(rows: list[dict]) -> None:
    for row in rows:
        print(
            f"  median {row['arm']:<18} {fmt(row['median_s'], '.1f'):>7} s  "
            f"x{fmt(row['ratio_vs_sb3_default'], '.2f')} vs {SB3_DEFAULT}  steps {fmt(row['median_env_steps'])}  "
            f"reached {row['reached']}/{row['runs']}  final return {fmt(row['median_final_return'])}  "
            f"eval return {fmt(row['median_eval_return'])}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
