"""Every corner of each shipped config's envelope, shielded, with the adversarial and random policies: 0 violations.

The envelope is the hull of the config's randomization sets (`falsify.envelope_set`):
each corner pins every range (masses, gains, damping, latency) to one end, with the
widest noise and push of any set. Per corner 20 episodes (10 adversarial, 10 random; the arm's 256 corners 8),
long enough for the adversary to reach a boundary from any start (unshielded it
violates within ~1.3 s), so every corner is run within the CI budget; the bench
(bench/bench_safety.py) runs thousands of full-length episodes per task.
The config refuses plants outside the envelope (tests/pipeline/safety/test_envelope_check.py).
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
from tests.helpers.parallel import map_in_processes, process_pool

_CONFIGS: dict = {}
_SPECS: dict = {}


def _config(task: str):
    """The shipped config, loaded once per process (the test's, or a pool worker's)."""
    if task not in _CONFIGS:
        _CONFIGS[task] = load_config(f"configs/{task}.yaml")
    return _CONFIGS[task]


def _config_and_spec(task: str):
    """The config and its shield spec as the test's process built it (synthesis takes seconds: built once)."""
    return _config(task), build_shield_spec(_config(task))


def _violations(job) -> int:
    """One corner, one reference policy: the shielded episodes' violations (the same episodes, seeds and spec as a
    loop over the corners in the test's process; `map_in_processes` only spreads the corners over the cores)."""
    task, spec_doc, i, domain, name, kwargs = job
    cfg = _config(task)
    if task not in _SPECS:
        _SPECS[task] = ShieldSpec.from_dict(spec_doc)
    spec = _SPECS[task]
    result = evaluate(
        cfg,
        reference_policy(name, cfg, spec, seed=i),
        domains=parse_randomization(domain),
        seed=1000 * i,
        shield=True,
        spec=spec,
        **kwargs,
    )
    if kwargs.get("past_termination"):
        assert result["steps"] == 500, (task, i, name, result["steps"])  # on to the episode's length
    return result["violations"]


@pytest.fixture(scope="module")
def pool():
    with process_pool() as executor:
        yield executor


EPISODES = {"adversarial": 10, "random": 10}  # per corner: 20 in all
EPISODE_STEPS = {"cartpole": 120, "quadrotor": 80, "arm": 150}
CORNERS = {"cartpole": 64, "quadrotor": 64, "arm": 256}  # the arm's 256 get 4 + 4 episodes each (CI budget)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["cartpole", "quadrotor", "arm"])
def test_every_corner_of_the_envelope_stays_safe_under_the_shield(task, pool):
    cfg, spec = _config_and_spec(task)
    corners = corner_domains(envelope_set(cfg))
    assert len(corners) == CORNERS[task]
    per_corner = EPISODES if CORNERS[task] <= 64 else {name: 4 for name in EPISODES}
    jobs = [
        (task, spec, i, domain, name, dict(episodes=episodes, max_episode_steps=EPISODE_STEPS[task]))
        for i, domain in enumerate(corners)
        for name, episodes in per_corner.items()
    ]
    assert len(jobs) == CORNERS[task] * len(EPISODES)  # every corner, each policy
    bad = [
        (i, name, v, domain)
        for (_, _, i, domain, name, _), v in zip(jobs, map_in_processes(pool, _violations, jobs))
        if v
    ]
    assert not bad, bad


BANG_BANG = {"cartpole": (2, 500), "quadrotor": (2, 1000), "arm": (1, 300)}  # (episodes per corner, steps)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["cartpole", "quadrotor", "arm"])
def test_every_corner_stays_safe_under_bang_bang_set_points(task, pool):
    """Each action flipping between its bounds at its own period, full-length episodes: the pattern that took the
    quadrotor out of its fence on 33 of 200 corner episodes while its inner loop overshot the shield's lag model
    (test_known_gaps.py, beside this file). The adversary drives one way and the random policy averages to zero: neither
    found it."""
    cfg, spec = _config_and_spec(task)
    episodes, steps = BANG_BANG[task]
    corners = corner_domains(envelope_set(cfg))
    assert len(corners) == CORNERS[task]
    jobs = [
        (task, spec, i, domain, "bang_bang", dict(episodes=episodes, max_episode_steps=steps))
        for i, domain in enumerate(corners)
    ]
    bad = [(i, v, domain) for (_, _, i, domain, _, _), v in zip(jobs, map_in_processes(pool, _violations, jobs)) if v]
    assert not bad, bad


@pytest.mark.slow
def test_every_cartpole_corner_keeps_the_cart_in_its_band_after_the_pole_falls(pool):
    """The env ends an episode when the pole passes 0.6 rad; a real cart-pole goes on, and nothing ends the
    shield's job there. Every corner, full-length episodes stepped on past the fall (`past_termination`),
    bang-bang and adversary: the pole falls and swings or spins round, and the cart stays on its band. Before the
    shield read the pole angle wrapped (`ShieldSpec.angles`), 6 of these 128 episodes left the band (3 bang-bang,
    3 adversary; the reproducer: tests/pipeline/safety/test_known_gaps.py)."""
    cfg, spec = _config_and_spec("cartpole")
    corners = corner_domains(envelope_set(cfg))
    assert len(corners) == CORNERS["cartpole"]
    jobs = [
        ("cartpole", spec, i, domain, name, dict(episodes=1, past_termination=True))
        for i, domain in enumerate(corners)
        for name in ("bang_bang", "adversarial")
    ]
    # _violations asserts each episode ran on to the episode's length (500 steps)
    bad = [(i, name, v) for (_, _, i, _, name, _), v in zip(jobs, map_in_processes(pool, _violations, jobs)) if v]
    assert not bad, bad
