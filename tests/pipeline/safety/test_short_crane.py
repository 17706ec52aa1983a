"""A small lab crane an outside user declared from the docs alone (tests/pipeline/safety/plants/short_crane.yaml:
a 2 kg trolley under a 3 kg payload on a 0.4 m rod, a 30 N drive, 0-3 steps of latency, no shield number set).

Full action brakes both positions here, so synthesis used to keep it with the braking barrier. But the model error
the barrier must cover over the latency (about 20 m/s^2 on the trolley, 50 rad/s^2 on the swing) outruns that
braking: no action met the barrier's conditions even at rest, it fell back on every step, and the legacy LQR
behind it crossed the rail limit (14 violating steps in 10 `reality` episodes, 99.4 % of its steps changed),
which it never does unshielded. Synthesis now checks that the barrier can hold the plant at rest before it
picks it, and keeps this plant with the predictive filter instead."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_a_barrier_that_cannot_hold_the_plant_at_rest_gives_way_to_the_predictive_filter():
    from pipeline.config import load_config
    from pipeline.safety.certificate import certificate
    from pipeline.safety.shield_spec import barrier_holding_problem, build_shield_spec
    from tests.helpers.shield_specs import assert_kept_on_reality

    cfg = load_config(HERE / "plants" / "short_crane.yaml")
    spec = build_shield_spec(cfg)
    record = certificate(cfg, None, spec, None, None)
    assert record["filter"]["type"] == "predictive" and record["shield_numbers"]["set_by_hand"] == []
    assert any("cannot hold the plant even at rest" in why for why in record["filter"]["why"]), record["filter"]
    # The same spec without its predictive section is the barrier synthesis picked before: it holds nothing.
    barrier = {k: v for k, v in spec.items() if k != "predictive"}
    assert "swing_limit" in (barrier_holding_problem(barrier, [0.0] * 4) or "")
    assert_kept_on_reality(cfg, spec, seed=0)
