"""Calibration benchmark: does the fit find plants it was not told, and are its stated intervals honest?

`--mode identify` (default): N hidden cart-poles, about half drawn inside the
config's ranges and half outside them (one to three scales beyond the hull),
latency 0-2 steps, each driven by the legacy LQR for `--log-steps` control
steps with `reality`'s sensor noise, action noise and pushes. Each log is
calibrated blind. Printed: per identified combination fitted vs true and
whether the stated 90 % interval covers the truth, latency accuracy and its
stated confidence, the outside/misfit verdicts against the truth, wall time.

    nice -n 10 python bench/bench_calibration.py --plants 10 --log-steps 3000 --jobs 2

`--mode train`: does calibrating pay? Each hidden cart-pole of `--plant` (PLANTS
below: inside train's ranges, at reality's far end beyond them, a light prompt
one) is calibrated from 60 s of the legacy LQR's log (slider damping known);
per run seed, a policy trained on `train` and one on train re-centred on the
calibrated set (what `sim2real run --from-log` trains on) are evaluated with
the shield on the hidden plant: return, dropped poles, interventions, paired
by seed.

    nice -n 10 python bench/bench_calibration.py --mode train --plant inside edge light --runs 3 --steps 250000

Figures depend on the machine's load: the script prints the load with them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np

ENV_ID = "sim2real/CartPoleRail-v0"
PLANTS = {  # scales of the hidden plant and its latency (control steps)
    # inside train's ranges, on its heavy, late, weak side
    "inside": (
        {
            "body_mass.cart": 1.3,
            "body_mass.pole": 1.1,
            "joint_damping.slider": 1.2,
            "joint_damping.hinge": 2.0,
            "actuator_gain.cart_force": 0.8,
        },
        2,
    ),
    # at reality's far end, beyond train's ranges
    "edge": (
        {
            "body_mass.cart": 1.35,
            "body_mass.pole": 1.5,
            "joint_damping.slider": 1.2,
            "joint_damping.hinge": 4.0,
            "actuator_gain.cart_force": 0.75,
        },
        2,
    ),
    # the other side: a light, prompt plant with a strong drive, which train's wide ranges also cover
    "light": (
        {
            "body_mass.cart": 0.8,
            "body_mass.pole": 0.8,
            "joint_damping.slider": 0.9,
            "joint_damping.hinge": 0.6,
            "actuator_gain.cart_force": 1.05,
        },
        0,
    ),
}
EVAL_SEED = 90_000
LOG_STEPS = 3000  # 60 s at 50 Hz


def hidden_plant(cfg, plant: str) -> dict:
    """The hidden plant as a fixed randomization set, with `reality`'s noise and pushes."""
    from pipeline.calibration.twin import fixed_set

    scales, latency = PLANTS[plant]
    return fixed_set(scales, latency=latency, like=cfg.randomization["reality"])


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
    return {
        "return_mean": res["return_mean"],
        "drops": res["terminated_episodes"],
        "intervention_rate": res["intervention_rate"],
        "violations": res["violations"],
        "train_s": train_s,
    }


NAMES = ["actuator_gain.cart_force", "body_mass.cart", "body_mass.pole", "joint_damping.hinge", "joint_damping.slider"]


def draw_plants(cfg, n: int, seed: int) -> list[dict]:
    """n hidden plants: even ones inside `reality`'s ranges, odd ones with 1-3 scales beyond the config's hull."""
    from pipeline.calibration.sets import configured_ranges, kept_from

    rng = np.random.default_rng(seed)
    hull = configured_ranges(cfg)
    plants = []
    for i in range(n):
        lo = np.log([kept_from(cfg, k)[1][0] for k in NAMES])
        hi = np.log([kept_from(cfg, k)[1][1] for k in NAMES])
        theta = lo + rng.random(len(NAMES)) * (hi - lo)
        outside = i % 2 == 1
        if outside:
            for j in rng.choice(len(NAMES), size=rng.integers(1, 4), replace=False):
                h_lo, h_hi = np.log(hull[NAMES[j]])
                beyond = math.log(rng.uniform(1.25, 1.7))
                theta[j] = h_hi + beyond if rng.random() < 0.5 else h_lo - beyond
        plants.append(
            {
                "scales": {k: float(math.exp(t)) for k, t in zip(NAMES, theta)},
                "latency": int(rng.integers(0, 3)),
                "drawn_outside": outside,
                "seed": 1000 + i,
            }
        )
    return plants


