"""Adaptive (RMA teacher -> history student) against the memoryless policy, same seeds and env-step budget.

Each arm trains the config with `train.seed = seed`, `train.total_env_steps = --steps` (the adaptive arm
counts its teacher's and its distillation's steps in that budget), exports the selected checkpoint and runs
the bundle under its shield, as `serve` does, on the held-out `reality` set and on its hard corner (heaviest
cart and pole, weakest actuator, the longest latency; damping, noise and pushes as reality). The legacy
controller runs on the same episodes as the reference. Printed per run and per arm: mean return, pole drops
(episodes the task terminated before its length), shield violations and wall time; for the adaptive arm, its
plant estimate's held-out R^2 per parameter (the distillation's estimate.json, which the contract carries) and
its median estimate on the hard corner beside the corner's pinned values.

    python bench/bench_adaptive.py --config configs/cartpole.yaml --seeds 0 1 --steps 400000 \
        [--distill-steps 100000] [--history 8] [--episodes 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def hard_corner(rset):
    """`rset` pinned to its hard side: masses at their heaviest, actuator gains at their weakest, the longest
    latency; everything else (damping, noise, pushes) drawn as the set draws it."""
    from envs.randomization import parse_randomization

    doc = rset.model_dump(mode="json")
    for r in doc["body_mass"].values():
        r["low"] = r["high"]
    for r in doc["actuator_gain"].values():
        r["high"] = r["low"]
    if doc.get("latency_steps"):
        doc["latency_steps"]["low"] = doc["latency_steps"]["high"]
    return parse_randomization(doc, "hard_corner")


def score(cfg, driver, rset, episodes: int, seed: int) -> dict:
    """Return, drops and violations of `driver` on `episodes` seeded episodes of `rset`; for a driver that records
    its policy's plant estimate, the median of each parameter over the steps with a full history."""
    from pipeline.evaluation.episodes import control_period_s, make_env, run_episodes

    env = make_env(cfg, rset)
    recorded = getattr(driver, "estimates", None)
    if recorded is not None:
        recorded.clear()
    try:
        totals = run_episodes(env, driver, list(range(seed, seed + episodes)), dt=control_period_s(cfg))
    finally:
        env.close()
    out = dict(
        return_mean=statistics.fmean(totals.returns),
        drops=sum(totals.terminated),
        violations=int(sum(totals.violations)),
    )
    if recorded:
        import numpy as np

        out["estimate_median"] = dict(zip(driver.names, np.median(np.asarray(recorded), axis=0).tolist()))
    return out


def estimating_driver(runtime):
    """A RuntimeDriver that also records the policy's plant estimate at each step whose history was full."""
    from pipeline.evaluation.episodes import RuntimeDriver
    from shield.contract import estimate_names

    class Recorder(RuntimeDriver):
        def __init__(self, runtime, names: list[str]):
            super().__init__(runtime)
            self.names, self.estimates = names, []

        def act(self, obs):
            out = super().act(obs)
            value, steps = self.runtime.estimate()
            if value is not None and steps >= self.runtime.policy.history_length:
                self.estimates.append(value)
            return out

    names = estimate_names(runtime.verified_bundle.manifest.get("contract"))
    return Recorder(runtime, names) if names else RuntimeDriver(runtime)


def corner_truth(rset) -> dict:
    """The hard corner's pinned parameters (what a plant estimate there should say); the rest vary."""
    truth = {}
    for group in ("body_mass", "actuator_gain"):
        for element, r in getattr(rset, group).items():
            if r.low == r.high:
                truth[f"{group}.{element}"] = r.low
    if rset.latency_steps is not None and rset.latency_steps.low == rset.latency_steps.high:
        truth["latency_steps"] = float(rset.latency_steps.low)
    return truth


