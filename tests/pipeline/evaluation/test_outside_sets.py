"""`eval --domains FILE` on plants past every set the shield was certified on says so: an outside user ran
latency 6 against a config whose sets reach 2 and read `envelope_rate 0.0` as "inside" (the monitor flags a
plant that strays from the model further than the sets' plants do, not every plant outside)."""

from __future__ import annotations

from pipeline.config import load_config
from pipeline.evaluation.episodes import outside_sets, resolve_domains
from pipeline.evaluation.evaluate import evaluate, reference_policy
from pipeline.safety.shield_spec import build_shield_spec

CONFIG = "configs/cartpole.yaml"


def test_a_set_past_the_configs_sets_is_named_quantity_by_quantity():
    cfg = load_config(CONFIG)
    for own in cfg.randomization.values():
        assert outside_sets(cfg, own) == []
    train = cfg.randomization["train"].model_dump(mode="json", exclude_none=True)
    past = {**train, "latency_steps": {"low": 6, "high": 6}, "push": {**train["push"], "max_force": 9.0}}
    past["body_mass"] = {**train["body_mass"], "cart": {"dist": "uniform", "low": 1.0, "high": 9.0}}
    lines = outside_sets(cfg, resolve_domains(cfg, past))
    assert [line.split(" ")[0] for line in lines] == ["body_mass.cart", "latency_steps", "push.max_force"], lines
    assert "latency_steps 6..6 (the config's sets: 0..3)" in lines[1]
    # A push of the declared size, held the whole episode on every step (helper-45: no note), is a steadier force.
    steady = {**train, "push": {**train["push"], "probability": 1.0, "duration_steps": 300}}
    lines = outside_sets(cfg, resolve_domains(cfg, steady))
    assert [line.split(" ")[0] for line in lines] == ["push.probability", "push.duration_steps"], lines
    # A quantity no set randomizes spans its nominal only.
    gravity = {**train, "gravity_scale": {"dist": "uniform", "low": 1.0, "high": 1.2}}
    assert outside_sets(cfg, resolve_domains(cfg, gravity)) == ["gravity_scale 1..1.2 (the config's sets: 1..1)"]


def test_eval_on_such_plants_says_nothing_certifies_the_shield_there():
    cfg = load_config(CONFIG)
    spec = build_shield_spec(cfg)
    reality = cfg.randomization["reality"].model_dump(mode="json", exclude_none=True)
    late = {**reality, "latency_steps": {"low": 6, "high": 6}}
    policy = reference_policy("legacy", cfg, spec, seed=0)
    result = evaluate(cfg, policy, domains=late, episodes=1, spec=spec)
    assert any("reach past every set" in n and "latency_steps 6..6" in n for n in result["notes"]), result["notes"]
    inside = evaluate(cfg, policy, domains="reality", episodes=1, spec=spec)
    assert inside["notes"] == []
    # A shield eval builds itself is synthesized, never falsified: helper-54 read "certified" and took it for one.
    (built,) = evaluate(cfg, policy, domains="reality", episodes=1)["notes"]
    assert "has not certified it" in built and "sim2real shield synthesize" in built
