"""Does calibrating to field logs pay? Candidate return on a hidden plant, trained with vs without calibration.

A hidden cart-pole (cart 1.3x, pole 1.1x, slider damping 1.2x, hinge damping
2x, actuator 0.8x, 2 steps of latency, reality's noise and pushes) is driven by
the legacy LQR for 60 s; the log calibrates the twin (the slider damping, the
motor's back-EMF, is `calibration.known`). Then, per run seed, two fresh
trainings with the same seed and budget: `baseline` on the config's `train`
set, `calibrated` on train re-centred on the calibrated set (what
`sim2real run --from-log` trains on). Each candidate (shield on) is evaluated on
the hidden plant with the same evaluation seeds, beside the legacy LQR.
`--plant edge` puts the hidden plant at reality's far end, beyond train's ranges.

    nice -n 10 python bench/bench_calibration.py [--plant inside|edge] [--runs 5] [--steps 60000] [--episodes 10]

Figures depend on the machine's load: the script prints `uptime` with them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np

ENV_ID = "sim2real/CartPoleRail-v0"
PLANTS = {  # scales of the hidden plant; `edge` sits at reality's far end, beyond train's ranges
    "inside": {
        "body_mass.cart": 1.3,
        "body_mass.pole": 1.1,
        "joint_damping.slider": 1.2,
        "joint_damping.hinge": 2.0,
        "actuator_gain.cart_force": 0.8,
    },
    "edge": {
        "body_mass.cart": 1.35,
        "body_mass.pole": 1.5,
        "joint_damping.slider": 1.2,
        "joint_damping.hinge": 4.0,
        "actuator_gain.cart_force": 0.75,
    },
}
LATENCY = 2
EVAL_SEED = 90_000
LOG_STEPS = 3000  # 60 s at 50 Hz


def hidden_plant(cfg, plant: str) -> dict:
    """The hidden plant as a fixed randomization set, with `reality`'s noise and pushes."""
    from pipeline.calibration.twin import fixed_set

    return fixed_set(PLANTS[plant], latency=LATENCY, like=cfg.randomization["reality"])


def record_log(cfg, plant: str, path: Path) -> Path:
    """60 s of the legacy LQR on the hidden plant, written in the shadow-log schema."""
    import envs
    from shield.shadowlog import write_shadow_log

    env = gym.make(ENV_ID, randomization=hidden_plant(cfg, plant), max_episode_steps=LOG_STEPS)
    legacy = envs.legacy_controller(ENV_ID)
    obs, _ = env.reset(seed=7)
    rows_obs, rows_u = [], []
    for _ in range(LOG_STEPS):
        u = legacy(np.asarray(obs, np.float32)[None])[0]
        rows_obs.append(obs)
        rows_u.append(u)
        obs, _, terminated, _, _ = env.step(u)
        if terminated:
            break
    n = len(rows_u)
    u = np.stack(rows_u)
    cols = {
        "t": np.arange(n) * 0.02,
        "episode": np.zeros(n),
        "step": np.arange(n),
        "obs": np.stack(rows_obs),
        "legacy_action": u,
        "candidate_raw": u,
        "candidate_action": u,
        "intervened": np.zeros(n, bool),
        "fallback": np.zeros(n, bool),
        "h": np.zeros((n, 1)),
        "latency_us": np.zeros(n),
        "reward": np.full(n, np.nan),
        "cost": np.full(n, np.nan),
    }
    return write_shadow_log(path, cols, {"task": cfg.task.name, "control_period_s": 0.02, "source": "bench"})


