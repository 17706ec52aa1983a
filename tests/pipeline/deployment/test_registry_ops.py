"""Registry operations: increasing versions, promote/rollback semantics, clean refusals, CLI exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.commands.registry import run as run_cli
from pipeline.deployment.registry import Registry, RegistryError
from shield.bundle import BundleError, resolve_production, verify_bundle
from tests.helpers.bundle_helpers import export_test_bundle

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def source_bundle(tmp_path_factory):
    return export_test_bundle(tmp_path_factory, "source")[0]


@pytest.fixture
def registry(tmp_path):
    return Registry(tmp_path / "models")


def _cli(registry, cmd, task=None, version=None, as_json=True, force=False):
    return run_cli(
        SimpleNamespace(
            registry_cmd=cmd, task=task, version=version, root=str(registry.root), json=as_json, force=force
        )
    )


def test_versions_only_increase_and_carry_metrics(registry, source_bundle):
    before = (source_bundle / "manifest.json").read_bytes()
    versions = [
        registry.register(source_bundle, metrics={"shadow_return": 1.5 * i}, extra={"flow_run_id": f"f{i}"})
        for i in range(3)
    ]
    assert versions == [1, 2, 3] and registry.versions("planar") == [1, 2, 3]
    assert (source_bundle / "manifest.json").read_bytes() == before, "registering must not modify the source"
    shown = registry.show("planar", 3)
    assert shown["version"] == 3 and shown["metrics"]["shadow_return"] == 3.0
    assert shown["metrics"]["parity_max_abs_err"] <= 1e-5 and shown["extra"]["flow_run_id"] == "f2"
    assert registry.verify("planar") == [1, 2, 3]


def test_promote_and_rollback_walk_the_history(registry, source_bundle):
    for _ in range(3):
        registry.register(source_bundle)
    assert registry.production("planar") is None
    assert registry.promote("planar", 1) is None
    assert registry.promote("planar", 3) == 1
    assert registry.promote("planar", 3) == 3  # promoting the current version is a no-op
    assert registry.promote("planar", 2) == 3
    assert registry.pointer("planar")["history"] == [1, 3]
    assert registry.rollback("planar") == 3 and registry.production("planar") == 3
    assert registry.rollback("planar") == 1 and registry.production("planar") == 1
    with pytest.raises(RegistryError, match="nothing to roll back to"):
        registry.rollback("planar")
    assert registry.production("planar") == 1
    assert resolve_production(registry.root, "planar") == registry.root / "planar" / "1"


def test_annotating_the_production_version_keeps_it_loadable(registry, source_bundle):
    registry.register(source_bundle)
    registry.promote("planar", 1)
    registry.annotate("planar", 1, metrics={"gate": {"decision": "pass", "reasons": []}}, extra={"flow_run_id": "abc"})
    manifest = verify_bundle(resolve_production(registry.root, "planar"))
    assert manifest["metrics"]["gate"]["decision"] == "pass" and manifest["extra"]["flow_run_id"] == "abc"


def test_promote_of_an_unknown_version_or_task_fails_cleanly(registry, source_bundle, capsys):
    registry.register(source_bundle)
    with pytest.raises(RegistryError, match=r"planar: version 9 does not exist \(registered: 1\)"):
        registry.promote("planar", 9)
    with pytest.raises(RegistryError, match="unknown task 'nope'"):
        registry.promote("nope", 1)
    with pytest.raises(RegistryError, match="invalid task name"):
        registry.promote("../planar", 1)
    with pytest.raises(RegistryError, match="unknown task 'nope'"):
        registry.verify("nope")
    assert _cli(registry, "promote", "planar", 9) == 2  # a user error; 1 is for a verify that finds a mismatch
    assert "error: planar: version 9 does not exist" in capsys.readouterr().err
    assert registry.production("planar") is None


def test_rollback_without_history_fails_cleanly(registry, source_bundle, capsys):
    registry.register(source_bundle)
    with pytest.raises(RegistryError, match="no version is in production"):
        registry.rollback("planar")
    registry.promote("planar", 1)
    assert _cli(registry, "rollback", "planar") == 2
    assert "nothing to roll back to" in capsys.readouterr().err
    assert registry.production("planar") == 1


def test_a_tampered_version_is_never_promoted_or_rolled_back_to(registry, source_bundle):
    for _ in range(2):
        registry.register(source_bundle)
    registry.promote("planar", 1)
    registry.promote("planar", 2)
    onnx_path = registry.bundle_dir("planar", 1) / "policy.onnx"
    onnx_path.write_bytes(onnx_path.read_bytes()[:-1])
    with pytest.raises(BundleError, match=r"^policy\.onnx: sha256 mismatch"):
        registry.rollback("planar")
    with pytest.raises(BundleError, match=r"^policy\.onnx: sha256 mismatch"):
        registry.promote("planar", 1)
    assert registry.production("planar") == 2


def test_list_show_promote_print_json(registry, source_bundle, capsys):
    registry.register(source_bundle)
    registry.register(source_bundle)
    assert _cli(registry, "promote", "planar", 2, force=True) == 0  # never gated
    assert json.loads(capsys.readouterr().out) == {"task": "planar", "production": 2, "previous": None}
    assert _cli(registry, "list") == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["production"] == {"planar": 2}
    assert [(r["version"], r["production"]) for r in listed["versions"]] == [(1, False), (2, True)]
    assert _cli(registry, "show", "planar", 1) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["version"] == 1 and shown["files"].keys() == {"policy.onnx", "shield.json"}
    assert _cli(registry, "list", as_json=False) == 0
    assert "planar" in capsys.readouterr().out


def test_the_sim2real_cli_exits_nonzero_without_a_traceback(registry, source_bundle):
    registry.register(source_bundle)
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "registry", "promote", "planar", "7", "--root", str(registry.root)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "version 7 does not exist" in out.stderr and "Traceback" not in out.stderr


def test_concurrent_writers_get_distinct_versions(registry, source_bundle):
    code = (
        "import sys; from pipeline.deployment.registry import Registry; r = Registry(sys.argv[1]); "
        "[r.register(sys.argv[2]) for _ in range(5)]"
    )
    writers = [
        subprocess.Popen([sys.executable, "-c", code, str(registry.root), str(source_bundle)], cwd=ROOT)
        for _ in range(2)
    ]
    assert [w.wait(timeout=60) for w in writers] == [0, 0]
    assert registry.versions("planar") == list(range(1, 11))
    registry.verify("planar")


def test_a_version_whose_gate_did_not_pass_is_promoted_only_with_force(registry, source_bundle, capsys):
    """helper-34 promoted a night whose gate failed by hand, with no word: production would run a policy the gate
    refused. The CLI names the decision and the checks that failed and exits 2; --force does it. helper-38
    promoted a version never gated (exported by hand) with no word: it too needs --force, naming the command that
    gates it. One that passed is promoted as before, and promoting production again moves nothing."""
    for _ in range(3):
        registry.register(source_bundle)
    failed = {
        "decision": "fail",
        "reasons": ["FAIL gate.min_return_ratio: -41.6 per episode", "PASS gate.max_violations: 0"],
    }
    registry.annotate("planar", 2, metrics={"gate": failed})
    registry.annotate("planar", 3, metrics={"gate": {"decision": "pass", "reasons": []}})
    assert _cli(registry, "promote", "planar", 1) == 2  # never gated
    err = capsys.readouterr().err
    assert "never gated (registered by `sim2real export`" in err and "sim2real shadow" in err and "--force" in err
    assert registry.production("planar") is None
    assert _cli(registry, "promote", "planar", 1, force=True) == 0
    assert registry.pointer("planar")["log"][-1]["note"] == "--force: never gated"
    assert _cli(registry, "promote", "planar", 1) == 0  # already production: nothing to refuse
    capsys.readouterr()
    assert _cli(registry, "promote", "planar", 2) == 2
    err = capsys.readouterr().err
    assert "gate decision was 'fail' (gate.min_return_ratio failed)" in err and "--force" in err
    assert registry.production("planar") == 1
    assert _cli(registry, "promote", "planar", 3) == 0 and registry.production("planar") == 3
    assert _cli(registry, "promote", "planar", 2, force=True) == 0 and registry.production("planar") == 2


def test_promoting_the_version_production_beat_needs_force_or_a_rollback(registry, source_bundle, capsys):
    """helper-44 promoted v1 by hand while production was v2, whose gate had shown it better than v1: the version
    the gate replaced went back with no word. It needs --force now, naming v2's gate and `rollback`; a version
    production's gate did not judge is promoted as before."""
    for _ in range(3):
        registry.register(source_bundle)
    registry.annotate("planar", 1, metrics={"gate": {"decision": "pass", "reasons": [], "against_production": None}})
    registry.annotate("planar", 2, metrics={"gate": {"decision": "pass", "reasons": [], "against_production": 1}})
    registry.annotate("planar", 3, metrics={"gate": {"decision": "pass", "reasons": [], "against_production": 1}})
    registry.promote("planar", 1, by="gate")
    registry.promote("planar", 2, by="gate")
    assert _cli(registry, "promote", "planar", 1) == 2
    err = capsys.readouterr().err
    assert "production v2 was promoted over it" in err and "sim2real registry rollback planar" in err, err
    assert registry.production("planar") == 2
    assert _cli(registry, "promote", "planar", 3) == 0  # v2's gate did not judge v3: promoted as before
    assert _cli(registry, "promote", "planar", 2) == 0 and registry.production("planar") == 2
    assert _cli(registry, "promote", "planar", 1, force=True) == 0 and registry.production("planar") == 1
    assert registry.pointer("planar")["log"][-1]["note"] == "--force past v2's gate, which beat it"


