"""Outside its envelope, a braking-barrier shield is no worse than the legacy controller alone.

An outside user's gravity-loaded lift arm (`plants/lift_arm.xml`: motor 25 N m, payload 2 kg on a 0.5 m link,
band 0.8..1.5 rad, speed within 1.5 rad/s) and the braking-barrier shield synthesis gave it for payload 0.4..1.5x
(`plants/lift_arm_barrier_shield.json`, latency 2 steps, input gain 0.70..1.56). Its controller: a PD with the
nominal gravity feed-forward. The plant here is past the envelope (payload 1.95x, motor 0.8x): the PD alone keeps
the arm inside its band, barely, and the monitor flags the plant. The shield in its conservative mode must then
neither cross a limit the PD alone does not nor answer the sinking arm with torque down. It did both while the far
end of the speed box capped braking (h(x+) >= (1 - gain) h(x_L) on the upper speed row of an arm falling at
1.1 rad/s): the fall was braked late, the arm sank below its band, and full torque down followed on speeds predicted
under the strongest input gain, a plant it was not (14 violating steps where the PD alone had 0).
"""

from __future__ import annotations

import json
from pathlib import Path

import mujoco
import numpy as np
import pytest

from shield.cbf import CbfShield

PLANTS = Path(__file__).parent / "plants"
LOW, HIGH, SPEED = 0.8, 1.5, 1.5
STEPS = 300  # 6 s at 50 Hz
LATENCY = 2  # the plant's, as the spec says


def _pd(q: float, dq: float, ref: float) -> float:
    """The arm's legacy controller: PD on the set-point with the nominal gravity torque fed forward."""
    return float(np.clip((12.2625 * np.sin(q) + 40.0 * (ref - q) - 8.0 * dq) / 25.0, -1.0, 1.0))


def _run(payload: float, motor: float, q0: float, ref: float, shield: CbfShield | None) -> dict:
    model = mujoco.MjModel.from_xml_path(str(PLANTS / "lift_arm.xml"))
    body = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, "payload")
    model.body_mass[body] *= payload
    model.body_inertia[body] *= payload
    model.actuator_gainprm[0, 0] *= motor
    data = mujoco.MjData(model)
    data.qpos[0] = q0
    mujoco.mj_forward(model, data)
    pending = [0.457] * LATENCY  # the spec's fallback: the nominal gravity hold
    out = {"violations": 0, "flagged": 0, "down_below_band": 0}
    if shield is not None:
        shield.reset()
    for _ in range(STEPS):
        q, dq = float(data.qpos[0]), float(data.qvel[0])
        u = _pd(q, dq, ref)
        if shield is not None:
            sent, info = shield.filter(np.array([q, dq, ref], np.float32), np.array([u], np.float32))
            out["flagged"] += bool(info["envelope"])
            # Torque down while the arm is under its band and gravity already pulls it further out.
            out["down_below_band"] += bool(q < LOW and sent[0] < u and sent[0] < 0.0)
            u = float(sent[0])
        pending.append(u)
        data.ctrl[0] = pending.pop(0)
        for _ in range(4):  # 4 x 5 ms physics steps per 20 ms control period
            mujoco.mj_step(model, data)
        q, dq = float(data.qpos[0]), float(data.qvel[0])
        out["violations"] += not (LOW <= q <= HIGH and abs(dq) <= SPEED)
    return out


@pytest.fixture(scope="module")
def shield() -> CbfShield:
    return CbfShield(json.loads((PLANTS / "lift_arm_barrier_shield.json").read_text()))


@pytest.mark.parametrize("q0, ref", [(1.2, 1.2), (1.3, 1.1), (1.1, 1.2), (1.4, 1.25)])
def test_flagged_barrier_shield_is_no_worse_than_the_legacy_controller_alone(shield, q0, ref):
    alone = _run(1.95, 0.8, q0, ref, None)
    shielded = _run(1.95, 0.8, q0, ref, shield)
    assert shielded["flagged"] > STEPS // 2, shielded  # the plant is outside: the conservative mode is what runs
    assert shielded["violations"] <= alone["violations"], (alone, shielded)
    assert shielded["down_below_band"] == 0, shielded


def test_inside_the_envelope_the_shield_keeps_the_band(shield):
    """The same arm at the envelope's heaviest payload (1.5x), nominal motor: not flagged, and kept in bounds."""
    shielded = _run(1.5, 1.0, 1.2, 1.2, shield)
    assert shielded["violations"] == 0, shielded
