"""Shield synthesis per plant: wall time, the measured bounds, and what each hand-set number is held to.

For every config given (default: the shipped plants with a linear shield model and the crane), runs
`pipeline.safety.synthesis.measure` and reports its wall time beside the hand-set spec build's (the baseline,
same run), the measured braking authority, model-error bounds (constant and state-dependent law), input-gain
range and push accelerations, the numbers synthesis derives, and which hand-set numbers the measurement does
not cover. A figure, never pass/fail.

    python bench/bench_synthesis.py [--configs configs/crane.yaml ...] [--samples 4000] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench(path: str, samples: int | None) -> dict:
    from pipeline.config import load_config
    from pipeline.safety import synthesis
    from pipeline.safety.shield_spec import (
        EnvelopeError,
        build_shield_spec,
        needs_synthesis,
    )

    cfg = load_config(ROOT / path if not Path(path).is_absolute() else path)
    row = {"config": path, "task": cfg.task.name}
    t0 = time.perf_counter()
    if not needs_synthesis(cfg.shield):
        build_shield_spec(cfg)
        row["hand_set_build_s"] = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        meas = synthesis.measure(cfg, samples=samples)
        row["synthesis_s"] = time.perf_counter() - t0
    except synthesis.SynthesisError as err:
        row["synthesis"] = f"not measured: {err}"
        return row
    row.update(
        {
            "samples": meas.samples,
            "plants": meas.domains,
            "names": meas.names,
            "authority": meas.authority,
            "residual_accel": meas.residual_accel,
            "residual_law": meas.residual_law,
            "residual_position": meas.residual_pos,
            "input_gain_range": meas.gain_range,
            "push_accel": meas.push_accel,
            "derived": synthesis.derived_numbers(meas),
            "cannot_brake": [reason for _, _, reason in synthesis.authority_problems(meas)],
        }
    )
    try:
        spec = build_shield_spec(cfg, measurement=meas)
        row["overrides_not_covered"] = synthesis.override_problems(cfg, meas, spec)
    except EnvelopeError as err:
        row["refused"] = str(err)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=None, help="task YAMLs (default: every registered task's)")
    p.add_argument(
        "--samples", type=int, help="residual samples per set (default: each config's shield.synthesis_samples)"
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.configs is None:
        import envs.registry

        args.configs = [str(t.config_path) for t in envs.registry.all_tasks()]
    rows = [bench(c, args.samples) for c in args.configs]
    if args.json:
        print(json.dumps(rows, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))
        return 0
    for r in rows:
        print(f"== {r['task']} ({r['config']})")
        if "synthesis_s" not in r:
            print(f"  {r['synthesis']}")
            continue
        base = r.get("hand_set_build_s")
        ratio = f", {r['synthesis_s'] / base:.1f}x the hand-set spec build ({base:.2f} s)" if base else ""
        print(f"  synthesis {r['synthesis_s']:.1f} s{ratio}: {r['samples']} residual samples on {r['plants']} plants")
        for k, name in enumerate(r["names"]):
            lo, hi = r["input_gain_range"][k]
            law = r["residual_law"][k]
            print(
                f"  {name:>10}: braking {r['authority'][k][0]:8.3f} / {r['authority'][k][1]:8.3f}   model error "
                f"{r['residual_accel'][k]:8.3f} (law {law['accel']:g} + {law['per_unit']:g} {law['feature']})   "
                f"latency pos error {r['residual_position'][k]:.4f}   gain {lo:.3f} .. {hi:.3f}"
            )
        print(f"  push accel per set: {r['push_accel']}")
        print(f"  derived: {r['derived']}")
        for line in r.get("cannot_brake", []):
            print(f"  CANNOT BRAKE: {line}")
        for line in r.get("overrides_not_covered", []):
            print(f"  NOT COVERED: {line}")
        if "refused" in r:
            print(f"  REFUSED: {r['refused']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
