"""Pass rate of the default pipeline: N fresh train -> export -> shadow -> gate runs with different seeds.

The yardstick of "every fresh run yields a policy that holds up": each run
trains the config's defaults with `train.seed = seed0 + k`, exports the
selected checkpoint, runs both shadow passes on the held-out `shadow.domains`
(`reality`) and applies the config's gate, unchanged. Printed per run and in
total: the gate decision (pass, inconclusive, fail), the paired return
difference candidate - legacy on reality that it decided on (legacy is the
baseline, run in the same evaluation on the same seeds) with its bounds and
the episodes it took, the episodes each policy lost that the other kept,
shielded violations, the shield's intervention rate with the candidate
driving, the selected checkpoint, and the wall time of the run; plus the
machine load. The ratio of mean returns is printed too, as a figure: the
gate does not decide on it.

    python bench/bench_pass_rate.py --config configs/cartpole.yaml --runs 20 [--seed0 100] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def one_run(cfg, seed: int, work: Path) -> dict:
    """Train, export, shadow-evaluate and gate one fresh run; the figures the bench reports."""
    from pipeline.deployment.export import export_policy
    from pipeline.evaluation.shadow import run_shadow
    from pipeline.training.train import train

    cfg = cfg.model_copy(deep=True)
    cfg.train.seed = seed
    start = time.perf_counter()
    trained = train(cfg, out_dir=work / f"run-{seed}", progress=False)
    train_s = time.perf_counter() - start
    exported = export_policy(trained.run_dir, out_dir=work / f"bundle-{seed}")
    shadow = run_shadow(exported["bundle"], cfg, domains=cfg.shadow.domains, report_dir=work / f"report-{seed}")
    from pipeline.evaluation.gate import paired_return_bound

    m = shadow["metrics"]
    legacy, cand = m["legacy_return_mean"], m["candidate_return_mean"]
    bound = paired_return_bound(m, cfg.gate, "legacy")
    lost = m.get("failures_vs_legacy") or {}
    return dict(
        seed=seed,
        decision=shadow["decision"],
        failing=shadow["failing"],
        episodes=len(m.get("candidate_returns") or []),
        vs_legacy=None if bound is None else bound.as_dict(),
        lost_candidate_only=lost.get("candidate_only"),
        lost_legacy_only=lost.get("legacy_only"),
        return_ratio=cand / legacy if legacy else None,
        candidate_return=cand,
        legacy_return=legacy,
        violations=m["candidate_violations"],
        intervention_rate=m["candidate_intervention_rate"],
        latency_p99_us=m.get("counterfactual_latency_p99_us"),
        env_steps=trained.env_steps,
        selected_update=trained.best_updates,
        updates=trained.updates,
        validation_return=trained.best_validation_return,
        stopped_early=trained.stopped_early,
        train_s=train_s,
        wall_s=time.perf_counter() - start,
        load=os.getloadavg()[0],
    )


def summarize(runs: list[dict], config: str) -> dict:
    ratios = [r["return_ratio"] for r in runs if r["return_ratio"] is not None]
    walls = [r["wall_s"] for r in runs]
    # The latency check measures the machine as much as the policy: on a loaded box it fails on
    # preemption alone, so the count without it is reported beside the gate's own.
    return dict(
        config=config,
        runs=len(runs),
        passed=sum(r["decision"] == "pass" for r in runs),
        decisions={k: sum(r["decision"] == k for r in runs) for k in ("pass", "inconclusive", "fail")},
        episodes_median=statistics.median(r["episodes"] for r in runs),
        passed_but_latency=sum(
            bool(r["failing"]) and all(k.endswith("max_latency_p99_us") for k in r["failing"]) for r in runs
        ),
        ratio_min=min(ratios),
        ratio_median=statistics.median(ratios),
        ratio_max=max(ratios),
        violations_max=max(r["violations"] for r in runs),
        intervention_rate_max=max(r["intervention_rate"] or 0.0 for r in runs),
        wall_s_median=statistics.median(walls),
        wall_s_max=max(walls),
        load_avg_1min=os.getloadavg()[0],
        cpus=os.cpu_count(),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/cartpole.yaml")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed0", type=int, default=100, help="train.seed of the first run (then +1 per run)")
    parser.add_argument("--out", default=None, help="keep run dirs, bundles and reports here (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="one JSON object (per-run rows + summary) on stdout")
    args = parser.parse_args(argv)
    from pipeline.config import ConfigError, load_config
    from pipeline.evaluation.gate import format_bound

    try:
        cfg = load_config(args.config)
    except ConfigError as err:
        print(f"bench_pass_rate: {err}", file=sys.stderr)
        return 2
    if args.runs < 1:
        print("bench_pass_rate: --runs must be >= 1", file=sys.stderr)
        return 2
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="sim2real-pass-rate-"))
    runs = []
    for k in range(args.runs):
        runs.append(one_run(cfg, args.seed0 + k, work))
        r = runs[-1]
        ratio = "n/a" if r["return_ratio"] is None else f"{r['return_ratio']:.3f}"
        v = r["vs_legacy"]
        diff = format_bound(v)
        # Per-run rows as they finish (stderr with --json), so a long bench cut short still says something.
        print(
            f"seed {r['seed']}: gate {r['decision'].upper():12}  vs legacy {diff} paired episodes  "
            f"lost {r['lost_candidate_only']} only by the candidate, {r['lost_legacy_only']} only by legacy  "
            f"ratio of means {ratio}  violations {r['violations']}  "
            f"interventions {r['intervention_rate']:.3f}  latency p99 {r['latency_p99_us']:.0f} us  "
            f"selected update {r['selected_update']}/{r['updates']}  {r['env_steps']} steps  "
            f"wall {r['wall_s']:.0f} s (load {r['load']:.1f})" + (f"  failing {r['failing']}" if r["failing"] else ""),
            file=sys.stderr if args.json else sys.stdout,
            flush=True,
        )
    summary = summarize(runs, args.config)
    if args.json:
        print(json.dumps(dict(summary=summary, runs=runs)))
    else:
        s = summary
        print(
            f"{s['config']}: {s['passed']}/{s['runs']} passed the gate ({s['passed_but_latency']} with every "
            f"check but the latency p99); decisions {s['decisions']}, median {s['episodes_median']:g} episodes; "
            f"ratio of mean returns vs legacy on reality "
            f"min {s['ratio_min']:.3f} median {s['ratio_median']:.3f} max {s['ratio_max']:.3f}; "
            f"violations max {s['violations_max']}; intervention rate max {s['intervention_rate_max']:.3f}; "
            f"wall per run median {s['wall_s_median']:.0f} s, max {s['wall_s_max']:.0f} s "
            f"(load {s['load_avg_1min']:.1f} on {s['cpus']} CPUs)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