def identify_one(job: tuple) -> dict:
    """Record one hidden plant's log and calibrate it blind; compare with the truth."""
    plant, log_steps, work = job
    from pipeline.calibration.calibrate import calibrate
    from pipeline.calibration.sets import configured_ranges
    from pipeline.calibration.simulate import simulated_log
    from pipeline.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "cartpole.yaml")
    path = simulated_log(
        cfg,
        plant["scales"],
        plant["latency"],
        Path(work) / f"plant-{plant['seed']}.npz",
        steps=log_steps,
        seed=plant["seed"],
    )
    t0 = time.perf_counter()
    result = calibrate(cfg, path)
    wall = time.perf_counter() - t0
    truth = plant["scales"]
    hull = configured_ranges(cfg)
    combos = []
    for c in result["combinations"]:
        if c["identified"]:
            true = math.exp(sum(w * math.log(truth[k]) for k, w in c["weights"].items()))
            combos.append(
                {
                    "weights": {k: round(w, 2) for k, w in c["weights"].items() if abs(w) > 0.05},
                    "true": true,
                    "fitted": c["estimate"],
                    "interval": c["interval"],
                    "covered": c["interval"][0] <= true <= c["interval"][1],
                    "rel_error": c["estimate"] / true - 1.0,
                }
            )
    truly_outside = any(not hull[k][0] <= v <= hull[k][1] for k, v in truth.items())
    # Can these logs tell the plant from every inside one? Not when the truth's own identified
    # combinations (with the fit's interval widths) are reachable inside the ranges: then the plant
    # differs from an inside plant only along directions the logs cannot see.
    from pipeline.calibration.identify import consistent_ranges

    names = sorted(c for c in result["combinations"][0]["weights"]) if result["combinations"] else []
    at_truth = [
        dict(c, log_estimate=sum(w * math.log(truth[k]) for k, w in c["weights"].items()))
        for c in result["combinations"]
    ]
    lo, hi = np.log([hull[k][0] for k in names]), np.log([hull[k][1] for k in names])
    distinguishable = truly_outside and consistent_ranges(at_truth, names, lo, hi) is None
    return {
        "plant": plant,
        "latency_fitted": result["latency_steps"]["identified"],
        "latency_confidence": result["latency_steps"]["confidence"],
        "combinations": combos,
        "flagged_outside": result["outside"],
        "flagged_misfit": result["misfit"],
        "flagged_offset": any(v.startswith("offset:") for v in result["verdict"]),
        "structure_F": [round(v, 1) for v in result["defect_structure_F"]],
        "spread": [round(v, 2) for v in result["residual_vs_noise_floor"]],
        "truly_outside": truly_outside,
        "distinguishable": distinguishable,
        "wall_s": wall,
    }


