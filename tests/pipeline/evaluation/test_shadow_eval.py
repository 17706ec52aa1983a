"""Shadow evaluation on the real cart-pole, edge runtime and shield: the gate decides right, shadow never acts,
field logs give the same metrics."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.commands.shadow import run as run_cli
from pipeline.config import load_config
from pipeline.evaluation.episodes import check_bundle_task
from pipeline.evaluation.shadow import load_legacy, make_env, resolve_domains, run_shadow, shadow_pass
from shield.runtime import EdgeRuntime
from shield.shadowlog import ShadowLogWriter, read_shadow_log
from tests.helpers.cli_args import cli_args
from tests.helpers.shadow_candidates import (
    CARTPOLE_CONFIG,
    LOOSE_LATENCY_US,
    SHADOW_EPISODE_STEPS,
    cartpole_config,
    shadow_result,
    write_lqr_bundle,
)

# Metrics both the in-sim pass and a field log compute (everything log_metrics returns).
SHARED_KEYS = (
    "steps",
    "episodes",
    "action_rmse",
    "action_p95_abs_diff",
    "raw_action_rmse",
    "agreement_rate",
    "would_be_intervention_rate",
    "would_be_fallback_rate",
    "legacy_returns",
    "legacy_return_mean",
    "legacy_return_ci95",
    "legacy_violations",
    "min_h",
    "latency_p50_us",
    "latency_p99_us",
    "latency_max_us",
    "deadline_misses",
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tmp_path_factory.mktemp("shadow")


def test_legacy_copy_shows_no_divergence_and_passes_with_a_stated_margin(base):
    _, result = shadow_result("lqr", base)
    m = result["metrics"]
    assert max(m["raw_action_rmse"]) <= 1e-5  # the policy itself is the LQR, to float32 rounding
    # The shielded action matches legacy's except on the few steps where the shield would step in.
    assert m["would_be_intervention_rate"] < 0.01
    assert m["agreement_rate"] >= 1.0 - m["would_be_intervention_rate"]
    assert max(m["action_p95_abs_diff"]) <= 1e-5
    assert m["candidate_violations"] == 0 and m["legacy_violations"] == 0
    assert m["candidate_return_mean"] == pytest.approx(m["legacy_return_mean"], rel=1e-3)
    # Equal to legacy passes only because the config allows 1 %, and the gate says so.
    assert result["decision"] == "pass", result["reasons"]
    assert len(result["reasons"]) == 5 and all(r.startswith("PASS ") for r in result["reasons"])
    # Both passes ran here: the latency check judges their CPU time, the wall clock's beside it.
    assert m["compute_p99_us"] > 0 and m["counterfactual_compute_p99_us"] > 0
    assert "(CPU time)" in result["reasons"][-1] and "wall-clock p99" in result["reasons"][-1]
    assert "LOOSENED by gate.min_return_ratio=0.99" in result["reasons"][0]
    n = len(m["candidate_returns"])
    assert f"the candidate lost 0 of {n} episodes that legacy kept" in result["reasons"][1]
    assert result["loosened"] == [
        "gate.min_return_ratio=0.99: the candidate may be 1% of legacy's |mean return| worse than legacy",
        "gate.max_lost_rate_increase=0.2: the candidate may lose 20% more episodes than legacy (shipped: 0.02)",
    ]
    # Sequential: it stopped when the bound decided, before the budget, and never before gate.min_episodes.
    assert m["stopped"] == "decided" and 20 <= n < m["budget_episodes"] == 80


def test_equal_to_legacy_is_not_promoted_by_the_default_gate(base):
    """ "No worse than legacy" at 95 % cannot be shown for a copy of legacy: undecided to the budget, inconclusive."""
    bundle, _ = shadow_result("lqr", base)
    cfg = cartpole_config(episodes=5, max_episode_steps=60)
    cfg.gate.max_latency_p99_us = LOOSE_LATENCY_US
    cfg.gate.max_episodes = 10
    result = run_shadow(bundle, cfg, report_dir=base / "equal")
    assert result["decision"] == "inconclusive" and not result["loosened"]
    assert result["reasons"][0].startswith("UNDECIDED gate.min_return_ratio: candidate - legacy")
    assert result["metrics"]["stopped"] == "episode budget" and result["metrics"]["looks"] == 2


def test_the_time_budget_ends_an_undecided_run_inconclusive(base):
    bundle, _ = shadow_result("lqr", base)
    cfg = cartpole_config(episodes=3, max_episode_steps=60)
    cfg.gate.max_latency_p99_us = LOOSE_LATENCY_US
    cfg.gate.max_seconds = 1e-6  # any batch takes longer: no second batch starts
    result = run_shadow(bundle, cfg, report_dir=base / "time-budget")
    assert result["metrics"]["stopped"] == "time budget (gate.max_seconds)" and result["metrics"]["looks"] == 1
    assert result["decision"] == "inconclusive"


def test_candidate_worse_by_a_known_amount_is_refused_with_its_interval(base):
    """Legacy's LQR tracking half the set-point: the tracking term costs it on every step (about 3 per 100-step
    episode here). Refused, early, with the interval in the message."""
    cfg = cartpole_config(episodes=10, max_episode_steps=100)
    cfg.gate.max_latency_p99_us = LOOSE_LATENCY_US
    worse = write_lqr_bundle(base / "half-setpoint-bundle", cfg, setpoint_scale=0.5)
    result = run_shadow(worse, cfg, report_dir=base / "half-setpoint-report")
    assert result["decision"] == "fail" and result["failing"] == ["gate.min_return_ratio"], result["reasons"]
    line = result["reasons"][0]
    match = re.search(r"mean ([-+.\d]+) per episode, bounds \[([-+.\d]+), ([-+.\d]+)\] vs threshold \+0\.000", line)
    assert match, line
    mean, lower, upper = map(float, match.groups())
    assert lower <= mean <= upper < 0.0
    assert result["metrics"]["looks"] < result["metrics"]["planned_looks"]  # decided before the budget


def test_cli_gates_against_a_production_bundle(base, capsys):
    """`sim2real shadow BUNDLE --production DIR`: production drives the same seeds; its comparison is reported."""
    copy, _ = shadow_result("lqr", base)
    worse = base / "half-setpoint-bundle"
    if not worse.exists():
        write_lqr_bundle(worse, cartpole_config(), setpoint_scale=0.5)
    doc = yaml.safe_load(CARTPOLE_CONFIG.read_text())
    doc["gate"].update(max_latency_p99_us=1e6)
    doc["task"]["max_episode_steps"] = 100
    loose = base / "loose-prod.yaml"
    loose.write_text(yaml.safe_dump(doc))
    code = run_cli(
        _args(
            bundle=str(worse),
            config=str(loose),
            production=str(copy),
            episodes=10,
            report=str(base / "cli-prod"),
            json=True,
        )
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["decision"] == "fail"
    line = next(r for r in out["reasons"] if "gate.min_return_ratio_production" in r)
    assert "candidate - production" in line and "bounds [" in line
    assert out["metrics"]["production_returns"] and len(out["metrics"]["production_returns"]) == len(
        out["metrics"]["candidate_returns"]
    )


def test_random_candidate_fails_and_names_the_thresholds(base):
    _, result = shadow_result("random", base)
    assert result["decision"] == "fail"
    assert "gate.min_return_ratio" in result["failing"]
    fail_lines = [r for r in result["reasons"] if r.startswith("FAIL ")]
    assert any("gate.min_return_ratio" in r and "legacy" in r for r in fail_lines)
    assert len(result["reasons"]) == 5  # passing checks are reported too
    m = result["metrics"]
    assert m["candidate_return_mean"] < 0.8 * m["legacy_return_mean"]
    assert m["agreement_rate"] < 0.9
    per = m["candidate_constraints"]["rail_band"]  # which limit the shield held, and how often it stepped in
    assert per["violating_steps"] == m["candidate_violations"] and per["interventions"] == m["candidate_interventions"]
    # Episodes lost: the task ended them early (the pole fell), each counted against the same episode's legacy.
    n = len(m["candidate_returns"])
    lost = sum(length < SHADOW_EPISODE_STEPS for length in m["candidate_episode_steps"])
    assert lost > 0 and m["candidate_failures"]["k"] == lost and m["candidate_failures"]["n"] == n
    assert m["legacy_failures"]["k"] == 0 and m["legacy_failures"]["upper"] == pytest.approx(1 - 0.05 ** (1 / n))
    # A random policy drops the pole on its own, mid-rail: none of those losses ended with the shield holding it.
    assert m["failures_vs_legacy"] == {
        "candidate_only": lost,
        "legacy_only": 0,
        "episodes": n,
        "candidate_only_held": 0,
    }
    assert f"{lost} of {n}, rate &lt;= " in Path(result["report"]).read_text()  # the report's side-by-side row


def test_shadow_never_acts(base):
    bundle, _ = shadow_result("random", base)
    cfg = cartpole_config()
    env = make_env(cfg, resolve_domains(cfg, "reality"))
    legacy = load_legacy(cfg.task.env_id, None)
    seeds, meta = [7, 8], {"constraint_names": ["rail_band"]}
    alone = shadow_pass(env, legacy, None, seeds, 0.02, meta).columns
    beside = shadow_pass(env, legacy, EdgeRuntime.load(bundle), seeds, 0.02, meta).columns
    for key in ("t", "episode", "step", "obs", "legacy_action", "reward", "cost"):
        assert alone[key].tobytes() == beside[key].tobytes(), f"legacy trajectory changed in column {key!r}"
    # The candidate disagreed with legacy, so had it acted the trajectory would have changed.
    assert np.sqrt(np.mean((beside["candidate_action"] - beside["legacy_action"]) ** 2)) > 0.05


def _as_plant_log(meta: dict) -> dict:
    """The meta a plant's `serve --mode shadow` writes: no simulated domains or seeds to replay."""
    return {k: v for k, v in meta.items() if k not in ("seeds", "domains")} | {"source": "serve"}


