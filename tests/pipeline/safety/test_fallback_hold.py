"""A set-point actuator's fallback holds the last action sent (`fallback_hold`), not the constant.

helper-43's slewing jib on a position servo: the action is where the jib goes, so the constant fallback 0 is a
command to slew to the middle. Answered for three periods (a deadline overrun, a failed step), it swung the load
past its limit. Synthesis marks each `<position>` actuator's action; the shield then keeps, per plant, the last
action sent as that action's fallback, which the server sends on a failed or late step.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import numpy as np
import pytest

from shield.cbf import CbfShield
from shield.spec import ShieldSpec, ShieldSpecError

PLANT = Path(__file__).parent / "plants" / "slew_servo.yaml"
# (seed, step) of bang-bang episodes on reality where three periods of the constant fallback swing the load past its
# limit: of 10 seeds x 6 steps (40..240), these two (1 and 2 violating steps; held: 0 of all 60); and two that stay
# clean either way.
CASES = [(1, 40), (7, 200), (0, 160), (3, 40)]


@functools.cache
def _servo():
    from pipeline.config import load_config
    from pipeline.safety.shield_spec import build_shield_spec

    cfg = load_config(PLANT)
    return cfg, build_shield_spec(cfg)


def test_synthesis_marks_a_position_servo_and_leaves_a_motor_alone():
    import envs
    from pipeline.safety.shield_spec import setpoint_actions

    _, spec = _servo()
    assert spec["fallback_hold"] == [True] and spec["fallback_action"] == [0.0]
    crane = envs.nominal_model("sim2real/Crane-v0")  # a force motor's 0 lets go: the constant stays
    assert setpoint_actions(crane.model, crane.actuators, 1) == [False]
    assert ShieldSpec.from_dict(spec).to_dict()["fallback_hold"] == [True]
    with pytest.raises(ShieldSpecError, match="fallback_hold"):
        ShieldSpec.from_dict({**spec, "fallback_hold": ["yes"]})


def test_the_fallback_is_the_last_action_sent_and_the_constant_after_reset():
    """During a step the fallback is what the plant got the step before (a late step replaces this step's action,
    which never reached it); what `note_sent` says replaced an action is what is held."""
    _, spec = _servo()
    shield = CbfShield(spec)
    obs = np.zeros(shield.spec.obs_dim, np.float32)
    assert shield.fallback_action().tolist() == [0.0]
    first, _ = shield.filter(obs, np.array([0.05], np.float32))
    assert shield.fallback_action().tolist() == [0.0]  # the first step's action has not reached the plant yet
    shield.filter(obs, np.array([0.03], np.float32))
    assert shield.fallback_action().tolist() == first.tolist()
    shield.note_sent(np.array([0.04], np.float32))  # the plant got something else this step: that is what it holds
    bad, info = shield.filter(obs, np.array([np.nan], np.float32))  # a NaN action is answered around the held one
    assert shield.fallback_action().tolist() == pytest.approx([0.04])
    assert info["bad_input"] and bad.tolist() == pytest.approx([0.04], abs=1e-6)
    shield.reset()
    assert shield.fallback_action().tolist() == [0.0]


def _violations(spec: dict, seed: int, fail_at: int) -> int:
    """Violating steps of a bang-bang episode through the shield whose steps fail_at..fail_at+2 send the shield's
    fallback instead, unfiltered, as the server does on a failed or late step."""
    from pipeline.evaluation.adversary import reference_policy
    from pipeline.evaluation.evaluate import make_env

    cfg, _ = _servo()
    shield = CbfShield(spec)
    policy = reference_policy("bang_bang", cfg, shield.spec, seed=0)
    policy.seed_episode(seed)  # the episode's own pattern, as an evaluation draws it
    policy.reset()
    env = make_env(cfg, cfg.randomization["reality"], 300)
    obs, _ = env.reset(seed=seed)
    violating = 0
    for t in range(fail_at + 60):
        u, _ = shield.filter(obs, policy(np.asarray(obs, np.float32)[None])[0])
        if fail_at <= t < fail_at + 3:
            u = shield.fallback_action()
            shield.note_sent(u)
        obs, _, terminated, truncated, info = env.step(u)
        violating += info["cost"] > 0
        if terminated or truncated:
            break
    env.close()
    return violating


def test_three_failed_periods_hold_the_jib_where_the_constant_swung_its_load_past_the_limit():
    _, spec = _servo()
    constant = copy.deepcopy(spec)
    del constant["fallback_hold"]
    held = [_violations(spec, seed, at) for seed, at in CASES]
    moved = [_violations(constant, seed, at) for seed, at in CASES]
    assert sum(moved[:2]) > 0, moved  # the constant: a slew to the middle, the load past its limit
    assert held == [0, 0, 0, 0], held
