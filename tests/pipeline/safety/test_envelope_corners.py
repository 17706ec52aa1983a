"""Every corner of each shipped config's envelope, shielded, with the adversarial and random policies: 0 violations.

The envelope is the hull of the config's randomization sets (`falsify.envelope_set`):
each corner pins every range (masses, gains, damping, latency) to one end, with the
widest noise and push of any set. Per corner 20 episodes (10 adversarial, 10 random; the arm's 256 corners 8),
long enough for the adversary to reach a boundary from any start (unshielded it
violates within ~1.3 s), so every corner is run within the CI budget; the bench
(bench/bench_safety.py) runs thousands of full-length episodes per task.
The config refuses plants outside the envelope (tests/test_envelope_check.py).
"""

from __future__ import annotations

import pytest

from envs.randomization import parse_randomization
from pipeline.config import load_config
from pipeline.evaluation.adversary import reference_policy
from pipeline.evaluation.evaluate import evaluate
from pipeline.evaluation.falsify import corner_domains, envelope_set
from pipeline.safety.shield_spec import build_shield_spec
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
            result = evaluate(
                cfg,
                reference_policy(name, cfg, spec, seed=i),
                domains=parse_randomization(domain),
                episodes=episodes,
                seed=1000 * i,
                shield=True,
                spec=spec,
                max_episode_steps=EPISODE_STEPS[task],
            )
            if result["violations"]:
                bad.append((i, name, result["violations"], domain))
    assert not bad, bad


BANG_BANG = {"cartpole": (2, 500), "quadrotor": (2, 1000), "arm": (1, 300)}  # (episodes per corner, steps)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["cartpole", "quadrotor", "arm"])
def test_every_corner_stays_safe_under_bang_bang_set_points(task):
    """Each action flipping between its bounds at its own period, full-length episodes: the pattern that took the
    quadrotor out of its fence on 33 of 200 corner episodes while its inner loop overshot the shield's lag model
    (tests/test_known_gaps.py). The adversary drives one way and the random policy averages to zero: neither
    found it."""
    cfg = load_config(f"configs/{task}.yaml")
    spec = ShieldSpec.from_dict(build_shield_spec(cfg))
    episodes, steps = BANG_BANG[task]
    bad = []
    for i, domain in enumerate(corner_domains(envelope_set(cfg))):
        result = evaluate(
            cfg,
            reference_policy("bang_bang", cfg, spec, seed=i),
            domains=parse_randomization(domain),
            episodes=episodes,
            seed=1000 * i,
            shield=True,
            spec=spec,
            max_episode_steps=steps,
        )
        if result["violations"]:
            bad.append((i, result["violations"], domain))
    assert not bad, bad


@pytest.mark.slow
def test_every_cartpole_corner_keeps_the_cart_in_its_band_after_the_pole_falls():
    """The env ends an episode when the pole passes 0.6 rad; a real cart-pole goes on, and nothing ends the
    shield's job there. Every corner, full-length episodes stepped on past the fall (`past_termination`),
    bang-bang and adversary: the pole falls and swings or spins round, and the cart stays on its band. Before the
    shield read the pole angle wrapped (`ShieldSpec.angles`), 6 of these 128 episodes left the band (3 bang-bang,
    3 adversary; the reproducer: tests/test_known_gaps.py)."""
    cfg = load_config("configs/cartpole.yaml")
    spec = ShieldSpec.from_dict(build_shield_spec(cfg))
    bad = []
    for i, domain in enumerate(corner_domains(envelope_set(cfg))):
        for name in ("bang_bang", "adversarial"):
            result = evaluate(
                cfg,
                reference_policy(name, cfg, spec, seed=i),
                domains=parse_randomization(domain),
                episodes=1,
                seed=1000 * i,
                shield=True,
                spec=spec,
                past_termination=True,
            )
            assert result["steps"] == 500  # on to the episode's length
            if result["violations"]:
                bad.append((i, name, result["violations"]))
    assert not bad, bad
