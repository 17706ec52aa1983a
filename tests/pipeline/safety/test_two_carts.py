"""Two carts on one rail joined by a spring (helper-37's plant, declared from the docs alone): a limit on each
cart and on their separation, both carts driven. The spring's stiffness (0.7-1.3x) outweighs the lighter cart's
drive at the separation limit, so synthesis hands the plant to the predictive filter, whose tube admits only
part of the declared starts (a separation up to 0.2 m of the 0.3 m allowed)."""

from __future__ import annotations

from pathlib import Path

PLANT = Path(__file__).parent / "plants" / "two_carts.yaml"
# `reality` episodes whose start lies outside the states the filter admits (measured: every step of them answered
# FALLBACK before the backup pulled the plant back in; 145-268 violating steps each, legacy alone none).
STARTS_OUTSIDE = [1, 4, 9]


def test_a_start_the_filter_does_not_admit_is_pulled_in_by_the_backup_not_drifted_out():
    """With no plan accepted yet the backup used to stop the plant wherever it was, each step anew: held apart
    against a spring whose stiffness it misjudged, the carts crept outward one stop after the next and through the
    separation limit, the legacy controller behind the shield crossing limits it kept alone. Stopped where a plan
    may stop (toward the operating point), the plant is pulled in; the filter then takes over."""
    from pipeline.config import load_config
    from pipeline.evaluation.evaluate import evaluate, reference_policy
    from pipeline.safety.shield_spec import build_shield_spec
    from shield.spec import ShieldSpec

    cfg = load_config(PLANT)
    spec = build_shield_spec(cfg)
    assert "predictive" in spec
    shield_spec = ShieldSpec.from_dict(spec)
    for seed in STARTS_OUTSIDE:
        legacy = reference_policy("legacy", cfg, shield_spec, seed=seed)
        run = evaluate(cfg, legacy, domains="reality", episodes=1, seed=seed, shield=True, spec=shield_spec)
        assert run["violations"] == 0, (seed, run)
        assert 0 < run["fallbacks"] < run["steps"] / 2, (seed, run)  # it started outside, and came in
