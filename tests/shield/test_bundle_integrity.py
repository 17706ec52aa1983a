"""Bundle format: every load verifies hashes, tampering is refused naming the file, the shield wraps the policy."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from pipeline.commands.registry import run as run_cli
from pipeline.deployment.registry import Registry
from shield.bundle import (
    MANIFEST_FILE,
    Bundle,
    BundleError,
    make_manifest,
    manifest_bytes,
    parse_manifest,
    resolve_production,
    seal_manifest,
    sha256_bytes,
    verify_bundle,
    write_bundle,
)
from shield.runtime import EdgeRuntime
from tests.helpers.bundle_helpers import export_test_bundle


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One real exported bundle (parity-checked); tests copy it before tampering."""
    return export_test_bundle(tmp_path_factory, "pristine")


@pytest.fixture
def bundle(pristine, tmp_path):
    path = tmp_path / "bundle"
    shutil.copytree(pristine[0], path)
    return path


def _flip_one_byte(path, offset=-20):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_edge_runtime_runs_the_verified_policy_and_matches_torch(bundle, pristine):
    runtime = EdgeRuntime.load(bundle, shield=False)
    obs = np.array([0.3, -1.0, 0.05, 4.0], np.float32)
    safe, raw, info = runtime.act(obs)
    with torch.no_grad():
        expected = pristine[1](torch.from_numpy(obs[None]))[0].numpy()
    assert np.abs(raw - expected).max() <= 1e-5 and np.array_equal(safe, raw)
    assert info["intervened"] is False and runtime.shielded is False


def test_shielded_runtime_changes_an_unsafe_action_and_keeps_a_safe_one(bundle):
    runtime = EdgeRuntime.load(bundle)
    assert runtime.shielded
    # At the fence (x = 1.95 m, moving +2 m/s toward x_max = 2) any forward push is unsafe.
    unsafe_obs = np.array([1.95, 0.0, 2.0, 0.0], np.float32)
    safe, raw, info = runtime.act(unsafe_obs)
    assert raw[0] > 0.5, "the test policy pushes toward the fence here (fixed seed)"
    assert info["intervened"] and safe[0] <= 0.0
    runtime.reset()
    calm_obs = np.array([-1.0, 1.0, 0.0, 0.0], np.float32)
    safe, raw, info = runtime.act(calm_obs)
    assert not info["intervened"] and np.array_equal(safe, raw)
    batch = runtime(np.stack([calm_obs, unsafe_obs]))
    assert batch.shape == (2, 2) and batch[1, 0] <= 0.0


def test_wrong_observation_size_is_a_clear_error(bundle):
    runtime = EdgeRuntime.load(bundle, shield=False)
    with pytest.raises(ValueError, match="observation must have 4 entries, got 3"):
        runtime.act(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"observation batch must be \[n, 4\], got shape \(2, 5\)"):
        runtime.policy(np.zeros((2, 5), np.float32))


def test_tampered_policy_is_refused_naming_the_file(bundle):
    _flip_one_byte(bundle / "policy.onnx")
    for load in (verify_bundle, Bundle.load, EdgeRuntime.load):
        with pytest.raises(BundleError, match=r"^policy\.onnx: sha256 mismatch"):
            load(bundle)


def test_tampered_shield_spec_is_refused_naming_the_file(bundle):
    spec = json.loads((bundle / "shield.json").read_text())
    spec["margin"] = -5.0
    (bundle / "shield.json").write_text(json.dumps(spec))
    with pytest.raises(BundleError, match=r"^shield\.json: sha256 mismatch"):
        EdgeRuntime.load(bundle)