def test_field_logs_give_the_same_metrics(base):
    bundle, sim = shadow_result("random", base)
    cols, meta = read_shadow_log(sim["log"])
    meta = _as_plant_log(meta)
    # Re-record the same steps the way `sim2real serve --mode shadow` does: several NPZ parts in a directory.
    writer = ShadowLogWriter(base / "field-logs", flush_rows=150, flush_s=1e9)
    for i in range(len(cols["t"])):
        writer.append(
            meta,
            cols["t"][i],
            cols["episode"][i],
            cols["step"][i],
            cols["obs"][i],
            cols["legacy_action"][i],
            cols["candidate_raw"][i],
            cols["candidate_action"][i],
            cols["intervened"][i],
            cols["fallback"][i],
            cols["h"][i],
            cols["latency_us"][i],
            cols["reward"][i],
            cols["cost"][i],
        )
    writer.close()
    assert len(writer.written) > 1 and not writer.errors

    field = run_shadow(bundle, cartpole_config(), from_log=base / "field-logs", report_dir=base / "field-report")
    for key in SHARED_KEYS:
        assert field["metrics"][key] == sim["metrics"][key], key
    assert field["metrics"]["candidate_return_mean"] is None
    skipped = [r for r in field["reasons"] if r.startswith("SKIPPED ")]
    assert any("gate.min_return_ratio" in r for r in skipped)
    assert any("gate.max_violations" in r for r in skipped)
    assert "field logs have no counterfactual pass" in open(field["report"]).read()


