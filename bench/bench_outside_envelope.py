"""Outside the envelope: the legacy controller alone against the same controller through the shield.

The plant is an outside user's gravity-loaded lift arm with the braking-barrier shield synthesis gave it for a
payload of 0.4..1.5x (`tests/shield/plants/`); here the payload and the motor go past that envelope, and each
episode starts from a grid of angles and set-points. The baseline (the controller alone) runs in the same process
on the same plants. Prints, per plant and in total: violating steps alone and shielded, the runs where the shield
made things worse, and the share of steps the monitor flagged.

    python bench/bench_outside_envelope.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the plant and its runner live with the tests

from shield.cbf import CbfShield  # noqa: E402
from tests.shield.test_shield_conservative_barrier import PLANTS, STEPS, _run  # noqa: E402

PLANTS_OUTSIDE = [(1.6, 0.9), (1.7, 0.75), (1.8, 0.8), (1.95, 0.8), (2.0, 0.85)]  # (payload, motor) x nominal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=float, nargs="+", default=[1.0, 1.2, 1.4], help="initial angles, rad")
    parser.add_argument("--setpoints", type=float, nargs="+", default=[1.0, 1.2, 1.35], help="set-points, rad")
    args = parser.parse_args()
    shield = CbfShield(json.loads((PLANTS / "lift_arm_barrier_shield.json").read_text()))
    total = {"runs": 0, "alone": 0, "shielded": 0, "worse": 0, "flagged": 0}
    print(f"{'payload':>7} {'motor':>5} {'runs':>4} {'alone':>6} {'shielded':>8} {'worse':>5} {'flagged':>7}")
    for payload, motor in PLANTS_OUTSIDE:
        row = dict.fromkeys(total, 0)
        for q0, ref in itertools.product(args.starts, args.setpoints):
            alone = _run(payload, motor, q0, ref, None)
            shielded = _run(payload, motor, q0, ref, shield)
            row["runs"] += 1
            row["alone"] += alone["violations"]
            row["shielded"] += shielded["violations"]
            row["worse"] += shielded["violations"] > alone["violations"]
            row["flagged"] += shielded["flagged"]
        for key in total:
            total[key] += row[key]
        flagged = row["flagged"] / (row["runs"] * STEPS)
        print(
            f"{payload:7.2f} {motor:5.2f} {row['runs']:4d} {row['alone']:6d} {row['shielded']:8d} "
            f"{row['worse']:5d} {flagged:7.1%}"
        )
    print(
        f"total: {total['runs']} runs of {STEPS} steps; violating steps {total['alone']} alone, {total['shielded']} "
        f"shielded; shield worse than the controller alone in {total['worse']} runs"
    )


if __name__ == "__main__":
    main()
