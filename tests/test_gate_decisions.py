"""The promotion gate's rules on hand-made metrics: every check reported, failures named, sign-safe returns."""

from __future__ import annotations

import pytest

from pipeline.config import GateConfig
from pipeline.evaluation.gate import decide, return_threshold


def good_metrics(**overrides) -> dict:
    m = {"legacy_return_mean": 100.0, "candidate_return_mean": 95.0, "candidate_violations": 0,
         "candidate_intervention_rate": 0.01, "would_be_intervention_rate": 0.02,
         "latency_p99_us": 150.0, "counterfactual_latency_p99_us": 160.0}
    m.update(overrides)
    return m


def test_good_candidate_passes_with_every_check_reported():
    decision = decide(good_metrics(), GateConfig())
    assert decision.decision == "pass"
    assert [c.key for c in decision.checks] == ["gate.min_return_ratio", "gate.max_violations",
                                                "gate.max_intervention_rate", "gate.max_latency_p99_us"]
    assert all(r.startswith("PASS ") for r in decision.reasons)


@pytest.mark.parametrize("overrides, failing", [
    ({"candidate_return_mean": 79.0}, ["gate.min_return_ratio"]),
    ({"candidate_violations": 1}, ["gate.max_violations"]),
    ({"candidate_intervention_rate": 0.25}, ["gate.max_intervention_rate"]),
    ({"counterfactual_latency_p99_us": 2500.0}, ["gate.max_latency_p99_us"]),  # the worse pass decides
    ({"candidate_return_mean": -5.0, "candidate_violations": 3}, ["gate.min_return_ratio", "gate.max_violations"]),
])
def test_failing_thresholds_are_named(overrides, failing):
    decision = decide(good_metrics(**overrides), GateConfig())
    assert decision.decision == "fail"
    assert decision.failing == failing
    for key in failing:
        line = next(r for r in decision.reasons if key in r)
        assert line.startswith("FAIL ")
    passing = [r for r in decision.reasons if not any(k in r for k in failing)]
    assert passing and all(r.startswith("PASS ") for r in passing)


def test_return_rule_is_sign_safe():
    # Positive legacy: the familiar ratio.
    assert return_threshold(100.0, 0.8) == pytest.approx(80.0)
    # Negative legacy: the candidate may be 20% worse in magnitude, not forced to beat legacy.
    assert return_threshold(-100.0, 0.8) == pytest.approx(-120.0)
    gate = GateConfig(min_return_ratio=0.8)
    assert decide(good_metrics(legacy_return_mean=-100.0, candidate_return_mean=-110.0), gate).passed
    assert not decide(good_metrics(legacy_return_mean=-100.0, candidate_return_mean=-130.0), gate).passed
    # A ratio above 1 demands an improvement either way.
    assert return_threshold(-100.0, 1.1) == pytest.approx(-90.0)
    assert return_threshold(100.0, 1.1) == pytest.approx(110.0)


def test_field_log_metrics_skip_what_they_cannot_measure():
    metrics = good_metrics(candidate_return_mean=None, candidate_violations=None,
                           candidate_intervention_rate=None, counterfactual_latency_p99_us=None)
    decision = decide(metrics, GateConfig())
    # Issue 11: a gate never passes on checks it could not run.
    assert decision.decision == "inconclusive" and not decision.passed
    skipped = [c.key for c in decision.checks if c.passed is None]
    assert skipped == ["gate.min_return_ratio", "gate.max_violations"]
    assert any("SKIPPED gate.max_violations" in r and "counterfactual" in r for r in decision.reasons)
    # The would-be rate (legacy driving) stands in for the intervention check, and says so.
    line = next(r for r in decision.reasons if "max_intervention_rate" in r)
    assert line.startswith("PASS ") and "would-be" in line
    assert not decide({**metrics, "would_be_intervention_rate": 0.5}, GateConfig()).passed


def test_a_waived_check_may_be_skipped_and_a_failed_one_still_fails():
    metrics = good_metrics(candidate_return_mean=None, candidate_violations=None,
                           candidate_intervention_rate=None, counterfactual_latency_p99_us=None)
    waived = GateConfig(waive=["gate.min_return_ratio", "gate.max_violations"])
    assert decide(metrics, waived).decision == "pass"
    assert decide(metrics, GateConfig(waive=["gate.min_return_ratio"])).decision == "inconclusive"
    assert decide({**metrics, "would_be_intervention_rate": 0.5}, waived).decision == "fail"


def test_falsification_cases_fail_the_gate_and_a_missing_search_is_inconclusive():
    assert decide(good_metrics(falsification_cases=0, falsification_min_h=0.02), GateConfig()).decision == "pass"
    failed = decide(good_metrics(falsification_cases=1, falsification_min_h=-0.01), GateConfig())
    assert failed.decision == "fail" and failed.failing == ["gate.max_falsification_cases"]
    assert decide(good_metrics(falsification_cases=None), GateConfig()).decision == "inconclusive"