def one_arm(cfg, arm: str, seed: int, args, work: Path, sets: dict) -> dict:
    from pipeline.config import AdaptiveConfig
    from pipeline.deployment.export import export_policy
    from pipeline.training.train import train
    from shield.runtime import EdgeRuntime

    cfg = cfg.model_copy(deep=True)
    cfg.train.seed = seed
    cfg.train.total_env_steps = args.steps
    if arm == "rma":
        cfg.train.history_length = 0
        cfg.train.adaptive = AdaptiveConfig(history_length=args.history, distill_steps=args.distill_steps)
    start = time.perf_counter()
    trained = train(cfg, out_dir=work / f"{arm}-{seed}", progress=False)
    train_s = time.perf_counter() - start
    bundle = export_policy(trained.run_dir, out_dir=work / f"bundle-{arm}-{seed}")["bundle"]
    driver = estimating_driver(EdgeRuntime.load(bundle))
    out = dict(arm=arm, seed=seed, env_steps=trained.env_steps, train_s=round(train_s, 1))
    skill = Path(trained.run_dir) / "estimate.json"
    if skill.is_file():  # the student's plant estimate: held-out R^2 per parameter (1 exact, 0 the range's middle)
        out["estimate_r2"] = {p["name"]: p["held_out_r2"] for p in json.loads(skill.read_text())["parameters"]}
    for name, rset in sets.items():
        out[name] = score(cfg, driver, rset, args.episodes, cfg.shadow.seed)
    return out


def legacy_arm(cfg, args, sets: dict) -> dict:
    import envs
    from pipeline.evaluation.episodes import PolicyDriver
    from pipeline.safety.shield_spec import build_shield_spec
    from shield.cbf import CbfShield
    from shield.spec import ShieldSpec

    shield = CbfShield(ShieldSpec.from_dict(build_shield_spec(cfg)))
    driver = PolicyDriver(envs.legacy_controller(cfg.task.env_id), shield)
    out = dict(arm="legacy", seed=None, env_steps=0, train_s=0.0)
    for name, rset in sets.items():
        out[name] = score(cfg, driver, rset, args.episodes, cfg.shadow.seed)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/cartpole.yaml")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=400_000, help="env steps per arm (adaptive: teacher + distillation)")
    p.add_argument("--distill-steps", type=int, default=100_000)
    p.add_argument("--history", type=int, default=8)
    p.add_argument("--episodes", type=int, default=30, help="per set, seeds shadow.seed ...")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    from pipeline.config import load_config

    cfg = load_config(args.config)
    reality = cfg.randomization[cfg.shadow.domains]
    sets = {"reality": reality, "hard_corner": hard_corner(reality)}
    rows = [legacy_arm(cfg, args, sets)]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for arm in ("memoryless", "rma"):
                rows.append(one_arm(cfg, arm, seed, args, Path(tmp), sets))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'arm':<11}{'seed':>5}{'env steps':>11}{'train s':>9}   reality: return drops viol   hard corner: ...")
    for r in rows:
        re, hc = r["reality"], r["hard_corner"]
        print(
            f"{r['arm']:<11}{'' if r['seed'] is None else r['seed']:>5}{r['env_steps']:>11}{r['train_s']:>9}"
            f"   {re['return_mean']:8.1f} {re['drops']:3d} {re['violations']:3d}"
            f"   {hc['return_mean']:8.1f} {hc['drops']:3d} {hc['violations']:3d}"
        )
    truth = corner_truth(sets["hard_corner"])
    for r in rows:
        if r.get("estimate_r2"):
            r2 = ", ".join(f"{n} {v:.2f}" for n, v in r["estimate_r2"].items() if v is not None)
            print(f"rma seed {r['seed']}: plant estimate, held-out R^2: {r2}")
            guessed = r["hard_corner"].get("estimate_median", {})
            pairs = ", ".join(f"{n} {guessed[n]:.2f} (true {v:g})" for n, v in truth.items() if n in guessed)
            print(f"rma seed {r['seed']}: on the hard corner the policy believes {pairs}")
    legacy = rows[0]
    for arm in ("memoryless", "rma"):
        mine = [r for r in rows if r["arm"] == arm]
        for name in sets:
            ratio = statistics.fmean(r[name]["return_mean"] for r in mine) / legacy[name]["return_mean"]
            drops = sum(r[name]["drops"] for r in mine)
            print(
                f"{arm:<11}{name:<12} return ratio vs legacy {ratio:.3f}, drops {drops} in {len(mine)} x "
                f"{args.episodes} episodes"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