def _args(**kw) -> argparse.Namespace:
    return cli_args("shadow", "-", **{"bundle": None, "config": str(CARTPOLE_CONFIG), **kw})


def _config_with_gate(path, **gate) -> str:
    doc = yaml.safe_load(CARTPOLE_CONFIG.read_text())
    doc["gate"].update(gate)
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_a_simulated_log_pairs_with_the_candidates_counterfactual(base):
    """A log the shadow pass recorded names its domains and seeds: the candidate replays them, paired with the
    logged legacy returns, under the same rules. A log whose legacy episodes the twin does not reproduce is not
    paired (inconclusive, as a plant's log)."""
    bundle, sim = shadow_result("random", base)
    paired = run_shadow(
        bundle, cartpole_config(max_episode_steps=100), from_log=sim["log"], report_dir=base / "paired-report"
    )
    m = paired["metrics"]
    assert m["paired_with_log"] is True and m["candidate_returns"] == sim["metrics"]["candidate_returns"]
    assert paired["decision"] == "fail" and paired["reasons"][0].startswith("FAIL gate.min_return_ratio")
    cols, meta = read_shadow_log(sim["log"])
    cols["reward"] = cols["reward"] + 0.5  # not the episodes the twin replays
    from shield.shadowlog import write_shadow_log

    forged = write_shadow_log(base / "forged.npz", cols, meta)
    unpaired = run_shadow(
        bundle, cartpole_config(max_episode_steps=100), from_log=forged, report_dir=base / "forged-report"
    )
    assert unpaired["metrics"]["paired_with_log"] is False and unpaired["metrics"]["candidate_returns"] is None
    assert unpaired["reasons"][0].startswith("SKIPPED gate.min_return_ratio")


