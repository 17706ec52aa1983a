"""`sim2real calibrate --bundle`: an adaptive policy's plant estimate replayed over the field log, beside the fit.

The replay must be what the edge computes beside the plant in shadow mode (one state per contiguous run, the
applied legacy action recorded as sent), and the comparison must line each parameter up with the fit's value
of the same name. The CLI end of it runs on a real shadow log in test_calibrate.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.calibration.logs import CalibrationError, FieldLog
from pipeline.calibration.policy_estimate import compare_with_fit, comparison_lines, replay_estimates
from shield.policy import OnnxPolicy
from shield.runtime import EdgeRuntime
from tests.helpers.bundle_helpers import OBS_MEAN, OBS_STD
from tests.shield.test_plant_estimate import ESTIMATES, exported  # noqa: F401 (the fixture)


def field_log(steps: int = 60, seed: int = 2) -> FieldLog:
    rng = np.random.default_rng(seed)
    obs = rng.normal(size=(steps, 4)) * np.asarray(OBS_STD) * 0.3 + OBS_MEAN
    action = rng.uniform(-0.5, 0.5, (steps, 2))
    return FieldLog(obs=obs, action=action, runs=[(0, 25), (25, steps)], dt=0.02, source="synthetic")


def test_the_replay_is_what_the_edge_computes_in_shadow_mode_one_state_per_run(exported):  # noqa: F811
    _, _, out = exported
    log = field_log()
    got = replay_estimates(OnnxPolicy(out / "policy.onnx"), log)
    runtime, expected = EdgeRuntime.load(out), []
    for start, stop in log.runs:
        session = runtime.new_session()  # a new episode: the state from its initial value
        for t in range(start, stop):
            obs = log.obs[t].astype(np.float32)
            session.act(obs)
            if t - start >= 3:  # the history (3 steps) holds logged steps only
                expected.append(session.estimate()[0])
            session.sent(obs, log.action[t].astype(np.float32), replaced=True)  # the plant applied legacy's
    assert got.shape == (60 - 2 * 3, len(ESTIMATES))
    assert got.astype(np.float32).tobytes() == np.asarray(expected, np.float32).tobytes()
    one_run = FieldLog(log.obs, log.action, [(0, 60)], 0.02, "synthetic")
    assert not np.array_equal(replay_estimates(OnnxPolicy(out / "policy.onnx"), one_run)[22:], got[22:])


def test_each_parameter_is_set_beside_the_fit_of_the_same_name(exported):  # noqa: F811
    _, _, out = exported
    estimates = replay_estimates(OnnxPolicy(out / "policy.onnx"), field_log())
    median = np.median(estimates, axis=0)
    fit = {
        "latency_steps": {"identified": int(round(median[2]))},
        "parameters": {
            "body_mass.cart": {"identified": 1.0, "identified_ok": True, "interval": [50.0, 60.0], "range": [0.9, 1.1]},
        },
    }
    comparison = compare_with_fit(out, field_log(), fit)
    rows = {r["name"]: r for r in comparison["parameters"]}
    assert comparison["steps"] == len(estimates) and comparison["history_length"] == 3
    assert rows["body_mass.cart"]["policy_median"] == pytest.approx(median[0])
    assert rows["body_mass.cart"]["policy_inside_fit_range"] is False  # a fit of 50-60x: another plant
    assert rows["latency_steps"]["policy_inside_fit_range"] is True  # the whole step it rounds to
    assert rows["joint_damping.hinge"]["fit_range"] is None  # randomized for training, not fitted
    lines = comparison_lines(comparison)
    assert any("body_mass.cart" in line and "the policy believes another plant" in line for line in lines)
    assert any("joint_damping.hinge" in line and "not fitted" in line for line in lines)


def test_a_bundle_without_an_estimate_or_of_other_dimensions_is_refused_by_name(exported, tmp_path):  # noqa: F811
    from pipeline.deployment.export import export_deterministic
    from tests.helpers.bundle_helpers import shield_spec
    from tests.pipeline.deployment.test_export_parity import history_policy

    policy, meta = history_policy()
    export_deterministic(policy, meta, shield_spec(), config_hash="h", out_dir=tmp_path / "b", registry_root=tmp_path)
    with pytest.raises(CalibrationError, match="states no plant estimate"):
        compare_with_fit(tmp_path / "b", field_log(), {})
    _, _, out = exported
    wide = FieldLog(np.zeros((40, 5)), np.zeros((40, 1)), [(0, 40)], 0.02, "synthetic")
    with pytest.raises(CalibrationError, match="obs 4/act 2, the log 5/1"):
        compare_with_fit(out, wide, {})