def test_every_move_of_production_is_logged_and_list_says_who_made_it(registry, source_bundle, capsys):
    """helper-34 rolled a night back and promoted one by hand: `registry list` could only say "in production by
    `sim2real registry promote` or `rollback`". The pointer now logs each move (the gate's, a hand's, a forced
    one, a rollback) and `list` names the one that put each version in or out of production."""
    for _ in range(3):
        registry.register(source_bundle)
    registry.annotate("planar", 1, metrics={"gate": {"decision": "pass", "reasons": [], "verdict": "promoted v1"}})
    registry.annotate("planar", 2, metrics={"gate": {"decision": "pass", "reasons": [], "verdict": "promoted v2"}})
    registry.annotate("planar", 3, metrics={"gate": {"decision": "fail", "reasons": ["FAIL gate.max_violations: 2"]}})
    registry.promote("planar", 1, by="gate")
    registry.promote("planar", 2, by="gate")
    registry.promote("planar", 2, by="gate")  # a retried flow step: production does not move, nothing is logged
    assert _cli(registry, "promote", "planar", 3, force=True) == 0
    assert _cli(registry, "rollback", "planar") == 0
    capsys.readouterr()

    log = registry.pointer("planar")["log"]
    assert [(m["action"], m["version"], m["previous"], m["by"]) for m in log] == [
        ("promote", 1, None, "gate"),
        ("promote", 2, 1, "gate"),
        ("promote", 3, 2, "hand"),
        ("rollback", 2, 3, "hand"),
    ]
    assert log[2]["note"] == "--force past its gate decision 'fail'"

    assert _cli(registry, "list") == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["pointer_log"]["planar"] == log
    whys = {r["version"]: r["why"] for r in listed["versions"]}
    assert whys[1].startswith("promoted v1; left production") and "v2 promoted by the gate" in whys[1]
    assert whys[2].startswith("promoted v2; rolled back to v2 from v3 by hand")
    assert "left production" in whys[3] and "rolled back to v2 from v3" in whys[3]
    # What put v3 in is said too: a hand's --force past its failed gate, not the gate's own promotion.
    assert "entered production: v3 promoted by hand (`sim2real registry promote`), --force past" in whys[3]
    assert "entered production" not in whys[1]  # the gate put v1 in

    assert _cli(registry, "show", "planar", 3, as_json=False) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("planar v3  ") and "gate: fail\n    FAIL gate.max_violations: 2" in shown
    assert "why: gate fail; entered production: v3 promoted by hand" in shown and "; left production" in shown
    assert "--json prints the whole manifest" in shown