def test_tampered_manifest_is_refused_naming_the_file(bundle):
    # The classic attack on hash lists: swap the file AND write its new hash into the manifest.
    _flip_one_byte(bundle / "policy.onnx")
    manifest = json.loads((bundle / MANIFEST_FILE).read_text())
    manifest["files"]["policy.onnx"] = sha256_bytes((bundle / "policy.onnx").read_bytes())
    (bundle / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    with pytest.raises(BundleError, match=r"^manifest\.json in .*: manifest_sha256 mismatch"):
        EdgeRuntime.load(bundle)


def test_edited_manifest_field_is_refused(bundle):
    text = (bundle / MANIFEST_FILE).read_text().replace('"task": "planar"', '"task": "other"')
    (bundle / MANIFEST_FILE).write_text(text)
    with pytest.raises(BundleError, match="manifest_sha256 mismatch"):
        verify_bundle(bundle)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: (b / "policy.onnx").unlink(), r"^policy\.onnx: missing"),
        (lambda b: (b / MANIFEST_FILE).unlink(), r"^manifest\.json: missing"),
        (lambda b: (b / MANIFEST_FILE).write_text("{not json"), r"^manifest\.json in .*: not valid JSON"),
        (
            lambda b: (b / MANIFEST_FILE).write_text(json.dumps({"schema_version": 99})),
            r"unsupported schema_version 99",
        ),
    ],
)
def test_broken_bundles_give_one_clear_error(bundle, damage, message):
    damage(bundle)
    with pytest.raises(BundleError, match=message):
        EdgeRuntime.load(bundle)


def test_a_resealed_manifest_cannot_swap_the_production_policy(bundle, tmp_path):
    """Even a manifest re-sealed after swapping policy.onnx is refused: the pointer pins the hashes."""
    registry = Registry(tmp_path / "models")
    version = registry.register(bundle)
    registry.promote("planar", version)
    vdir = registry.bundle_dir("planar", version)
    _flip_one_byte(vdir / "policy.onnx")
    manifest = parse_manifest((vdir / MANIFEST_FILE).read_bytes())
    manifest["files"]["policy.onnx"] = sha256_bytes((vdir / "policy.onnx").read_bytes())
    (vdir / MANIFEST_FILE).write_bytes(manifest_bytes(seal_manifest(manifest)))
    verify_bundle(vdir)  # self-consistent now...
    with pytest.raises(BundleError, match=r"^policy\.onnx: differs from the file that was promoted"):
        resolve_production(tmp_path / "models", "planar")  # ...but not what was promoted
    with pytest.raises(BundleError, match="policy.onnx"):
        registry.verify("planar")


def test_registry_verify_cli_names_the_tampered_file_and_fails(bundle, tmp_path, capsys):
    registry = Registry(tmp_path / "models")
    registry.register(bundle)
    registry.register(bundle)
    _flip_one_byte(registry.bundle_dir("planar", 2) / "policy.onnx")

    class Args:
        registry_cmd, task, version, root, json = "verify", "planar", None, str(tmp_path / "models"), False

    assert run_cli(Args) == 1
    out = capsys.readouterr().out
    assert "planar v2: policy.onnx: sha256 mismatch" in out and "v1" not in out
    Args.version = 1
    assert run_cli(Args) == 0


def test_a_sealed_bundle_with_an_invalid_shield_spec_is_refused_at_load(bundle, tmp_path):
    source = Bundle.load(bundle)
    spec = dict(source.shield_spec, margin=-1.0)
    shield_bytes = json.dumps(spec).encode()
    manifest = make_manifest(
        task="planar",
        env_id="x",
        config_hash="y",
        files={"policy.onnx": source.policy_onnx, "shield.json": shield_bytes},
    )
    out = write_bundle(tmp_path / "bad", policy_onnx=source.policy_onnx, shield_spec=shield_bytes, manifest=manifest)
    with pytest.raises(BundleError, match=r"^shield\.json in .*: shield spec: margin"):
        EdgeRuntime.load(out)
    assert EdgeRuntime.load(out, shield=False).shielded is False


def test_write_bundle_refuses_to_overwrite_and_a_mismatched_manifest(bundle, tmp_path):
    source = Bundle.load(bundle)
    with pytest.raises(BundleError, match="already exists"):
        write_bundle(bundle, policy_onnx=source.policy_onnx, shield_spec=source.shield_json, manifest=source.manifest)
    with pytest.raises(BundleError, match=r"^policy\.onnx: the manifest's sha256 does not match"):
        write_bundle(
            tmp_path / "new",
            policy_onnx=source.policy_onnx + b"x",
            shield_spec=source.shield_json,
            manifest=source.manifest,
        )
    assert not (tmp_path / "new").exists()