def test_cli_exit_code_follows_the_gate(base, capsys):
    bundle, sim = shadow_result("lqr", base)
    strict = _config_with_gate(base / "strict.yaml", max_latency_p99_us=0.001)
    loose = _config_with_gate(base / "loose.yaml", max_latency_p99_us=1e6)
    cols, meta = read_shadow_log(sim["log"])
    from shield.shadowlog import write_shadow_log

    plant_log = str(write_shadow_log(base / "plant-log.npz", cols, _as_plant_log(meta)))
    sim = {**sim, "log": plant_log}
    assert (
        run_cli(_args(bundle=str(bundle), config=strict, from_log=sim["log"], report=str(base / "cli1"), json=True))
        == 1
    )
    out = json.loads(capsys.readouterr().out)
    assert out["decision"] == "fail" and out["failing"] == ["gate.max_latency_p99_us"]
    # Field logs cannot run the return, lost-episode and violation checks: inconclusive (exit 1, never promoted)...
    assert run_cli(_args(bundle=str(bundle), config=loose, from_log=sim["log"], report=str(base / "cli2"))) == 1
    assert "gate: INCONCLUSIVE" in capsys.readouterr().out
    # ...unless the config waives exactly those checks.
    waived = _config_with_gate(
        base / "waived.yaml",
        max_latency_p99_us=1e6,
        waive=["gate.min_return_ratio", "gate.max_lost_rate_increase", "gate.max_violations"],
    )
    assert run_cli(_args(bundle=str(bundle), config=waived, from_log=sim["log"], report=str(base / "cli3"))) == 0
    printed = capsys.readouterr().out
    assert "gate: PASS" in printed
    # A pass here judged no falsification: the summary says so and names the command that searches.
    assert f"(falsification not run here: `sim2real falsify --bundle {bundle} --config {waived}`" in printed
    # The waived config is not the one the bundle was trained under: judged by it, and said so.
    assert f"note: the config hashes to {load_config(waived).config_hash()[:12]}, {bundle} was trained under" in printed


