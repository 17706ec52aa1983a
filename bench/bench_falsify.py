"""Falsification and the assumption monitor in numbers: evaluations per second and the lowest h per plant, and how
soon the monitor flags a plant past the envelope's edge.

    python bench/bench_falsify.py [--task cartpole quadrotor arm ballast] [--budget-s 60] [--seed 0] [--json]
    python bench/bench_falsify.py --task quadrotor --monitor [--ratios 0.71 0.72 0.76] [--episodes 5]
    python bench/bench_falsify.py --dropouts [--task cartpole quadrotor arm] [--episodes 4]

Falsify: the config's spec, searched for --budget-s (the config's `falsify` keys otherwise); `ballast` is the
test plant of tests/helpers/falsify_plants.py (13 randomized parameters per set). Printed per plant: candidates,
evaluations per second, the phases, the corner candidates in all, the lowest h and the cases found; and, as a
baseline in the same run, the same search with every corner enumerated first (the search before corners were
sampled: corner_share 1, its phases after them as before).

--monitor (quadrotor): the monitor's bounds measured over the envelope (`pipeline.evaluation.monitor_bounds`),
then plants at thrust/weight --ratios (mass 1.1 x, rotors ratio x 1.1) under the four reference policies,
shielded: the step the monitor first flags, the first violating step, the flag rate and violating steps, with
the shipped (formula) bounds and the legacy PID alone beside them; then `reality` with the measured bounds under the
four policies (--episodes each): steps and flagged steps (inside the envelope: 0).

--late: per plant (--task, shipped configs), the bundle's spec (`monitor_bounds.bundle_spec`, both monitor tests
measured), on `reality`'s plants answering actions LATE (2 and 4) steps past the spec's longest latency, under the
four reference policies, shielded (--episodes each): the flag rate, the median first flagged step, violating steps;
beside them in the same run the first test alone (no `dist_accel`: the monitor before its second test) and the
legacy controller unshielded; then `reality` itself: flagged steps (inside the envelope: 0).

    python bench/bench_falsify.py --late --task cartpole quadrotor crane furuta ball_beam [--episodes 5]

--dropouts: per plant, the shield's blind horizon (steps, s) and, on `reality` under the four policies, violating
steps with the sensor dropping out for the horizon and for three times it (3 observed steps between dropouts),
beside the same run without dropouts. Figures from a shared machine: ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.config import load_config  # noqa: E402
from pipeline.evaluation.falsify import falsify  # noqa: E402
from pipeline.safety.shield_spec import build_shield_spec  # noqa: E402


def _config(task: str):
    if task == "ballast":
        from tests.helpers.falsify_plants import ballast_cartpole

        cfg = ballast_cartpole(Path(tempfile.mkdtemp()))
        return cfg, build_shield_spec(cfg, check_envelope=False)
    cfg = load_config(f"configs/{task}.yaml")
    return cfg, build_shield_spec(cfg)


def bench_falsify(task: str, budget_s: float, seed: int) -> dict:
    cfg, spec = _config(task)
    out = {}
    for name, share in (("sampled", cfg.falsify.corner_share), ("corners_first", 1.0)):
        cfg.falsify.corner_share = share
        r = falsify(cfg, spec=spec, budget_s=budget_s, seed=seed)
        out[name] = {
            k: r[k] for k in ("evaluated", "evals_per_s", "phases", "corners_total", "min_h", "cases_found", "wall_s")
        }
        print(
            f"{task:10s} {name:13s} {r['evaluated']:5d} candidates {r['evals_per_s']:6.1f}/s  min h "
            f"{r['min_h']:+.4f}  cases {r['cases_found']}  phases {r['phases']}  corners {r['corners_total']}",
            flush=True,
        )
    return out


def bench_monitor(ratios: list[float], episodes: int) -> dict:
    from pipeline.evaluation.adversary import REFERENCE_POLICIES
    from pipeline.evaluation.monitor_bounds import with_measured_monitor

    cfg = load_config("configs/quadrotor.yaml")
    shipped = build_shield_spec(cfg)
    t = time.perf_counter()
    measured = with_measured_monitor(cfg, shipped, runs_per_set=16)
    mon = measured["assumptions"]["monitor"]
    print(
        f"monitor bounds measured in {time.perf_counter() - t:.0f} s over {mon['measured']['steps']} steps: accel "
        f"{[round(a, 3) for a in mon['accel']]} m/s^2 (shipped formula "
        f"{[round(a, 3) for a in shipped['assumptions']['monitor']['accel']]})",
        flush=True,
    )
    out = {"accel": mon["accel"], "shipped_accel": shipped["assumptions"]["monitor"]["accel"], "plants": {}}
    for r in ratios:
        g = r * 1.1
        dom = _with_reality_noise(
            cfg,
            body_mass={"quad": {"low": 1.1, "high": 1.1}},
            actuator_gain={f"rotor{i}": {"low": g, "high": g} for i in range(4)},
            latency_steps={"low": 0, "high": 2},
        )
        alone = _legacy_alone(cfg, shipped, dom, episodes)
        row = {"legacy_unshielded_violations": alone["violations"]}
        for pol in [p for p in REFERENCE_POLICIES]:
            for name, spec in (("measured", measured), ("shipped", shipped)):
                res = _shielded(cfg, pol, spec, dom, episodes)
                first_flag, first_violation = _firsts(cfg, dom, pol, spec) if name == "measured" else (None, None)
                row[f"{pol}/{name}"] = {
                    "violations": res["violations"],
                    "envelope_rate": res.get("envelope_rate"),
                    "first_flag_step": first_flag,
                    "first_violation_step": first_violation,
                }
                print(
                    f"thrust/weight {r:.2f} {pol:11s} {name:8s} violations {res['violations']:4d} (legacy alone "
                    f"{alone['violations']})  envelope_rate {res.get('envelope_rate', 0):.3f}"
                    + (f"  first flag {first_flag}, first violation {first_violation}" if name == "measured" else ""),
                    flush=True,
                )
        out["plants"][r] = row
    steps, flagged = _reality_flags(cfg, measured, episodes)
    out["reality"] = {"steps": steps, "flagged_steps": flagged}
    print(f"reality, measured bounds: {flagged} flagged of {steps} steps", flush=True)
    return out


def bench_dropouts(task: str, episodes: int) -> dict:
    import gymnasium as gym
    import numpy as np

    from pipeline.evaluation.adversary import REFERENCE_POLICIES, reference_policy
    from shield.cbf import CbfShield

    cfg, spec = _config(task)
    K = CbfShield(spec).blind_horizon
    out = {"blind_horizon_steps": K, "blind_horizon_s": K * spec["dt"]}
    for label, blind in (("none", 0), ("horizon", K), ("3x horizon", 3 * K)):
        violations = steps = past = 0
        for pol in REFERENCE_POLICIES:
            for seed in range(episodes):
                env = gym.make(cfg.task.env_id, randomization=cfg.randomization["reality"], max_episode_steps=500)
                shield = CbfShield(spec)
                policy = reference_policy(pol, cfg, shield.spec, seed=seed)
                obs, _ = env.reset(seed=seed)
                for t in range(500):
                    seen = not blind or t < 20 or (t - 20) % (blind + 3) < 3
                    u, _ = shield.filter(obs if seen else np.full_like(obs, np.nan), policy(obs[None])[0])
                    obs, _, terminated, truncated, info = env.step(u)
                    violations += info["cost"] > 0
                    steps += 1
                    if terminated or truncated:
                        break
                past += shield.blind_past_horizon
                env.close()
        out[label] = {"violations": violations, "steps": steps, "past_horizon_steps": past}
        print(
            f"{task:10s} blind horizon {K} steps ({K * spec['dt']:.2f} s); dropouts {label:10s}: {violations} "
            f"violating of {steps} steps, {past} steps past the horizon",
            flush=True,
        )
    return out


def bench_late(task: str, episodes: int) -> dict:
    import copy

    import numpy as np

    from pipeline.evaluation.adversary import REFERENCE_POLICIES
    from pipeline.evaluation.monitor_bounds import bundle_spec
    from shield.spec import ShieldSpec

    cfg = load_config(f"configs/{task}.yaml")
    both = bundle_spec(cfg)
    first = copy.deepcopy(both)
    first["assumptions"]["monitor"].pop("dist_accel", None)
    latency = ShieldSpec.from_dict(both).latency_steps
    out: dict = {"latency_steps": latency, "plants": {}}
    for late in (2, 4):
        dom = _with_reality_noise(cfg, latency_steps={"low": latency + late, "high": latency + late})
        alone = _legacy_alone(cfg, both, dom, episodes)
        row: dict = {"legacy_unshielded_violations": alone["violations"]}
        for pol in REFERENCE_POLICIES:
            for name, spec in (("both tests", both), ("first test only", first)):
                res = _shielded(cfg, pol, spec, dom, episodes)
                flags = (
                    [_firsts(cfg, dom, pol, spec, seed=k)[0] for k in range(episodes)] if name == "both tests" else []
                )
                seen = [f for f in flags if f is not None]
                row[f"{pol}/{name}"] = {
                    "violations": res["violations"],
                    "envelope_rate": res.get("envelope_rate"),
                    **(
                        {"flagged_episodes": len(seen), "median_first_flag": float(np.median(seen)) if seen else None}
                        if flags
                        else {}
                    ),
                }
                print(
                    f"{task} latency +{late} {pol:11s} {name:15s} violations {res['violations']:4d} (legacy alone "
                    f"{alone['violations']})  envelope_rate {res.get('envelope_rate', 0):.3f}"
                    + (
                        f"  flagged {len(seen)}/{episodes}, median first flag step {np.median(seen) if seen else 'n/a'}"
                        if flags
                        else ""
                    ),
                    flush=True,
                )
        out["plants"][f"+{late}"] = row
    steps, flagged = _reality_flags(cfg, both, episodes)
    out["reality"] = {"steps": steps, "flagged_steps": flagged}
    print(f"{task} reality, both tests: {flagged} flagged of {steps} steps", flush=True)
    return out


def _with_reality_noise(cfg, **quantities):
    """A set of `quantities` (randomization keys) with `reality`'s observation and action noise."""
    from envs.randomization import parse_randomization

    reality = cfg.randomization["reality"]
    return parse_randomization(
        {**quantities, "obs_noise_std": reality.obs_noise_std, "action_noise_std": reality.action_noise_std}
    )


