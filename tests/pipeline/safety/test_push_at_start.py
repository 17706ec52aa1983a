"""A push the config declares, landing in an episode's first steps, is inside the envelope: the monitor stays silent.

helper-46's mast on a cart (a tip mass on an unactuated, spring-held hinge; a declared 5 N push on it for 5 steps):
a push in the first steps of an episode raised the monitor's flag, and the predictive filter's conservative mode,
latched until the episode's reset, answered with the fallback for the rest of it (395 of 400 steps, the cart parked
while its set-point moved; 10 % of all legacy steps on `reality`). The monitor's window was still filling: the
push was all it held, and the measured `accel` covers a push spread over a whole window. The spec's
`monitor.push_impulse` (one push's speed) is now allowed in a filling window in proportion to what it lacks.
"""

from __future__ import annotations

import copy
import functools
import itertools
from pathlib import Path

import numpy as np

PLANT = Path(__file__).parent / "plants" / "mast_cart.yaml"
STEPS = 120


@functools.cache
def _mast_cart():
    from pipeline.config import load_config
    from pipeline.evaluation.monitor_bounds import bundle_spec

    cfg = load_config(PLANT)
    return cfg, bundle_spec(cfg)


def _flagged_runs(spec: dict) -> list[tuple]:
    """(mast mass, latency, push sign, push start) of the runs whose monitor flagged: the legacy controller through
    the shield on reality's corners, pushed once at full declared force on the mast, at or near the episode's start."""
    import mujoco

    from envs.randomization import parse_randomization
    from pipeline.evaluation.adversary import reference_policy
    from pipeline.evaluation.episodes import make_env
    from pipeline.evaluation.falsify import parameters, pinned_domain
    from shield.cbf import CbfShield

    cfg, _ = _mast_cart()
    reality = cfg.randomization["reality"]
    push = reality.push
    names = [name for name, _, _ in parameters(reality)]
    flagged = []
    for mass, latency, sign, start in itertools.product((0.0, 1.0), (0.0, 1.0), (-1.0, 1.0), (0, 3)):
        x = np.full(len(names), 0.5)
        x[names.index("body_mass.mast")], x[names.index("latency_steps")] = mass, latency
        doc = pinned_domain(reality, x)
        doc.pop("push")  # the one push is applied below, where it is wanted
        env = make_env(cfg, parse_randomization(doc), STEPS)
        shield = CbfShield(spec)
        legacy = reference_policy("legacy", cfg, shield.spec, seed=0)
        data = env.unwrapped.data
        body = mujoco.mj_name2id(env.unwrapped.model, mujoco.mjtObj.mjOBJ_BODY, push.body)
        obs, _ = env.reset(seed=int(mass * 10 + latency))
        shield.reset()
        legacy.reset()
        for t in range(STEPS):
            data.xfrc_applied[body, 0] = sign * push.max_force if start <= t < start + push.duration_steps else 0.0
            u, info = shield.filter(obs, legacy(np.asarray(obs, np.float32)[None])[0])
            if info["envelope"]:
                flagged.append((mass, latency, sign, start))
                break
            obs, _, terminated, truncated, _ = env.step(u)
            if terminated or truncated:
                break
        env.close()
    return flagged


def test_a_declared_push_in_an_episodes_first_steps_is_not_flagged():
    _, spec = _mast_cart()
    impulse = spec["assumptions"]["monitor"]["push_impulse"]
    assert len(impulse) == 2 and impulse[1] > 0.0  # the push moves the mast's tilt: its speed is allowed there
    assert _flagged_runs(spec) == []


def test_without_the_push_allowance_the_same_pushes_are_flagged():
    """The check above has teeth: the same measured bounds without the push's speed flag some of these runs."""
    _, spec = _mast_cart()
    bare = copy.deepcopy(spec)
    del bare["assumptions"]["monitor"]["push_impulse"]
    assert _flagged_runs(bare)