def test_a_bundle_is_judged_only_on_a_plant_with_its_contracts_signals(base):
    """Another config of the same plant (a new gate) is a fair judge, noted; a plant whose observations are renamed
    or reordered, or whose control period differs from the bundle's contract, is refused by name: the policy would
    read one signal as another."""
    bundle, _ = shadow_result("random", base)
    manifest = json.loads((bundle / "manifest.json").read_text())
    trained = load_config(CARTPOLE_CONFIG)
    manifest["config_hash"] = trained.config_hash()
    assert check_bundle_task(trained, manifest, bundle) is None
    stricter = load_config(_config_with_gate(base / "stricter.yaml", confidence=0.99))
    assert check_bundle_task(stricter, manifest, bundle).startswith(
        f"the config hashes to {stricter.config_hash()[:12]}"
    )
    contract = manifest["contract"]
    swapped = [contract["observations"][1], contract["observations"][0], *contract["observations"][2:]]
    for key, value, named in (
        ("observations", swapped, "observations"),
        ("control_period_s", 2 * contract["control_period_s"], "control period"),
    ):
        other = {**manifest, "contract": {**contract, key: value}}
        with pytest.raises(ValueError, match=f"its contract's {named}"):
            check_bundle_task(trained, other, bundle)


def test_bad_input_names_the_culprit(base, capsys):
    bundle, sim = shadow_result("lqr", base)
    assert run_cli(_args(bundle=str(bundle), domains="nowhere", report=str(base / "bad1"))) == 2
    assert "--domains 'nowhere'" in capsys.readouterr().err
    assert run_cli(_args(bundle=str(bundle), from_log=str(base / "missing.npz"), report=str(base / "bad2"))) == 2
    assert "missing.npz" in capsys.readouterr().err
    pickled = base / "pickled.npz"
    np.savez(pickled, meta=np.array([{"task": "cartpole"}], dtype=object))
    assert run_cli(_args(bundle=str(bundle), from_log=str(pickled), report=str(base / "bad3"))) == 2
    assert "pickled.npz" in capsys.readouterr().err
    tampered = base / "tampered"
    tampered.mkdir()
    for f in bundle.iterdir():
        (tampered / f.name).write_bytes(f.read_bytes())
    (tampered / "policy.onnx").write_bytes((bundle / "policy.onnx").read_bytes() + b"\0")
    assert run_cli(_args(bundle=str(tampered), episodes=1, report=str(base / "bad4"))) == 2
    assert "policy.onnx" in capsys.readouterr().err


