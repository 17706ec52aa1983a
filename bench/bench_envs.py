"""Env steps/s for every registered task (declared ones too) and HalfCheetah-v5, randomized or not, in one process.

    python bench/bench_envs.py [--seconds 3] [--json]

Random actions (seeded); episodes reset as they end. The figure that matters is
the on/off ratio measured in the same run (the machine is shared: absolute
numbers are noisy). "on" uses the task's `train` set (latency, noise, pushes
included); HalfCheetah uses a comparable set by element name.
"""

from __future__ import annotations

import argparse
import json
import time

import gymnasium as gym
import numpy as np

import envs

CHEETAH_SET = {
    "body_mass": {"torso": {"low": 0.8, "high": 1.2}, "bthigh": {"low": 0.8, "high": 1.2}},
    "geom_friction": {"floor": {"low": 0.6, "high": 1.4}},
    "joint_damping": {"bthigh": {"low": 0.7, "high": 1.3}},
    "actuator_gain": {"bthigh": {"low": 0.85, "high": 1.15}},
    "latency_steps": {"low": 0, "high": 1},
    "obs_noise_std": 0.01,
    "action_noise_std": 0.02,
    "push": {"body": "torso", "max_force": 20.0, "probability": 0.01, "duration_steps": 2},
}


def make(env_id: str, randomized: bool) -> gym.Env:
    """The env as training would build it, with or without its randomization set."""
    if env_id.startswith("sim2real/"):
        return gym.make(env_id, randomization="train" if randomized else None)
    env = gym.make(env_id)
    return envs.randomize(env, CHEETAH_SET) if randomized else env


def steps_per_second(env: gym.Env, seconds: float, seed: int = 0) -> float:
    """Median steps/s over three windows of `seconds` / 3 each, random actions."""
    rng = np.random.default_rng(seed)
    shape = env.action_space.shape
    actions = rng.uniform(-1.0, 1.0, (4096, *shape)).astype(np.float32)
    env.reset(seed=seed)
    rates = []
    for _ in range(3):
        steps, start = 0, time.perf_counter()
        deadline = start + seconds / 3
        while True:
            for _ in range(256):
                _, _, terminated, truncated, _ = env.step(actions[steps % 4096])
                steps += 1
                if terminated or truncated:
                    env.reset()
            now = time.perf_counter()
            if now >= deadline:
                break
        rates.append(steps / (now - start))
    return float(np.median(rates))


def main() -> None:
    """Print steps/s with randomization off and on, and the on/off ratio, per env."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    results = {}
    for env_id in [t["env_id"] for t in envs.describe_tasks()] + ["HalfCheetah-v5"]:  # every registered task
        off = steps_per_second(make(env_id, False), args.seconds)
        on = steps_per_second(make(env_id, True), args.seconds)
        results[env_id] = {
            "steps_per_s_off": round(off),
            "steps_per_s_on": round(on),
            "on_off_ratio": round(on / off, 3),
        }
    if args.json:
        print(json.dumps(results))
        return
    print(f"{'env':34s} {'off steps/s':>12s} {'on steps/s':>12s} {'on/off':>7s}")
    for env_id, r in results.items():
        print(f"{env_id:34s} {r['steps_per_s_off']:12d} {r['steps_per_s_on']:12d} {r['on_off_ratio']:7.3f}")


if __name__ == "__main__":
    main()
