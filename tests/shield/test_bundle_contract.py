"""The bundle says what it expects: the I/O contract goes from the declaration into manifest.json, as numbers and
names with units, no machine paths, and is verified on load; a schema-1 bundle (no contract) still serves."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from envs.tasks import read_declaration
from pipeline.config import load_config
from pipeline.deployment.export import export_deterministic
from pipeline.safety.shield_spec import build_shield_spec
from pipeline.training.model import ActorCritic, DeterministicPolicy
from shield.bundle import MANIFEST_FILE, Bundle, BundleError, verify_bundle
from shield.runtime import EdgeRuntime
from tests.helpers.bundle_helpers import resealed_copy
from tests.helpers.serve_bundles import write_tiny_bundle

ROOT = Path(__file__).resolve().parents[2]
RAIL = read_declaration(ROOT / "configs" / "cartpole.yaml")[1].targets["rail"]  # x_ref's declared box


@pytest.fixture(scope="module")
def cartpole_bundle(tmp_path_factory) -> Path:
    """A cart-pole policy (untrained weights, a real normalizer) exported with the config's shield."""
    cfg = load_config(ROOT / "configs" / "cartpole.yaml")
    torch.manual_seed(0)
    ac = ActorCritic(5, 1, (16, 16), action_low=[-1.0], action_high=[1.0])
    ac.obs_rms.update(
        torch.randn(2000, 5, dtype=torch.float64) * torch.tensor([0.3, 0.05, 0.5, 0.4, 0.4], dtype=torch.float64)
    )
    meta = dict(task=cfg.task.name, env_id=cfg.task.env_id, updates=1, env_steps=1, **ac.spec())
    out = tmp_path_factory.mktemp("contract") / "bundle"
    export_deterministic(
        DeterministicPolicy(ac), meta, build_shield_spec(cfg), config_hash=cfg.config_hash(), out_dir=out
    )
    return out


def _strings(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)
    elif isinstance(node, str):
        yield node


def test_the_contract_carries_the_declaration_s_names_units_and_numbers(cartpole_bundle):
    manifest = json.loads((cartpole_bundle / MANIFEST_FILE).read_text())
    assert manifest["schema_version"] == 2
    contract = manifest["contract"]
    decl = read_declaration(ROOT / "configs" / "cartpole.yaml")[1]
    assert [o["name"] for o in contract["observations"]] == [o.name for o in decl.observations]
    assert [o["unit"] for o in contract["observations"]] == ["m", "rad", "m/s", "rad/s", "m"]
    assert contract["observations"][0]["source"] == "joint slider qpos"
    assert contract["actions"] == [
        {
            "name": "cart_force",
            "source": "actuator cart_force",
            "unit": "N",
            "units_per_action": 30.0,
            "low": -1.0,
            "high": 1.0,
        }
    ]
    assert contract["control_period_s"] == decl.control_period and contract["policy_state"] == {"kind": "none"}
    for o in contract["observations"]:  # numbers as numbers, an expected range around the training data
        assert isinstance(o["expected_low"], float) and o["expected_low"] < 0.0 < o["expected_high"]
    # The set-point's is the box it is declared in, exactly, not a spread of the values training drew from it.
    x_ref = contract["observations"][4]
    assert (x_ref["expected_low"], x_ref["expected_high"]) == (RAIL.low[0], RAIL.high[0]) and "range" not in x_ref
    # The cart's position never reads past the slider's stops (+-1.2 m), whatever its training spread says.
    x = contract["observations"][0]
    assert -1.2 <= x["expected_low"] < 0.0 < x["expected_high"] <= 1.2 and "stops" not in x
    # The pole turns without limit: observed wrapped around upright, and the edge wraps a plant's count likewise.
    theta = contract["observations"][1]
    assert theta["wraps_around"] == 0.0 and -math.pi <= theta["expected_low"] < theta["expected_high"] <= math.pi
    assert [o for o in contract["observations"] if "wraps_around" in o] == [theta]
    assert EdgeRuntime.load(cartpole_bundle).policy.wraps == [(1, 0.0)]
    assert manifest["action_low"] == [-1.0] and manifest["action_high"] == [1.0]  # not strings
    # The hash a controller checks, as contracts.md states it: names and units in order, the drive's scale, the period.
    hashed = {
        "actions": ["cart_force"],
        "action_units": [["N", contract["actions"][0]["units_per_action"]]],
        "control_period_s": 0.02,
        "observations": [o.name for o in decl.observations],
        "observation_units": [o["unit"] for o in contract["observations"]],
    }
    text = json.dumps(hashed, sort_keys=True, separators=(",", ":")).encode()
    assert contract["names_sha256"] == hashlib.sha256(text).hexdigest()
    assert not [s for s in _strings(manifest) if s.startswith("/") or str(ROOT) in s]  # no machine paths
    assert Bundle.load(cartpole_bundle).manifest["contract"] == contract


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c["observations"].reverse(), "names_sha256"),  # the names reordered: not the hashed ones
        (lambda c: c.update(control_period_s=0.01), "names_sha256"),  # another rate
        (lambda c: c["actions"][0].update(unit="rad"), "names_sha256"),  # a servo's position, not a force
        (lambda c: c["actions"][0].update(units_per_action=45.0), "names_sha256"),  # a drive geared otherwise
        (lambda c: c["actions"][0].update(units_per_action="30"), r"units_per_action: must be a finite number"),
        (lambda c: c["observations"][1].update(wraps_around="0"), r"wraps_around: must be a finite number"),
        (lambda c: c["observations"].pop(), "4 entries, the policy has 5"),
        (lambda c: c.pop("policy_state"), "policy_state.kind"),
    ],
)
def test_a_contract_that_does_not_hold_is_refused_even_when_resealed(cartpole_bundle, tmp_path, edit, message):
    bundle = resealed_copy(cartpole_bundle, tmp_path / "b", edit)
    with pytest.raises(BundleError, match=message):
        verify_bundle(bundle)


