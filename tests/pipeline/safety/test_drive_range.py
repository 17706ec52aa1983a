"""How much the drive's effect varies is measured, not folded into one symmetric number: a light load that more than
doubles the input's effect is kept as measured, and a drive too weak for any shield model is refused by the range
that makes it so, whichever filter (braking barrier or predictive) would have kept the constraints."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml


def variant(tmp_path: Path, base: str, ranges: dict) -> Path:
    """`base` with every randomization set drawing `ranges` ({group: {element: (low, high)}}) uniformly."""
    doc = yaml.safe_load(open(base))
    doc["plant"]["mjcf"] = str((Path("configs") / doc["plant"]["mjcf"]).resolve())
    for domain in doc["randomization"].values():
        for group, elements in ranges.items():
            for element, (low, high) in elements.items():
                domain.setdefault(group, {})[element] = {"dist": "uniform", "low": low, "high": high}
    path = tmp_path / Path(base).name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_a_light_trolley_that_triples_the_drive_is_certified_and_kept_inside(tmp_path):
    """The crane with its trolley down to 0.3x: the motor's effect on the trolley reaches about 3.4x nominal, past
    the 1 + 0.9 a symmetric error can state. The spec keeps the measured range as its gain cases and the shield
    keeps the adversary inside; without it the adversary leaves the limits."""
    from pipeline.config import load_config
    from pipeline.evaluation.evaluate import evaluate, reference_policy
    from pipeline.safety.shield_spec import build_shield_spec
    from shield.spec import MAX_INPUT_GAIN_ERROR, ShieldSpec

    cfg = load_config(variant(tmp_path, "configs/crane.yaml", {"body_mass": {"trolley": (0.3, 1.2)}}))
    spec = build_shield_spec(cfg)
    low, high = spec["input_gain_range"]
    assert high > 1.0 + MAX_INPUT_GAIN_ERROR and 1.0 - low <= spec["input_gain_error"] + 1e-9
    assert ShieldSpec.from_dict(spec).gain_scales() == [low, high]
    shield_spec = ShieldSpec.from_dict(spec)
    adversary = reference_policy("adversarial", cfg, shield_spec, seed=2)
    shielded = evaluate(cfg, adversary, domains="reality", episodes=1, seed=2, shield=True, spec=shield_spec)
    assert shielded["violations"] == 0, shielded
    adversary = reference_policy("adversarial", cfg, shield_spec, seed=2)
    bare = evaluate(cfg, adversary, domains="reality", episodes=1, seed=2, shield=False, spec=shield_spec)
    assert bare["violations"] > 0


def test_a_drive_too_weak_for_any_shield_is_refused_by_its_range(tmp_path):
    """The arm with its elbow motor down to 5 %: the refusal names the range, its offending end and the physical
    reason (the drive, not the braking it also lacks), instead of failing the schema's `input_gain_error <= 0.9`."""
    from pipeline.config import load_config
    from pipeline.safety import synthesis
    from pipeline.safety.certificate import refusal
    from pipeline.safety.shield_spec import EnvelopeError, build_shield_spec

    cfg = load_config(variant(tmp_path, "configs/arm.yaml", {"actuator_gain": {"elbow_motor": (0.05, 1.0)}}))
    meas = synthesis.measure(cfg)
    weak = synthesis.gain_problems(meas)
    assert [k for k, _, _ in weak] == [1]  # the elbow (q2), not the shoulder
    record = refusal(cfg, meas, weak, bisect=False)
    assert record["parameter"] == "actuator_gain.elbow_motor" and record["offending_end"] == "low"
    assert record["range"] == [0.05, 1.0]
    assert record["reason"].startswith("the drive's effect on q2")
    with pytest.raises(
        EnvelopeError, match=r"actuator_gain\.elbow_motor over \[0\.05, 1\] \(its low end\): the drive's"
    ):
        build_shield_spec(cfg, measurement=meas)
