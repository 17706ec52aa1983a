"""The nightly gate, judged afterwards: fresh retrain runs of two consecutive nights per plant, then fresh episodes.

Each run starts an empty registry and runs the `retrain` flow twice (night 1
with `train.seed = seed0 + k`, night 2 with a different seed), so on night 2
the production version (if night 1 promoted one) is the incumbent the
candidate must beat. Printed per night: the gate's decision (pass, kept,
inconclusive, fail), the paired mean return difference candidate - legacy
(and - production) with the gate's bounds, the paired episodes used, and
the wall time of the sequential evaluation (the decision). Afterwards every
promoted version is judged on `--judge-episodes` fresh `reality` episodes
(seeds the gate never saw), paired with legacy and with the production
version it replaced: a promotion is *worse* if the 95 % interval of the
paired difference lies below 0 (and the point estimate is reported too).

    python bench/bench_gate.py --config configs/cartpole.yaml --runs 20 [--seed0 100] [--judge-episodes 200] [--json]
    python bench/bench_gate.py --config configs/cartpole.yaml --regate OLD/cartpole-*/models/cartpole/*

Figures, never pass/fail. The config is used as shipped, except each run's
`shadow.seed` (its own plants, as a new user's registry would meet: below)
and what the flags below change (said in the output): `--steps` (training budget),
`--falsify-candidates` (candidates of the falsification search each night),
`--latency-us` (the latency limit, which on a loaded shared machine measures
the machine rather than the policy).
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

import yaml

from flows.server import ephemeral_server, prefect_defaults

JUDGE_SEED = 500_000  # far from shadow.seed and every training seed: episodes the gate never saw
NIGHT_2_SEED_OFFSET = 1000
# Each run is a new user: its registry starts empty, so its night 1 would start at the config's shadow.seed like
# every other run's, and the runs' first nights would all decide on one set of plants. Run r's shadow.seed is
# SHADOW_SEED_BASE + SHADOW_SEED_STEP * r instead (r = its night-1 train seed), a block of its own below the judge's.
SHADOW_SEED_BASE = 10_000
SHADOW_SEED_STEP = 100
REGATE_SEED_BASE = 200_000  # --regate's plants: below the judge's, above every run's shadow block
# Each --regate invocation (one --seed0) decides on a block of its own, one gate budget of seeds per bundle in it:
# blocks of 1000 overlapped once an invocation held more than 3 bundles of 320 episodes.
REGATE_RUN_STRIDE = 20_000


def _night_config(
    config: Path, out: Path, seed: int, shadow_seed: int, falsify_candidates: int | None, latency_us: float | None
) -> Path:
    doc = yaml.safe_load(config.read_text())
    doc.setdefault("train", {})["seed"] = seed
    doc.setdefault("shadow", {})["seed"] = shadow_seed
    if falsify_candidates is not None:
        doc.setdefault("falsify", {})["candidates"] = falsify_candidates
    if latency_us is not None:
        doc.setdefault("gate", {})["max_latency_p99_us"] = latency_us
    if isinstance(doc.get("plant"), dict) and isinstance(doc["plant"].get("mjcf"), str):
        doc["plant"]["mjcf"] = str((config.parent / doc["plant"]["mjcf"]).resolve())
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def _paired(metrics: dict, reference: str, gate) -> dict | None:
    """The paired difference (candidate - reference) the gate decided on: mean and its bounds at the last look."""
    from pipeline.evaluation.gate import paired_return_bound

    b = paired_return_bound(metrics, gate, reference)
    return None if b is None else b.as_dict()


def one_night(
    config: Path,
    models: Path,
    runs: Path,
    seed: int,
    shadow_seed: int,
    steps: int | None,
    falsify_candidates: int | None,
    latency_us: float | None,
) -> dict:
    """One retrain flow (train, export, falsify, shadow beside legacy and production, gate, register, promote)."""
    from flows.retrain import retrain
    from pipeline.config import load_config
    from pipeline.deployment.registry import Registry

    cfg_path = _night_config(config, runs / f"night-{seed}.yaml", seed, shadow_seed, falsify_candidates, latency_us)
    cfg = load_config(cfg_path)
    task = cfg.task.name
    before = set(Registry(models).versions(task))
    start = time.perf_counter()
    state = retrain(
        config_path=str(cfg_path), models_root=str(models), runs_dir=str(runs), steps=steps, return_state=True
    )
    wall = time.perf_counter() - start
    if not state.is_completed():  # fail or inconclusive: read back what the flow registered
        registry = Registry(models)
        version = max(set(registry.versions(task)) - before, default=None)  # None: it failed before registering
        manifest = registry.show(task, version) if version is not None else {"metrics": {}}
        gate = manifest["metrics"].get("gate", {})
        metrics = manifest["metrics"].get("shadow", {})
        summary = {
            "decision": gate.get("decision", "error"),
            "version": version,
            "verdict": gate.get("verdict"),
            "reasons": gate.get("reasons", [str(state.message)]),
            "production": registry.production(task),
            "previous_production": gate.get("against_production"),
        }
    else:
        summary = state.result()
        metrics = Registry(models).show(summary["task"], summary["version"])["metrics"]["shadow"]
    return {
        "seed": seed,
        "decision": summary["decision"],
        "version": summary["version"],
        "verdict": summary.get("verdict"),
        "production_after": summary["production"],
        "production_before": summary.get("previous_production"),
        "vs_legacy": _paired(metrics, "legacy", cfg.gate),
        "vs_production": _paired(metrics, "production", cfg.gate),
        "episodes": len(metrics.get("candidate_returns") or []),
        # episodes only the candidate lost, only legacy lost, and how many of the candidate's the shield held
        "lost_vs_legacy": metrics.get("failures_vs_legacy"),
        "first_seed": (metrics.get("seeds") or [None])[0],
        "decision_wall_s": metrics.get("evaluation_wall_s"),
        "flow_wall_s": wall,
    }


def _lost_words(lost: dict | None) -> str:
    """'lost 13 vs 2 (12 held by the shield)  ': the paired lost episodes of a night, or '' without them."""
    if not lost:
        return ""
    held = lost.get("candidate_only_held")
    held = "" if held is None else f" ({held} held by the shield)"
    return f"lost {lost['candidate_only']} vs {lost['legacy_only']}{held}  "


def judge(config: Path, models: Path, version: int, replaced: int | None, episodes: int) -> dict:
    """A promoted version on fresh reality episodes, paired with legacy and with the version it replaced."""
    import numpy as np

    from pipeline.config import load_config
    from pipeline.deployment.registry import Registry
    from pipeline.evaluation.shadow import evaluate_candidate
    from shield.runtime import EdgeRuntime

    cfg = load_config(config)
    registry = Registry(models)
    runtime = EdgeRuntime.load(registry.bundle_dir(cfg.task.name, version))
    production = EdgeRuntime.load(registry.bundle_dir(cfg.task.name, replaced)) if replaced is not None else None
    _, _, m = evaluate_candidate(
        runtime, cfg, domains="reality", episodes=episodes, seed=JUDGE_SEED, production=production
    )
    out = {"version": version, "replaced": replaced, "episodes": episodes}
    # Episodes the task ended early (a dropped pole, a crash), per policy: the rare loss a 20-40 episode gate
    # sample may not show.
    out["lost"] = {
        who: m[f"{who}_failures"]["k"] for who in ("candidate", "legacy", "production") if m.get(f"{who}_failures")
    }
    for ref in ("legacy", "production"):
        if m.get(f"{ref}_returns"):
            d = np.asarray(m["candidate_returns"]) - np.asarray(m[f"{ref}_returns"])
            half = 1.96 * d.std(ddof=1) / np.sqrt(d.size)
            out[f"vs_{ref}"] = {
                "mean": float(d.mean()),
                "ci95": [float(d.mean() - half), float(d.mean() + half)],
                "worse": bool(d.mean() + half < 0),
                "mean_below_zero": bool(d.mean() < 0),
            }
    return out


def regate(cfg, bundles: list[Path], seed0: int) -> list[dict]:
    """Candidates registered by an earlier run, decided again by the gate as the config `cfg` (loaded) now ships it
    (no production: each against legacy alone), each on plants of its own: what the gate as it is now would have
    said of them."""
    from pipeline.evaluation.gate import decide
    from pipeline.evaluation.shadow import evaluate_candidate
    from shield.runtime import EdgeRuntime

    out = []
    for i, bundle in enumerate(bundles):
        _, _, m = evaluate_candidate(
            EdgeRuntime.load(bundle), cfg, seed=seed0 + i * cfg.gate.max_episodes, sequential=True
        )
        decision = decide(m, cfg.gate)
        lost = m.get("failures_vs_legacy") or {}
        out.append(
            {
                "bundle": str(bundle),
                "decision": decision.decision,
                "episodes": len(m["candidate_returns"]),
                "looks": m["looks"],
                "vs_legacy": _paired(m, "legacy", cfg.gate),
                "lost_candidate_only": lost.get("candidate_only"),
                "lost_legacy_only": lost.get("legacy_only"),
                "decision_wall_s": m["evaluation_wall_s"],
                "reasons": [r for r in decision.reasons if not r.startswith("PASS ")],
            }
        )
    return out


def _figure(value: float | None, spec: str) -> str:
    """A summary figure for the line printed: formatted, or n/a where no night gave one."""
    return "n/a" if value is None else format(value, spec)


def summarize(plant: str, nights: list[dict], judged: list[dict]) -> dict:
    count = {k: sum(n["decision"] == k for n in nights) for k in ("pass", "kept", "inconclusive", "fail")}
    diffs = [n["vs_legacy"]["mean"] for n in nights if n["vs_legacy"]]
    walls = [n["decision_wall_s"] for n in nights if n["decision_wall_s"]]
    eps = [n["episodes"] for n in nights if n["episodes"]]
    return {
        "config": plant,
        "nights": len(nights),
        "promotions": count["pass"],
        "kept_production": count["kept"],
        "inconclusive": count["inconclusive"],
        "failed": count["fail"],
        "mean_paired_diff_vs_legacy": statistics.mean(diffs) if diffs else None,
        "paired_episodes_median": statistics.median(eps) if eps else None,
        "decision_wall_s_median": statistics.median(walls) if walls else None,
        "decision_wall_s_max": max(walls) if walls else None,
        "judged": len(judged),
        "promotions_worse_than_legacy": sum(j.get("vs_legacy", {}).get("worse", False) for j in judged),
        "promotions_worse_than_production": sum(j.get("vs_production", {}).get("worse", False) for j in judged),
        "promotions_below_legacy_point_estimate": sum(
            j.get("vs_legacy", {}).get("mean_below_zero", False) for j in judged
        ),
        # How often the fresh episodes' mean gain over legacy fell below the lower bound the gate promoted on: a
        # gate whose bounds hold does this in about 1 - confidence of its promotions.
        "judged_episodes_lost": {
            who: sum(j.get("lost", {}).get(who, 0) for j in judged) for who in ("candidate", "legacy", "production")
        },
        "judged_mean_below_gate_lower_bound": sum(
            bool(j.get("gate_vs_legacy")) and j["vs_legacy"]["mean"] < j["gate_vs_legacy"]["lower"] for j in judged
        ),
        "load_avg_1min": os.getloadavg()[0],
        "cpus": os.cpu_count(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", help="a plant's config (repeat; default: every shipped one)")
    parser.add_argument("--runs", type=int, default=20, help="fresh two-night runs per plant")
    parser.add_argument("--seed0", type=int, default=100, help="train.seed of the first run's night 1 (then +1)")
    parser.add_argument("--steps", type=int, default=None, help="training env steps per night (default: the config's)")
    parser.add_argument(
        "--falsify-candidates", type=int, default=None, help="falsify.candidates per night (the search's count)"
    )
    parser.add_argument(
        "--latency-us",
        type=float,
        default=None,
        help="gate.max_latency_p99_us: the latency check measures the machine as much as the policy; "
        "on a loaded shared box it fails on preemption alone",
    )
    parser.add_argument("--judge-episodes", type=int, default=200, help="fresh reality episodes per promotion")
    parser.add_argument("--out", default=None, help="keep registries, runs and reports here (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument(
        "--regate",
        nargs="+",
        type=Path,
        default=None,
        help="bundle directories registered by an earlier run (models/<task>/<version>): decide them again with "
        "the gate as --config ships it, each on plants of its own (a block of seeds per --seed0), and train nothing",
    )
    args = parser.parse_args(argv)
    from pipeline.evaluation.gate import format_bound

    if args.regate:
        if not args.config or len(args.config) != 1:
            parser.error("--regate needs exactly one --config (the gate to decide with)")
        from pipeline.config import load_config

        cfg = load_config(args.config[0])
        budget = cfg.gate.max_episodes
        first = REGATE_SEED_BASE + REGATE_RUN_STRIDE * args.seed0
        if len(args.regate) * budget > REGATE_RUN_STRIDE or first + REGATE_RUN_STRIDE > JUDGE_SEED or args.seed0 < 0:
            parser.error(
                f"--regate: {len(args.regate)} bundles of {budget} episodes from --seed0 {args.seed0} do not fit a "
                f"block of {REGATE_RUN_STRIDE} seeds below the judge's ({JUDGE_SEED}): fewer bundles, or a --seed0 "
                f"from 0 to {(JUDGE_SEED - REGATE_SEED_BASE) // REGATE_RUN_STRIDE - 1}"
            )
        out = regate(cfg, args.regate, first)
        for r in out:
            v = r["vs_legacy"]
            print(
                f"{r['bundle']}: {r['decision'].upper():12} n={r['episodes']} ({r['looks']} looks), lost "
                f"{r['lost_candidate_only']} only by the candidate, {r['lost_legacy_only']} only by legacy; vs legacy "
                f"{format_bound(v)}; {r['decision_wall_s']:.0f} s",
                file=sys.stderr if args.json else sys.stdout,
                flush=True,
            )
        counts = {k: sum(r["decision"] == k for r in out) for k in ("pass", "inconclusive", "fail")}
        print(json.dumps({"regate": out, "decisions": counts}) if args.json else f"decisions: {counts}")
        return 0
    prefect_defaults()
    if args.config:
        configs = [Path(c) for c in args.config]
    else:  # every registered task's config (no file here names a plant: a plant is its YAML)
        import envs.registry

        configs = [Path(t.config_path) for t in envs.registry.all_tasks()]
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="sim2real-bench-gate-"))
    log = sys.stderr if args.json else sys.stdout
    changed = {
        k: v
        for k, v in (
            ("steps", args.steps),
            ("falsify.candidates", args.falsify_candidates),
            ("gate.max_latency_p99_us", args.latency_us),
        )
        if v is not None
    }
    if SHADOW_SEED_BASE + SHADOW_SEED_STEP * (args.seed0 + args.runs) > JUDGE_SEED:
        parser.error(f"--seed0 {args.seed0} with --runs {args.runs}: the runs' gate seeds would reach the judge's")
    ephemeral_server()  # stopped with this bench, even one killed with SIGKILL
    print(
        f"changed from the shipped configs: {changed or 'nothing'}; shadow.seed {SHADOW_SEED_BASE} + "
        f"{SHADOW_SEED_STEP} x the run's night-1 train seed (each run a new user with plants of its own); judged "
        f"on {args.judge_episodes} fresh episodes",
        file=log,
        flush=True,
    )
    results = []
    for config in configs:
        nights, judged = [], []
        for k in range(args.runs):
            run = work / f"{config.stem}-{k}"
            models, runs = run / "models", run / "runs"
            runs.mkdir(parents=True, exist_ok=True)
            shadow_seed = SHADOW_SEED_BASE + SHADOW_SEED_STEP * (args.seed0 + k)
            for night, seed in enumerate((args.seed0 + k, args.seed0 + k + NIGHT_2_SEED_OFFSET), start=1):
                n = one_night(
                    config, models, runs, seed, shadow_seed, args.steps, args.falsify_candidates, args.latency_us
                )
                n.update(run=k, night=night)
                nights.append(n)
                print(
                    f"{config.stem} run {k} night {night} (seed {seed}): {n['decision'].upper():12} "
                    f"vs legacy {format_bound(n['vs_legacy'])}  vs production {format_bound(n['vs_production'])}  "
                    f"{_lost_words(n['lost_vs_legacy'])}decision {n['decision_wall_s'] or 0:.0f} s, flow "
                    f"{n['flow_wall_s']:.0f} s  "
                    f"| {n['verdict']}",
                    file=log,
                    flush=True,
                )
                if n["decision"] == "pass":
                    j = judge(config, models, n["version"], n["production_before"], args.judge_episodes)
                    j["gate_vs_legacy"] = n["vs_legacy"]
                    judged.append(j)
                    print(
                        f"    judged v{j['version']} on {j['episodes']} fresh episodes (lost: {j['lost']}): "
                        + "; ".join(
                            f"{ref} {j[ref]['mean']:+.2f} [{j[ref]['ci95'][0]:+.2f}, {j[ref]['ci95'][1]:+.2f}]"
                            for ref in ("vs_legacy", "vs_production")
                            if ref in j
                        ),
                        file=log,
                        flush=True,
                    )
        summary = summarize(str(config), nights, judged)
        results.append({"summary": summary, "nights": nights, "judged": judged})
        s = summary
        print(
            f"{s['config']}: {s['nights']} nights: {s['promotions']} promoted, {s['kept_production']} kept "
            f"production, {s['inconclusive']} inconclusive, {s['failed']} failed; mean paired difference vs legacy "
            f"{_figure(s['mean_paired_diff_vs_legacy'], '+.2f')}; paired episodes median "
            f"{_figure(s['paired_episodes_median'], 'g')}; decision wall median "
            f"{_figure(s['decision_wall_s_median'], '.1f')} s; judged {s['judged']}: worse than legacy "
            f"{s['promotions_worse_than_legacy']}, worse than production {s['promotions_worse_than_production']} "
            f"(below legacy by point estimate {s['promotions_below_legacy_point_estimate']}; fresh mean below the "
            f"gate's lower bound {s['judged_mean_below_gate_lower_bound']}; episodes lost {s['judged_episodes_lost']}) "
            f"(load {s['load_avg_1min']:.1f} on {s['cpus']} CPUs)",
            file=log,
            flush=True,
        )
    if args.json:
        print(json.dumps({"changed": changed, "results": results}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