def train_and_evaluate(cfg, hidden, seed: int, steps: int, episodes: int, work: Path) -> dict:
    """One fresh training (seed), exported, evaluated with the shield on the hidden plant."""
    from pipeline.deployment.export import export_policy
    from pipeline.evaluation.evaluate import evaluate
    from pipeline.training.train import train
    from shield.runtime import EdgeRuntime

    cfg = cfg.model_copy(deep=True)
    cfg.train.seed = seed
    t0 = time.perf_counter()
    run = train(cfg, out_dir=work / "run", steps=steps, progress=False)
    train_s = time.perf_counter() - t0
    bundle = export_policy(run.run_dir, out_dir=work / "bundle")["bundle"]
    runtime = EdgeRuntime.load(bundle, shield=False)
    res = evaluate(
        cfg, runtime, domains=hidden, episodes=episodes, seed=EVAL_SEED, shield=True, spec=runtime.bundle.shield_spec
    )
    return {"return_mean": res["return_mean"], "violations": res["violations"], "train_s": train_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="fresh trainings per arm")
    p.add_argument("--steps", type=int, default=60_000, help="env steps per training")
    p.add_argument("--episodes", type=int, default=10, help="evaluation episodes on the hidden plant")
    p.add_argument("--plant", choices=sorted(PLANTS), default="inside", help="which hidden plant (default inside)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    import ray

    import envs  # noqa: F401
    from envs.randomization import parse_randomization
    from pipeline.calibration.calibrate import calibrate
    from pipeline.calibration.sets import recentred_training
    from pipeline.config import load_config, parse_config
    from pipeline.evaluation.evaluate import evaluate
    from pipeline.safety.shield_spec import build_shield_spec

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "cartpole.yaml")
    cfg.calibration.known = {"joint_damping.slider": PLANTS[args.plant]["joint_damping.slider"]}
    hidden = parse_randomization(hidden_plant(cfg, args.plant))
    work = Path(tempfile.mkdtemp(prefix="bench-calibration-"))
    log = record_log(cfg, args.plant, work / "field.npz")
    t0 = time.perf_counter()
    result = calibrate(cfg, log)
    calibrate_s = time.perf_counter() - t0
    calibrated_cfg = parse_config(recentred_training(cfg, result), "calibrated")
    identified = {n: round(p["identified"], 3) for n, p in result["parameters"].items()}
    print(
        f"calibration: {calibrate_s:.1f} s, latency {result['latency_steps']['identified']}, identified {identified}",
        flush=True,
    )
    legacy = evaluate(
        cfg,
        envs.legacy_controller(ENV_ID),
        domains=hidden,
        episodes=args.episodes,
        seed=EVAL_SEED,
        shield=True,
        spec=build_shield_spec(cfg),
    )["return_mean"]
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    rows = {"baseline": [], "calibrated": []}
    for seed in range(args.runs):
        for arm, arm_cfg in (("baseline", cfg), ("calibrated", calibrated_cfg)):
            r = train_and_evaluate(arm_cfg, hidden, seed, args.steps, args.episodes, work / f"{arm}-{seed}")
            rows[arm].append(r)
            print(
                f"run {seed} {arm:<10} return {r['return_mean']:7.1f}  violations {r['violations']}  "
                f"train {r['train_s']:.0f} s",
                flush=True,
            )
    ray.shutdown()
    summary = {
        arm: {
            "n": len(v),
            "return_mean": float(np.mean([r["return_mean"] for r in v])),
            "return_std": float(np.std([r["return_mean"] for r in v])),
            "violations": int(sum(r["violations"] for r in v)),
            "train_s_mean": float(np.mean([r["train_s"] for r in v])),
        }
        for arm, v in rows.items()
    }
    out = {
        "plant": args.plant,
        "runs": rows,
        "summary": summary,
        "legacy_return": legacy,
        "calibrate_s": calibrate_s,
        "steps": args.steps,
        "episodes": args.episodes,
        "load": os.getloadavg(),
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"hidden plant {args.plant} {PLANTS[args.plant]}, {args.episodes} eval episodes (seeds {EVAL_SEED}+), {args.steps} training steps, "
            f"load {os.getloadavg()[0]:.1f}"
        )
        print(f"  legacy LQR          return {legacy:7.1f}")
        for arm, s in summary.items():
            print(
                f"  {arm:<10} (n={s['n']})  return {s['return_mean']:7.1f} +- {s['return_std']:.1f}  "
                f"violations {s['violations']}  training {s['train_s_mean']:.0f} s/run"
            )
        print(
            f"  calibration adds {calibrate_s:.1f} s to the flow "
            f"({100 * calibrate_s / summary['baseline']['train_s_mean']:.0f} % of one training run)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
