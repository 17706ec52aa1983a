"""Population-based training vs independent runs: best validation return after the same wall time.

Arm "tune": `sim2real tune` with a population of N over the config's `tune.searchable` (when the config has
none: lr and entropy_coef on log ranges around the default, a perturbation every 2 reports). Arm
"independent": N `sim2real train` runs of the same config with seeds 0..N-1, started together on the same
cores and stopped at the same wall time. Both are scored the same way: the best validation return any
checkpoint reached (each run's checkpoints/best.pt; validation uses the same seeds in every run, so returns
compare).

    python bench/bench_tune.py [--config configs/cartpole.yaml] [--population 4] [--budget-s 600] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from pipeline.training.checkpoint import best_checkpoint, read_checkpoint

DEFAULT_SEARCH = {
    "lr": {"low": 1e-4, "high": 3e-3, "log": True},
    "entropy_coef": {"low": 1e-5, "high": 1e-2, "log": True},
}


def best_validation_return(run_dir: Path) -> float | None:
    path = best_checkpoint(run_dir)
    return float(read_checkpoint(path)["selection"]["validation_return"]) if path else None


def independent(config: dict, population: int, budget_s: float, work: Path) -> list[float | None]:
    """N `sim2real train` runs at once (seeds 0..N-1), each stopped at budget_s."""
    procs = []
    for seed in range(population):
        data = dict(config, train=dict(config["train"], seed=seed))
        path = work / f"seed{seed}.yaml"
        path.write_text(yaml.safe_dump(data))
        cmd = [sys.executable, "-m", "pipeline.cli", "train", "--config", str(path), "--out", str(work / f"run{seed}")]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        )
    deadline = time.monotonic() + budget_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the run checkpoints and stops its own Ray
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return [best_validation_return(work / f"run{seed}") for seed in range(population)]


def tuned(config: dict, population: int, budget_s: float, work: Path) -> dict:
    path = work / "tune.yaml"
    path.write_text(yaml.safe_dump(config))
    out = work / "tune-out"
    cmd = [sys.executable, "-m", "pipeline.cli", "tune", "--config", str(path), "--out", str(out)]
    cmd += ["--population", str(population), "--budget-s", str(budget_s), "--json"]
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return json.loads((out / "tune.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/cartpole.yaml")
    parser.add_argument("--population", type=int, default=4)
    parser.add_argument("--budget-s", type=float, default=600.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    config = yaml.safe_load(Path(args.config).read_text())
    plant = config.get("plant")
    if isinstance(plant, dict) and isinstance(plant.get("mjcf"), str):  # the copies live in a temp dir
        plant["mjcf"] = str((Path(args.config).parent / plant["mjcf"]).resolve())
    if not config.get("tune", {}).get("searchable"):
        config["tune"] = dict(config.get("tune", {}), searchable=DEFAULT_SEARCH, perturbation_interval=2)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        solo = independent(config, args.population, args.budget_s, work)
        solo_s = time.perf_counter() - start
        start = time.perf_counter()
        summary = tuned(config, args.population, args.budget_s, work)
        tune_s = time.perf_counter() - start
    solo_best = max((r for r in solo if r is not None), default=None)
    result = dict(
        config=args.config,
        population=args.population,
        budget_s=args.budget_s,
        independent_best_validation_returns=solo,
        independent_best=solo_best,
        independent_wall_s=solo_s,
        tune_best=summary["best_validation_return"],
        tune_perturbations=summary["perturbations"],
        tune_best_hyperparameters=summary["best_hyperparameters"],
        tune_wall_s=tune_s,
        ratio=(summary["best_validation_return"] / solo_best)
        if solo_best and summary["best_validation_return"] is not None
        else None,
    )
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.config}: population {args.population}, {args.budget_s:.0f} s of wall time each arm")
    print(f"  independent runs (seeds 0..{args.population - 1}): best validation returns {solo} -> {solo_best}")
    print(
        f"  sim2real tune: best validation return {summary['best_validation_return']} "
        f"({summary['perturbations']} perturbations; {summary['best_hyperparameters']})"
    )
    if result["ratio"] is not None:
        print(f"  tune / independent: {result['ratio']:.3f}")


if __name__ == "__main__":
    main()