def _shielded(cfg, policy_name: str, spec: dict, dom, episodes: int, policy_seed: int = 0, seed: int = 0) -> dict:
    """`policy_name` (a reference policy) through the shield `spec` on `dom`: the evaluation's figures."""
    from pipeline.evaluation.adversary import reference_policy
    from pipeline.evaluation.evaluate import evaluate
    from shield.spec import ShieldSpec

    s = ShieldSpec.from_dict(spec)
    policy = reference_policy(policy_name, cfg, s, seed=policy_seed)
    return evaluate(cfg, policy, domains=dom, seed=seed, episodes=episodes, shield=True, spec=s)


def _legacy_alone(cfg, spec: dict, dom, episodes: int) -> dict:
    """The legacy controller on `dom`, unshielded (`spec` only tells the policy its action box): the baseline."""
    from pipeline.evaluation.adversary import reference_policy
    from pipeline.evaluation.evaluate import evaluate
    from shield.spec import ShieldSpec

    policy = reference_policy("legacy", cfg, ShieldSpec.from_dict(spec))
    return evaluate(cfg, policy, domains=dom, seed=0, episodes=episodes, shield=False)


def _reality_flags(cfg, spec: dict, episodes: int) -> tuple[int, int]:
    """(steps, flagged steps) on `reality` under the four reference policies, shielded by `spec`: inside the
    envelope the monitor must stay silent."""
    from pipeline.evaluation.adversary import REFERENCE_POLICIES

    steps = flagged = 0
    for pol in REFERENCE_POLICIES:
        res = _shielded(cfg, pol, spec, cfg.randomization["reality"], episodes, policy_seed=1, seed=1000)
        n = res.get("steps", 0)
        steps += n
        flagged += round(res.get("envelope_rate", 0.0) * n)
    return steps, flagged