def test_domains_from_a_set_name_or_a_yaml_file(tmp_path):
    cfg = cartpole_config()
    assert resolve_domains(cfg, "reality") == cfg.randomization["reality"]
    one_set = tmp_path / "lab.yaml"
    one_set.write_text(yaml.safe_dump({"joint_damping": {"slider": {"dist": "uniform", "low": 2.0, "high": 3.0}}}))
    assert resolve_domains(cfg, str(one_set)).joint_damping["slider"].low == 2.0
    as_config = tmp_path / "sets.yaml"
    as_config.write_text(CARTPOLE_CONFIG.read_text())
    assert resolve_domains(cfg, str(as_config)) == cfg.randomization["reality"]
    with pytest.raises(ValueError, match="missing.yaml"):
        resolve_domains(cfg, str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("joint_damping: {slider: {dist: uniform, low: 3.0, high: 2.0}}\n")
    with pytest.raises(ValueError, match=r"bad\.yaml.*slider"):
        resolve_domains(cfg, str(bad))


@settings(max_examples=60, deadline=None)
@given(first=st.integers(0, 2**40), budget=st.integers(1, 10**7), nights=st.integers(2, 60))
def test_every_night_gates_on_plants_no_other_night_saw(first, budget, nights):
    """The flow's night n (version n) runs the episodes night_seed(n) .. + max_episodes: night 1 where `sim2real
    shadow` starts, and no two nights share a seed, for every seed and budget the config admits (a budget past
    that is refused by its key)."""
    from pipeline.config import ConfigError, parse_config
    from pipeline.evaluation.shadow import night_seed

    data = yaml.safe_load(CARTPOLE_CONFIG.read_text())
    data["shadow"]["seed"] = first
    data["gate"]["max_episodes"] = budget
    try:
        cfg = parse_config(data, "nightly.yaml")
    except ConfigError as err:
        assert "gate.max_episodes" in str(err)
        return
    assert night_seed(cfg, 1) == first
    blocks = [range(night_seed(cfg, n), night_seed(cfg, n) + budget) for n in range(1, nights + 1)]
    assert all(a.stop <= b.start for a, b in zip(blocks, blocks[1:]))  # ascending and disjoint
    for bad in (0, -1, True, 1.0):
        with pytest.raises(ValueError, match="version >= 1"):
            night_seed(cfg, bad)


def test_field_logs_of_another_version_are_refused():
    from pipeline.evaluation.shadow import ShadowError, check_log_matches_bundle

    check_log_matches_bundle({"bundle_version": 4}, 4, "log.npz")
    check_log_matches_bundle({"bundle_version": 0}, 4, "log.npz")  # serve of an unregistered bundle: unknown
    check_log_matches_bundle({"bundle_version": 0}, None, "log.npz")
    with pytest.raises(ShadowError, match=r"log\.npz.*\[3\].*version 4"):
        check_log_matches_bundle({"bundle_version": 3}, 4, "log.npz")
    # helper-55: a hot reload mid-recording left v1's and v2's parts in one folder, judged whole as v1's; and a run
    # folder's export (no version) was judged on v1's log, whose numbers it reported as its own.
    with pytest.raises(ShadowError, match=r"bundle versions \[3, 4\].*only version 4's parts"):
        check_log_matches_bundle({"bundle_versions": [3, 4]}, 4, "logs/")
    with pytest.raises(ShadowError, match=r"no registry version"):
        check_log_matches_bundle({"bundle_version": 1}, None, "logs/")
    # --production beside --from-log was ignored without a word: production took none of the logged steps.
    from pipeline.config import load_config
    from pipeline.evaluation.shadow import run_shadow

    with pytest.raises(ShadowError, match="production took none of them"):
        run_shadow("models/arm/4", load_config("configs/arm.yaml"), from_log="logs/", production_dir="models/arm/1")


def test_quadrotor_shadow_covers_every_action_axis_and_constraint(tmp_path):
    import torch

    from pipeline.config import load_config
    from pipeline.deployment.export import export_deterministic
    from pipeline.evaluation.gate import decide
    from pipeline.evaluation.shadow import evaluate_candidate
    from pipeline.safety.shield_spec import build_shield_spec
    from pipeline.training.model import ActorCritic, DeterministicPolicy

    cfg = load_config(CARTPOLE_CONFIG.parent / "quadrotor.yaml")
    cfg.task.max_episode_steps = 60
    torch.manual_seed(0)
    ac = ActorCritic(15, 3, cfg.train.hidden_sizes)
    meta = dict(task="quadrotor", env_id=cfg.task.env_id, updates=0, env_steps=0, **ac.spec())
    bundle = export_deterministic(
        DeterministicPolicy(ac), meta, build_shield_spec(cfg), config_hash=cfg.config_hash(), out_dir=tmp_path / "quad"
    )["bundle"]
    runtime = EdgeRuntime.load(bundle)
    shadow, cf, m = evaluate_candidate(runtime, cfg, episodes=2)
    names = shadow.meta["constraint_names"]
    assert names and shadow.columns["h"].shape == (m["steps"], len(names))
    assert len(m["action_rmse"]) == len(m["action_p95_abs_diff"]) == 3
    assert len(m["candidate_returns"]) == 2 and cf.states["qpos"].shape[0] > 1
    decision = decide(m, cfg.gate)
    # A random policy is never promoted; two paired episodes are too few to bound its return either way.
    assert decision.decision != "pass" and decision.checks[0].status in ("fail", "undecided")
    assert m["candidate_violations"] == 0  # ...and even a random policy is kept inside the constraints