def identify(args) -> int:
    from multiprocessing import Pool

    from pipeline.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "cartpole.yaml")
    plants = draw_plants(cfg, args.plants, args.seed)
    work = tempfile.mkdtemp(prefix="bench-calibration-")
    t0 = time.perf_counter()
    with Pool(args.jobs) as pool:
        rows = []
        for r in pool.imap(identify_one, [(p, args.log_steps, work) for p in plants]):
            rows.append(r)
            p = r["plant"]
            print(
                f"plant {p['seed']} ({'outside' if r['truly_outside'] else 'inside'}) latency {p['latency']} -> "
                f"{r['latency_fitted']} (conf {r['latency_confidence']:.3f}); flagged outside {r['flagged_outside']}, "
                f"misfit {r['flagged_misfit']} (spread {r['spread']}, structure F {r['structure_F']}), offset "
                f"{r['flagged_offset']}; "
                f"{r['wall_s']:.0f} s",
                flush=True,
            )
            for c in r["combinations"]:
                print(
                    f"    {c['weights']}: true {c['true']:.4f} fitted {c['fitted']:.4f} "
                    f"90% [{c['interval'][0]:.4f}, {c['interval'][1]:.4f}] covered {c['covered']}",
                    flush=True,
                )
    combos = [c for r in rows for c in r["combinations"]]
    inside = [r for r in rows if not r["truly_outside"]]
    outside = [r for r in rows if r["truly_outside"]]
    summary = {
        "plants": len(rows),
        "log_steps": args.log_steps,
        "latency_accuracy": float(np.mean([r["latency_fitted"] == r["plant"]["latency"] for r in rows])),
        "identified_combinations": len(combos),
        "coverage_90": float(np.mean([c["covered"] for c in combos])) if combos else None,
        "median_abs_rel_error": float(np.median([abs(c["rel_error"]) for c in combos])) if combos else None,
        "outside_detected": f"{sum(r['flagged_outside'] for r in outside)}/{len(outside)}",
        "outside_distinguishable_detected": f"{sum(r['flagged_outside'] for r in outside if r['distinguishable'])}/"
        f"{sum(r['distinguishable'] for r in outside)}",
        "inside_flagged_outside": f"{sum(r['flagged_outside'] for r in inside)}/{len(inside)}",
        "inside_flagged_misfit": f"{sum(r['flagged_misfit'] for r in inside)}/{len(inside)}",
        # Every hidden plant has the twin's sensors and forces: an offset line on any of them is a false alarm.
        "flagged_offset": f"{sum(r['flagged_offset'] for r in rows)}/{len(rows)}",
        "wall_s_median": float(np.median([r["wall_s"] for r in rows])),
        "bench_wall_s": time.perf_counter() - t0,
        "load": os.getloadavg(),
    }
    print(json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
    return 0


def train_payoff(args, plant: str) -> int:
    """`--mode train` on one hidden plant: calibrate from its log, then per run seed a policy trained on `train`
    and one on the calibrated set, each evaluated shielded on the plant (return, drops, interventions)."""
    import ray

    import envs  # noqa: F401
    from envs.randomization import parse_randomization
    from pipeline.calibration.calibrate import calibrate
    from pipeline.calibration.sets import recentred_training
    from pipeline.config import load_config, parse_config
    from pipeline.evaluation.evaluate import evaluate
    from pipeline.safety.shield_spec import build_shield_spec

    scales, latency = PLANTS[plant]
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "cartpole.yaml")
    cfg.calibration.known = {"joint_damping.slider": scales["joint_damping.slider"]}
    hidden = parse_randomization(hidden_plant(cfg, plant))
    work = Path(tempfile.mkdtemp(prefix="bench-calibration-"))
    log = record_log(cfg, plant, work / "field.npz")
    t0 = time.perf_counter()
    result = calibrate(cfg, log)
    calibrate_s = time.perf_counter() - t0
    calibrated_cfg = parse_config(recentred_training(cfg, result), "calibrated")
    # a parameter the log does not pin down is marked "?": calibration keeps its configured range
    identified = {n: round(p["identified"], 3) if p["identified_ok"] else "?" for n, p in result["parameters"].items()}
    print(
        f"{plant}: calibration {calibrate_s:.1f} s, latency {result['latency_steps']['identified']} (true {latency}), "
        f"identified {identified}, verdict {result.get('verdict')}",
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
    )
    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    rows = {"baseline": [], "calibrated": []}
    try:
        for seed in range(args.runs):
            for arm, arm_cfg in (("baseline", cfg), ("calibrated", calibrated_cfg)):
                r = train_and_evaluate(arm_cfg, hidden, seed, args.steps, args.episodes, work / f"{arm}-{seed}")
                rows[arm].append(r)
                print(
                    f"  run {seed} {arm:<10} return {r['return_mean']:7.1f}  drops {r['drops']}  "
                    f"interventions {100 * r['intervention_rate']:.2f} %  violations {r['violations']}  "
                    f"train {r['train_s']:.0f} s",
                    flush=True,
                )
    finally:
        ray.shutdown()
    summary = {
        arm: {
            "n": len(v),
            "return_mean": float(np.mean([r["return_mean"] for r in v])),
            "return_std": float(np.std([r["return_mean"] for r in v])),
            "drops": int(sum(r["drops"] for r in v)),
            "intervention_rate": float(np.mean([r["intervention_rate"] for r in v])),
            "violations": int(sum(r["violations"] for r in v)),
            "train_s_mean": float(np.mean([r["train_s"] for r in v])),
        }
        for arm, v in rows.items()
    }
    # paired by run seed: both arms start from the same seed and are judged on the same episodes
    diffs = [c["return_mean"] - b["return_mean"] for b, c in zip(rows["baseline"], rows["calibrated"])]
    out = {
        "plant": plant,
        "scales": scales,
        "latency_steps": latency,
        "identified": identified,
        "latency_identified": result["latency_steps"]["identified"],
        "verdict": result.get("verdict"),
        "runs": rows,
        "summary": summary,
        "paired_return_diff": diffs,
        "legacy": {k: legacy[k] for k in ("return_mean", "terminated_episodes", "intervention_rate", "violations")},
        "calibrate_s": calibrate_s,
        "steps": args.steps,
        "episodes": args.episodes,
        "load": os.getloadavg(),
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"hidden plant {plant} {scales}, latency {latency}; {args.episodes} shielded eval episodes "
        f"(seeds {EVAL_SEED}+), {args.steps} training steps, load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"  legacy LQR          return {legacy['return_mean']:7.1f}  drops {legacy['terminated_episodes']}  "
        f"interventions {100 * legacy['intervention_rate']:.2f} %"
    )
    for arm, s in summary.items():
        print(
            f"  {arm:<10} (n={s['n']})  return {s['return_mean']:7.1f} +- {s['return_std']:.1f}  drops {s['drops']}  "
            f"interventions {100 * s['intervention_rate']:.2f} %  violations {s['violations']}  "
            f"training {s['train_s_mean']:.0f} s/run"
        )
    print(
        f"  calibrated - baseline, paired by seed: {' '.join(f'{d:+.1f}' for d in diffs)} (mean {np.mean(diffs):+.1f})"
    )
    print(
        f"  calibration adds {calibrate_s:.1f} s to the flow "
        f"({100 * calibrate_s / summary['baseline']['train_s_mean']:.0f} % of one training run)",
        flush=True,
    )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["identify", "train"], default="identify")
    p.add_argument("--plants", type=int, default=10, help="identify: hidden plants (half inside, half outside)")
    p.add_argument("--log-steps", type=int, default=3000, help="identify: control steps per log (50 Hz)")
    p.add_argument("--jobs", type=int, default=2, help="identify: plants calibrated in parallel")
    p.add_argument("--seed", type=int, default=0, help="identify: draw of the plants")
    p.add_argument("--runs", type=int, default=5, help="fresh trainings per arm")
    p.add_argument("--steps", type=int, default=60_000, help="env steps per training")
    p.add_argument("--episodes", type=int, default=10, help="evaluation episodes on the hidden plant")
    p.add_argument(
        "--plant", nargs="+", choices=sorted(PLANTS), default=["inside"], help="train: hidden plants (default inside)"
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.mode == "identify":
        return identify(args)

    return sum(train_payoff(args, plant) for plant in args.plant)


if __name__ == "__main__":
    raise SystemExit(main())
