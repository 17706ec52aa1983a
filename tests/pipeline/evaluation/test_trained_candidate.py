"""A really trained policy through the rest of the pipeline: export parity, the shield keeps its return, the gate
judges it on its paired bound."""

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
def test_trained_candidate_is_promoted_on_its_bound_or_undecided_never_refused(trained_cartpole, tmp_path):
    from pipeline.evaluation.shadow import run_shadow

    cfg = trained_cartpole.cfg
    result = run_shadow(trained_cartpole.bundle, cfg, domains="reality", episodes=10, report_dir=tmp_path / "report")
    m = result["metrics"]
    assert m["candidate_violations"] == 0
    assert cfg.gate.min_return_ratio == 1.0 and not result["loosened"]
    line = next(r for r in result["reasons"] if "gate.min_return_ratio:" in r)
    # Judged on paired episodes at 95 %, the trained policy is never shown worse than legacy. It is promoted when
    # its lower bound clears legacy, before the budget; a run whose policy drops the pole on one of the 40 reality
    # episodes (some training runs of this budget do) stays undecided: inconclusive, never a pass on luck.
    assert result["decision"] in ("pass", "inconclusive"), result["reasons"]
    if result["decision"] == "pass":
        assert line.startswith("PASS ") and "bounds [+" in line, line
        assert len(m["candidate_returns"]) < cfg.gate.max_episodes
    else:
        assert line.startswith("UNDECIDED ") and m["stopped"] == "episode budget", line