def _firsts(cfg, dom, policy_name, spec, seed: int = 0, steps: int = 400):
    import gymnasium as gym

    from pipeline.evaluation.adversary import reference_policy
    from shield.cbf import CbfShield

    env = gym.make(cfg.task.env_id, randomization=dom, max_episode_steps=steps)
    shield = CbfShield(spec)
    policy = reference_policy(policy_name, cfg, shield.spec, seed=seed)
    obs, _ = env.reset(seed=seed)
    flag = violation = None
    for t in range(steps):
        u, info = shield.filter(obs, policy(obs[None])[0])
        flag = t if flag is None and info["envelope"] else flag
        obs, _, terminated, truncated, step_info = env.step(u)
        violation = t if violation is None and step_info["cost"] > 0 else violation
        if terminated or truncated or (flag is not None and violation is not None):
            break
    env.close()
    return flag, violation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", nargs="+", default=["cartpole", "quadrotor", "arm", "ballast"])
    ap.add_argument("--budget-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--monitor", action="store_true")
    ap.add_argument("--dropouts", action="store_true")
    ap.add_argument("--late", action="store_true")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.71, 0.72, 0.76])
    ap.add_argument("--episodes", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.monitor:
        result = bench_monitor(args.ratios, args.episodes)
    elif args.late:
        result = {task: bench_late(task, args.episodes) for task in args.task if task != "ballast"}
    elif args.dropouts:
        result = {task: bench_dropouts(task, args.episodes) for task in args.task if task != "ballast"}
    else:
        result = {task: bench_falsify(task, args.budget_s, args.seed) for task in args.task}
    if args.json:
        print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
