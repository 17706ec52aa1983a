"""Zero violations under the shield, on real MuJoCo plants, beside the unshielded counts.

For each task: >= 200 episodes each of the random and the adversarial policy on
the `train` and the `reality` domains (latency, noise, pushes included), with
and without the shield. The adversary must violate without the shield (so the
test is meaningful) and nothing may violate with it.
"""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from pipeline.evaluation.evaluate import evaluate, reference_policy
from pipeline.safety.shield_spec import build_shield_spec
from shield.spec import ShieldSpec

EPISODES = 200  # shielded, per policy and domain set
UNSHIELDED_EPISODES = 50  # the baseline only needs to show that the policies do violate
# Long enough for the adversary to reach a boundary from any start (unshielded, it
# violates within ~1.3 s on both tasks); the random walk gets there less often.
EPISODE_STEPS = {"cartpole": 120, "quadrotor": 80, "arm": 150}


@pytest.mark.slow
@pytest.mark.parametrize("task", ["cartpole", "quadrotor", "arm"])
@pytest.mark.parametrize("domains", ["train", "reality"])
def test_shield_keeps_random_and_adversarial_policies_safe(task, domains):
    cfg = load_config(f"configs/{task}.yaml")
    spec = ShieldSpec.from_dict(build_shield_spec(cfg))
    counts = {}
    for name in ("random", "adversarial"):
        for shield in (False, True):
            result = evaluate(
                cfg,
                reference_policy(name, cfg, spec, seed=1),
                domains=domains,
                episodes=EPISODES if shield else UNSHIELDED_EPISODES,
                seed=10_000,
                shield=shield,
                spec=spec,
                max_episode_steps=EPISODE_STEPS[task],
            )
            counts[(name, shield)] = (result["violations"], result["violation_episodes"], result["fallbacks"])
    print(task, domains, counts)  # unshielded counts are part of the record (pytest -s shows them)
    assert counts[("adversarial", False)][1] >= UNSHIELDED_EPISODES // 2, counts
    assert counts[("adversarial", True)][0] == 0, counts
    assert counts[("random", True)][0] == 0, counts


@pytest.mark.slow
def test_full_length_quadrotor_episodes_stay_safe():
    # 20 s episodes reach the geofence corners (several constraints active at once), which the
    # short episodes above rarely do.
    cfg = load_config("configs/quadrotor.yaml")
    spec = ShieldSpec.from_dict(build_shield_spec(cfg))
    for name in ("adversarial", "random"):
        result = evaluate(
            cfg,
            reference_policy(name, cfg, spec, seed=2),
            domains="reality",
            episodes=8,
            seed=20_000,
            shield=True,
            spec=spec,
        )
        assert result["steps"] >= 8 * 900 and result["violations"] == 0, (name, result["violations"])
