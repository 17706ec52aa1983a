"""Issue 11: every corner of each shipped config's envelope, shielded, with the adversarial and random policies: 0 violations.

The envelope is the hull of the config's randomization sets (`falsify.envelope_set`):
each corner pins every range (masses, gains, damping, latency) to one end, with the
widest noise and push of any set. Per corner 20 episodes (10 adversarial, 10 random; the arm's 256 corners 8),
long enough for the adversary to reach a boundary from any start (unshielded it
violates within ~1.3 s), so every corner is run within the CI budget; the bench
(bench/bench_safety.py) runs thousands of full-length episodes per task.
The config refuses plants outside the envelope (tests/test_envelope_check.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from envs.randomization import parse_randomization
from pipeline.config import load_config
from pipeline.evaluation.adversary import reference_policy
from pipeline.evaluation.episodes import make_env
from pipeline.evaluation.evaluate import evaluate
from pipeline.evaluation.falsify import corner_domains, envelope_set
from pipeline.safety.shield_spec import build_shield_spec
from shield.cbf import CbfShield
from shield.spec import ShieldSpec

EPISODES = {"adversarial": 10, "random": 10}  # per corner: 20 in all
EPISODE_STEPS = {"cartpole": 120, "quadrotor": 80, "arm": 150}
CORNERS = {"cartpole": 64, "quadrotor": 64, "arm": 256}  # the arm's 256 get 4 + 4 episodes each (CI budget)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["cartpole", "quadrotor", "arm"])
def test_every_corner_of_the_envelope_stays_safe_under_the_shield(task):
    cfg = load_config(f"configs/{task}.yaml")
    spec = ShieldSpec.from_dict(build_shield_spec(cfg))
    corners = corner_domains(envelope_set(cfg))
    assert len(corners) == CORNERS[task]
    per_corner = EPISODES if CORNERS[task] <= 64 else {name: 4 for name in EPISODES}
    bad = []
    for i, domain in enumerate(corners):
        for name, episodes in per_corner.items():
            result = evaluate(cfg, reference_policy(name, cfg, spec, seed=i), domains=parse_randomization(domain),
                              episodes=episodes, seed=1000 * i, shield=True, spec=spec,
                              max_episode_steps=EPISODE_STEPS[task])
            if result["violations"]:
                bad.append((i, name, result["violations"], domain))
    assert not bad, bad


BANG_BANG = {"cartpole": (2, 500), "quadrotor": (2, 1000), "arm": (1, 300)}  # (episodes per corner, steps)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["cartpole", "quadrotor", "arm"])
def test_every_corner_stays_safe_under_bang_bang_set_points(task):
    """Each action flipping between its bounds at its own period, full-length episodes: the pattern that took the
    quadrotor out of its fence on 33 of 200 corner episodes while its inner loop overshot the shield's lag model
    (tests/test_known_gaps.py). The adversary drives one way and the random policy averages to zero: neither found it."""
    cfg = load_config(f"configs/{task}.yaml")
    spec = ShieldSpec.from_dict(build_shield_spec(cfg))
    episodes, steps = BANG_BANG[task]
    bad = []
    for i, domain in enumerate(corner_domains(envelope_set(cfg))):
        result = evaluate(cfg, reference_policy("bang_bang", cfg, spec, seed=i), domains=parse_randomization(domain),
                          episodes=episodes, seed=1000 * i, shield=True, spec=spec, max_episode_steps=steps)
        if result["violations"]:
            bad.append((i, result["violations"], domain))
    assert not bad, bad


@pytest.mark.slow
def test_every_cartpole_corner_keeps_the_cart_in_its_band_after_the_pole_falls():
    """The env ends an episode when the pole passes 0.6 rad; a real cart-pole goes on, and nothing ends the
    shield's job there. Every corner, full-length episodes stepped on through the fall, bang-bang and adversary:
    the pole falls and spins round in each, and the cart stays on its band. Before the shield read the pole angle
    wrapped (`ShieldSpec.angles`), bang-bang left the band on 5 of these 64 corners and the adversary on 4."""
    cfg = load_config("configs/cartpole.yaml")
    spec = ShieldSpec.from_dict(build_shield_spec(cfg))
    bad, fallen = [], 0
    for i, domain in enumerate(corner_domains(envelope_set(cfg))):
        env = make_env(cfg, parse_randomization(domain), 10**6)
        for name in ("bang_bang", "adversarial"):
            policy, shield = reference_policy(name, cfg, spec, seed=i), CbfShield(spec)
            obs, _ = env.reset(seed=1000 * i)
            violations, turned = 0, False
            for _ in range(500):  # on through `terminated`
                action, _ = shield.filter(obs, policy(obs[None])[0])
                obs, _, _, _, info = env.step(action)
                violations += info["cost"] > 0
                turned |= abs(float(env.unwrapped.data.qpos[1])) > np.pi
            fallen += turned
            if violations:
                bad.append((i, name, violations))
        env.close()
    assert fallen >= 64, fallen  # the case this test is for: the pole went past upside down
    assert not bad, bad