def test_a_schema_1_bundle_without_a_contract_still_loads_verifies_and_serves(tmp_path):
    bundle = write_tiny_bundle(tmp_path / "old", version=3)
    manifest = json.loads((bundle / MANIFEST_FILE).read_text())
    assert manifest["schema_version"] == 1 and "contract" not in manifest
    verify_bundle(bundle)
    runtime = EdgeRuntime.load(bundle)
    safe, raw, _ = runtime.act(np.zeros(4, np.float32))
    assert safe.shape == (2,) and np.all(np.abs(safe) <= 1.0)


def test_serve_prints_the_contract_when_it_starts(cartpole_bundle, tmp_path):
    from tests.helpers.serve_bundles import ServerProcess

    with ServerProcess(str(cartpole_bundle)) as server:
        text = server.stop()
    assert "serve: contract: control period 0.02 s" in text
    assert "serve: contract: observations: x [m], theta [rad], x_dot [m/s], theta_dot [rad/s], x_ref [m]" in text
    assert "serve: contract: actions: cart_force [30 N per unit, -1..1]" in text
    # The compute deadline follows the contract's period (a fixed 1 ms was a twentieth of this plant's 20 ms).
    assert "serve: deadline: 10000 µs (half the contract's 20 ms control period)" in text
    with ServerProcess(str(write_tiny_bundle(tmp_path / "old"))) as server:
        text = server.stop()
    assert "no I/O contract (a schema-1 bundle)" in text
    assert "serve: deadline: 1000 µs (the bundle states no control period)" in text
    with ServerProcess(str(cartpole_bundle), "--deadline-us", "700") as server:
        assert "serve: deadline: 700 µs (--deadline-us)" in server.stop()


def test_registry_show_prints_the_contract_and_each_estimates_held_out_skill(cartpole_bundle, tmp_path, capsys):
    """helper-38: the docs say `registry show` and serve's start print each estimated parameter's held-out R^2;
    neither did (and `registry show`'s summary printed no contract at all)."""
    from types import SimpleNamespace

    from pipeline.commands.registry import run as registry_cli
    from pipeline.deployment.registry import Registry
    from shield.contract import describe

    registry = Registry(tmp_path / "models")
    version = registry.register(cartpole_bundle)
    args = SimpleNamespace(registry_cmd="show", task="cartpole", version=version, root=str(registry.root), json=False)
    assert registry_cli(args) == 0
    shown = capsys.readouterr().out
    assert "  observations: x [m], theta [rad], x_dot [m/s], theta_dot [rad/s], x_ref [m]" in shown
    contract = json.loads((cartpole_bundle / MANIFEST_FILE).read_text())["contract"]
    estimate = {
        "output": "plant_estimate",
        "parameters": [
            {"name": "body_mass.cart", "unit": "x nominal", "low": 0.8, "high": 1.2, "held_out_r2": 0.734},
            {"name": "latency_steps", "unit": "control periods", "low": 0, "high": 2, "held_out_r2": None},
        ],
    }
    assert describe({**contract, "plant_estimate": estimate})[-1] == (
        "plant estimate (plant_estimate): body_mass.cart [x nominal, 0.8..1.2, held-out R^2 0.73], "
        "latency_steps [control periods, 0..2, held-out R^2 n/a (did not vary)]"
    )


def test_serving_a_bundle_that_did_not_pass_its_gate_says_so_and_which_checks_failed():
    """A bundle served by path is served whatever its gate said; the operator is told when it was not a pass."""
    from shield.bundle import gate_note

    reasons = [
        "FAIL gate.min_return_ratio: candidate - legacy: mean -71.1 per episode",
        "UNDECIDED gate.max_lost_rate_increase: bounds straddle 0.02",
        "FAIL gate.max_intervention_rate: shield intervened on 4936 of 5000 steps",
        "PASS gate.max_violations: 0",
    ]
    failed = {"task": "segway", "version": 1, "metrics": {"gate": {"decision": "fail", "reasons": reasons}}}
    note = gate_note(failed)
    assert note is not None and "'fail'" in note and "sim2real registry show segway 1" in note
    assert "gate.min_return_ratio, gate.max_intervention_rate failed" in note
    for quiet in (None, {}, {"metrics": {"gate": {"decision": "pass", "reasons": reasons[3:]}}}):
        assert gate_note(quiet) is None
    # helper-52 served a run folder's export, which no gate judged, and was told nothing.
    ungated = gate_note({"task": "liftarm", "metrics": {"train_env_steps": 100352}})
    assert ungated is not None and "no gate decision" in ungated and "served as asked" in ungated
    # helper-68 served `export --registry`'s copy and was told the registry's copy carries a decision.
    assert "only `sim2real run` records one" in ungated and "sim2real shadow BUNDLE" in ungated
