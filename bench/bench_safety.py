"""The safety case in numbers (issue 11): shielded violations everywhere the config admits a plant, beside unshielded.

    python bench/bench_safety.py [--task cartpole quadrotor arm] [--episodes 100] [--corner-episodes 8]
                                 [--steps 150] [--unshielded-share 0.25] [--bundle TASK=DIR ...] [--json]
    python bench/bench_safety.py --task cartpole --steps 0 --past-termination   # on past a fallen pole

For each task, the adversarial, random, bang-bang and legacy policies run shielded on
`train`, `reality` (--episodes each) and on every corner of the config's
envelope (`falsify.envelope_set`: each range at one end, widest noise and
push; --corner-episodes each). Printed per domain and policy: episodes,
violating steps and episodes with the shield, the unshielded counts beside
them (on a share of the episodes, same seeds), the intervention rate and the
assumption monitor's flag rate (inside the envelope it should stay 0).
With --bundle TASK=DIR, the trained policy's intervention rate on `reality`
and its return shielded vs unshielded (the spec built from the config: the
shield under test, not the one in the bundle). Figures from a shared machine:
report the load beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from envs.randomization import parse_randomization
from pipeline.config import load_config
from pipeline.evaluation.adversary import REFERENCE_POLICIES, reference_policy
from pipeline.evaluation.evaluate import evaluate
from pipeline.evaluation.falsify import corner_domains, envelope_set
from pipeline.safety.shield_spec import build_shield_spec
from shield.spec import ShieldSpec

POLICIES = REFERENCE_POLICIES


def _run(cfg, spec, policy_name, domains, episodes, seed, shield, steps, past_termination=False) -> dict:
    policy = reference_policy(policy_name, cfg, spec, seed=seed)
    r = evaluate(
        cfg,
        policy,
        domains=domains,
        episodes=episodes,
        seed=seed,
        shield=shield,
        spec=spec,
        max_episode_steps=steps,
        past_termination=past_termination,
    )
    return {
        k: r[k]
        for k in (
            "episodes",
            "steps",
            "violations",
            "violation_episodes",
            "intervention_rate",
            "envelope_rate",
            "return_mean",
        )
    }


def bench_task(task: str, args) -> dict:
    cfg = load_config(f"configs/{task}.yaml")
    spec = ShieldSpec.from_dict(build_shield_spec(cfg))
    domains = [("train", "train", args.episodes), ("reality", "reality", args.episodes)]
    domains += [
        (f"corner{i:02d}", parse_randomization(d), args.corner_episodes)
        for i, d in enumerate(corner_domains(envelope_set(cfg)))
    ]
    rows, totals = (
        [],
        {
            "episodes": 0,
            "steps": 0,
            "violations": 0,
            "unshielded_episodes": 0,
            "unshielded_violations": 0,
            "envelope_steps": 0,
        },
    )
    for j, (label, dom, episodes) in enumerate(domains):
        for name in POLICIES:
            seed = 100_000 + 1000 * j
            on = _run(cfg, spec, name, dom, episodes, seed, True, args.steps, args.past_termination)
            n_off = max(1, int(round(episodes * args.unshielded_share)))
            off = _run(cfg, spec, name, dom, n_off, seed, False, args.steps, args.past_termination)
            rows.append({"domain": label, "policy": name, "shielded": on, "unshielded": off})
            totals["episodes"] += on["episodes"]
            totals["steps"] += on["steps"]
            totals["violations"] += on["violations"]
            totals["envelope_steps"] += round(on["envelope_rate"] * on["steps"])
            totals["unshielded_episodes"] += off["episodes"]
            totals["unshielded_violations"] += off["violations"]
            if not args.json:
                print(
                    f"{task:>9} {label:>9} {name:>11}: shielded {on['episodes']:>4} ep, {on['violations']:>3} viol "
                    f"steps "
                    f"({on['violation_episodes']} ep), interv {on['intervention_rate']:.3f}, envelope "
                    f"{on['envelope_rate']:.4f} | unshielded {off['episodes']:>3} ep, {off['violations']:>5} viol "
                    f"steps "
                    f"({off['violation_episodes']} ep)",
                    flush=True,
                )
    out = {"task": task, "rows": rows, "totals": totals}
    bundle = dict(b.split("=", 1) for b in args.bundle).get(task)
    if bundle:
        from shield.runtime import EdgeRuntime

        runtime = EdgeRuntime.load(bundle, shield=False)
        trained = {}
        for shield in (True, False):
            r = evaluate(cfg, runtime, domains="reality", episodes=args.episodes, seed=5000, shield=shield, spec=spec)
            trained["shielded" if shield else "unshielded"] = {
                k: r[k]
                for k in (
                    "return_mean",
                    "violations",
                    "intervention_rate",
                    "envelope_rate",
                    "shield_us_p50",
                    "shield_us_p99",
                )
            }
        trained["return_ratio"] = trained["shielded"]["return_mean"] / trained["unshielded"]["return_mean"]
        out["trained"] = trained
        if not args.json:
            print(f"{task}: trained policy on reality: {json.dumps(trained)}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", nargs="+", default=["cartpole", "quadrotor", "arm"])
    p.add_argument("--episodes", type=int, default=100, help="episodes per policy on train and on reality")
    p.add_argument("--corner-episodes", type=int, default=8, help="episodes per policy on each envelope corner")
    p.add_argument("--steps", type=int, default=150, help="steps per episode (the tasks' own length: 0)")
    p.add_argument(
        "--unshielded-share",
        type=float,
        default=0.25,
        help="share of the episodes also run unshielded (at least one per domain and policy: the baseline beside each "
        "row)",
    )
    p.add_argument("--bundle", nargs="*", default=[], metavar="TASK=DIR", help="a trained bundle per task")
    p.add_argument(
        "--past-termination",
        action="store_true",
        help="step on past the task's termination to the episode's length (a cart-pole whose pole fell: "
        "a real plant goes on, and so does the shield's job); with --steps 0, the task's length",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.steps = args.steps or None
    t0 = time.time()
    results = [bench_task(t, args) for t in args.task]
    load = os.getloadavg()
    summary = {"results": results, "wall_s": time.time() - t0, "loadavg": load}
    if args.json:
        print(json.dumps(summary))
    else:
        for r in results:
            t = r["totals"]
            print(
                f"TOTAL {r['task']}: shielded {t['episodes']} episodes / {t['steps']} steps: {t['violations']} "
                f"violating "
                f"steps, {t['envelope_steps']} envelope-flagged steps; unshielded {t['unshielded_episodes']} "
                f"episodes: {t['unshielded_violations']} violating steps"
            )
        print(f"wall {summary['wall_s']:.0f} s, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    return 0 if all(r["totals"]["violations"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
