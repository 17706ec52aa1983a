"""Two carts on one rail joined by a spring (helper-37's plant, declared from the docs alone): a limit on each
cart and on their separation, both carts driven. The spring's stiffness (0.7-1.3x) outweighs the lighter cart's
drive at the separation limit, so synthesis hands the plant to the predictive filter, whose tube admits only
part of the declared starts (a separation up to 0.2 m of the 0.3 m allowed)."""

from __future__ import annotations

from pathlib import Path

import yaml

PLANT = Path(__file__).parent / "plants" / "two_carts.yaml"
# `reality` episodes whose start lies outside the states the filter admits (measured: every step of them answered
# FALLBACK before the backup pulled the plant back in; 145-268 violating steps each, legacy alone none).
STARTS_OUTSIDE = [1, 4, 9]
# helper-37's corner: the soft spring (0.7x), the light cart 1 (0.8x), the heavy cart 2 (1.3x), both drives 1.1x,
# one step of latency; the carts start 0.25 m further apart than at rest (0.3 m allowed).
SOFT_CORNER = {
    "body_mass": {
        "cart1": {"dist": "uniform", "low": 0.8, "high": 0.8},
        "cart2": {"dist": "uniform", "low": 1.3, "high": 1.3},
    },
    "tendon_stiffness": {"spring": {"dist": "uniform", "low": 0.7, "high": 0.7}},
    "actuator_gain": {
        "m1": {"dist": "uniform", "low": 1.1, "high": 1.1},
        "m2": {"dist": "uniform", "low": 1.1, "high": 1.1},
    },
    "latency_steps": {"low": 1, "high": 1},
    "obs_noise_std": [0.001, 0.001, 0.01, 0.01, 0.0],
    "action_noise_std": 0.02,
    "push": {"body": "cart2", "max_force": 5.0, "probability": 0.01, "duration_steps": 5, "axes": ["x"]},
}


def _legacy_behind_the_shield(cfg, domains, seed: int) -> dict:
    from pipeline.evaluation.evaluate import evaluate, reference_policy
    from pipeline.safety.shield_spec import build_shield_spec
    from shield.spec import ShieldSpec

    spec = build_shield_spec(cfg)
    assert "predictive" in spec
    shield_spec = ShieldSpec.from_dict(spec)
    legacy = reference_policy("legacy", cfg, shield_spec, seed=seed)
    return evaluate(cfg, legacy, domains=domains, episodes=1, seed=seed, shield=True, spec=shield_spec)


def test_a_start_the_filter_does_not_admit_is_pulled_in_by_the_backup_not_drifted_out(tmp_path):
    """With no plan accepted yet the backup used to stop the plant wherever it was, each step anew: held apart
    against a spring whose stiffness it misjudged, the carts crept outward one stop after the next and through the
    separation limit, the legacy controller behind the shield crossing limits it kept alone. Stopped at the nearest
    stop a plan may have, the same error left them settled just outside it on a soft spring, the filter never
    taking over (299 of 300 steps a fallback). Pulled toward the operating point, the plant comes in within a few
    steps and the filter takes over."""
    from pipeline.config import load_config

    cfg = load_config(PLANT)
    for seed in STARTS_OUTSIDE:
        run = _legacy_behind_the_shield(cfg, "reality", seed)
        assert run["violations"] == 0, (seed, run)
        assert 0 < run["fallbacks"] <= 30, (seed, run)  # it started outside, and came in
        assert run["fallback_starts"] == 1  # counted as such, for the certificate to say
        # The start's barrier values (below 0 there, the same for every policy on the seed: helper-39's lowest h was
        # one number across domains and policies) are not the run's lowest h: the legacy controller's, once the
        # filter has taken over, touches 0 at most (where the filter first changes one of its actions).
        assert run["min_h"] >= -1e-6, (seed, run["min_h"])
    doc = yaml.safe_load(PLANT.read_text())
    doc["task"] = {"name": "two_carts_apart", "env_id": "sim2real/TwoCartsApart-v0"}
    doc["plant"]["mjcf"] = str(PLANT.with_suffix(".xml"))
    doc["plant"]["initial_state"]["qpos"] = {"rail1": [-0.05, -0.05], "rail2": [0.2, 0.2]}
    apart = tmp_path / "apart.yaml"
    apart.write_text(yaml.safe_dump(doc))
    corner = tmp_path / "soft_corner.yaml"
    corner.write_text(yaml.safe_dump(SOFT_CORNER))
    run = _legacy_behind_the_shield(load_config(apart), str(corner), 0)
    assert run["violations"] == 0 and 0 < run["fallbacks"] <= 30, run
    from pipeline.commands.shield import legacy_lines

    said = legacy_lines({**run, "fallback_rate": run["fallbacks"] / run["steps"]})
    assert said[-1].startswith("  1 of its 1 episodes started outside the states the filter admits")
