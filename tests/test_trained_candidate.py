"""A really trained policy through the rest of the pipeline: export parity, the shield keeps its return, the gate."""

from __future__ import annotations

import pytest

from pipeline.evaluation.evaluate import evaluate
from shield.runtime import EdgeRuntime


@pytest.mark.timeout(600)
def test_export_of_trained_policy_is_parity_checked(trained_cartpole):
    assert trained_cartpole.export["parity_max_abs_err"] <= 1e-5


@pytest.mark.timeout(600)
def test_shield_keeps_trained_return_on_nominal_domains(trained_cartpole):
    cfg = trained_cartpole.cfg
    runtime = EdgeRuntime.load(trained_cartpole.bundle, shield=False)  # evaluate() applies the shield itself
    common = dict(domains="nominal", episodes=10, seed=500)
    bare = evaluate(cfg, runtime, shield=False, **common)
    shielded = evaluate(cfg, runtime, shield=True, **common)
    assert bare["return_mean"] > 0
    assert shielded["return_mean"] >= 0.95 * bare["return_mean"], (shielded["return_mean"], bare["return_mean"])
    assert shielded["violations"] == 0


@pytest.mark.timeout(600)
def test_trained_candidate_passes_the_gate(trained_cartpole, tmp_path):
    from pipeline.evaluation.shadow import run_shadow

    cfg = trained_cartpole.cfg
    result = run_shadow(trained_cartpole.bundle, cfg, domains="reality", episodes=10, report_dir=tmp_path / "report")
    assert result["decision"] == "pass", result["reasons"]
    assert result["metrics"]["candidate_violations"] == 0
    # Better than legacy at the gate's confidence, on paired episodes, and decided before the budget ran out.
    assert cfg.gate.min_return_ratio == 1.0 and not result["loosened"]
    line = next(r for r in result["reasons"] if "gate.min_return_ratio:" in r)
    assert line.startswith("PASS ") and "bounds [+" in line, line
    assert len(result["metrics"]["candidate_returns"]) < cfg.gate.max_episodes