def test_a_pointer_written_before_the_log_still_reads_and_gains_one(registry, source_bundle):
    """A registry from before the pointer had a log: production still resolves, `list` keeps its old wording, and
    the next move starts the log."""
    for _ in range(2):
        registry.register(source_bundle)
    registry.promote("planar", 1)
    pointer_path = registry.task_dir("planar") / "production"
    old = json.loads(pointer_path.read_text())
    del old["log"]
    pointer_path.write_text(json.dumps(old))
    assert registry.production("planar") == 1
    assert _cli(registry, "list", as_json=False) == 0
    registry.promote("planar", 2)
    assert [m["version"] for m in registry.pointer("planar")["log"]] == [2]


def test_a_gate_promotion_judged_against_another_production_does_not_move_it(registry, source_bundle):
    """helper-55 started two nights 3 s apart on one registry: both were judged against production v3 and both
    promoted, the second replacing the first without ever being compared with it. The gate's promotion is
    conditional on the production it was judged against; a hand's is not."""
    from pipeline.deployment.registry import ProductionMoved

    for _ in range(4):
        registry.register(source_bundle)
    assert registry.promote("planar", 1, by="gate", expected_production=None) is None  # the first night
    assert registry.promote("planar", 2, by="gate", expected_production=1) == 1  # judged against v1: moves
    with pytest.raises(ProductionMoved, match="production is v2, but v3 was judged against v1"):
        registry.promote("planar", 3, by="gate", expected_production=1)  # the night beside it, judged against v1
    with pytest.raises(ProductionMoved, match="judged against no production"):
        registry.promote("planar", 4, by="gate", expected_production=None)
    assert registry.production("planar") == 2
    assert [m["version"] for m in registry.pointer("planar")["log"]] == [1, 2]  # no move logged for the refused
    assert registry.promote("planar", 2, by="gate", expected_production=1) == 2  # a retried step: already there
    assert registry.promote("planar", 4) == 2  # by hand, unconditional
    # The flow's promote step says why it did not move production, for the night's summary and the registry.
    from flows.retrain import promote_step

    said = promote_step.fn(str(registry.root), "planar", 3, 2)
    assert said is not None and "production is v4, but v3 was judged against v2" in said
    assert registry.production("planar") == 4
    assert promote_step.fn(str(registry.root), "planar", 3, 4) is None and registry.production("planar") == 3
