"""Export: onnxruntime matches torch, the graph is complete and labelled, and a bad export is refused."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
import yaml

from pipeline.training.checkpoint import write_checkpoint
from pipeline.config import load_config
from pipeline.deployment.export import (PARITY_TOL, ExportError, check_graph, export_deterministic, export_policy,
                             parity_observations, run_cli)
from pipeline.training.model import ActorCritic, DeterministicPolicy
from pipeline.deployment.registry import Registry
from shield.bundle import Bundle
from shield.policy import OnnxPolicy
from tests.bundle_helpers import OBS_MEAN, OBS_STD, shield_spec, trained_like_policy


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    policy, meta = trained_like_policy()
    out = tmp_path_factory.mktemp("export") / "bundle"
    result = export_deterministic(policy, meta, shield_spec(), config_hash="c0ffee", out_dir=out,
                                  registry_root=tmp_path_factory.mktemp("models"))
    return policy, meta, result, Bundle.load(out)


def test_onnx_matches_torch_on_training_data_and_extremes_at_batch_1_and_64(exported):
    policy, _, _, bundle = exported
    obs = parity_observations(policy.obs_mean.numpy(), policy.obs_std.numpy())
    assert len(obs) >= 10_000
    z = (obs - np.asarray(OBS_MEAN, np.float32)) / np.asarray(OBS_STD, np.float32)
    assert np.abs(z).max() >= 9.9, "the set must reach +-10 sigma"
    assert (obs == 0).all(axis=1).any(), "the set must hold the zero observation"
    with torch.no_grad():
        reference = policy(torch.from_numpy(obs)).numpy()
    # The check is not vacuous: the scaled policy saturates the bounds on part of the data.
    clipped = np.abs(reference) == np.array([1.0, 0.5], np.float32)
    assert 0.05 < clipped.mean(axis=0).min() and clipped.mean(axis=0).max() < 0.95
    session = OnnxPolicy(bundle.policy_onnx)
    for batch in (1, 64):
        actions = np.concatenate([session(obs[i:i + batch]) for i in range(0, len(obs), batch)])
        assert actions.dtype == np.float32 and actions.shape == reference.shape
        assert np.abs(actions - reference).max() <= PARITY_TOL, f"batch {batch}"


def test_export_reports_parity_and_writes_a_labelled_bundle(exported):
    _, meta, result, bundle = exported
    assert 0 <= result["parity_max_abs_err"] <= PARITY_TOL
    assert result["parity_observations"] >= 10_000 and result["version"] is None
    m = bundle.manifest
    assert (m["task"], m["env_id"], m["config_hash"], m["version"]) == ("planar", meta["env_id"], "c0ffee", None)
    assert m["metrics"]["parity_max_abs_err"] == result["parity_max_abs_err"]
    model = onnx.load_from_string(bundle.policy_onnx)
    props = {p.key: p.value for p in model.metadata_props}
    assert props["task"] == "planar" and props["env_id"] == meta["env_id"]
    assert (props["obs_dim"], props["act_dim"], props["bundle_version"]) == ("4", "2", "1")
    assert json.loads(props["action_low"]) == [-1.0, -0.5] and json.loads(props["action_high"]) == [1.0, 0.5]
    assert props["config_hash"] == "c0ffee" and props["git_commit"]
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17


def test_graph_holds_normalization_and_clipping_with_a_dynamic_batch(exported):
    _, _, _, bundle = exported
    model = onnx.load_from_string(bundle.policy_onnx)
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param and not dims[0].dim_value and dims[1].dim_value == 4
    session = OnnxPolicy(bundle.policy_onnx)
    # Raw observations far outside training: normalization clips, output stays within the action box.
    wild = np.array([[1e6, -1e6, 1e6, -1e6], [0, 0, 0, 0], [-1e6, 1e6, -1e6, 1e6]], np.float32)
    out = session(wild)
    assert out.shape == (3, 2)
    assert np.all(out >= [-1.0, -0.5]) and np.all(out <= [1.0, 0.5])
    assert session(np.zeros((257, 4), np.float32)).shape == (257, 2)


class _TracedBranchPolicy(DeterministicPolicy):
    """A classic export bug: Python control flow on data is frozen by tracing at the dummy input."""

    def forward(self, obs_raw):
        if float(obs_raw.abs().max()) > 5.0:  # traced at zeros: the exported graph never takes this branch
            return torch.zeros(obs_raw.shape[0], self.act_dim)
        return super().forward(obs_raw)


def test_export_refuses_a_graph_that_disagrees_with_torch(tmp_path):
    policy, meta = trained_like_policy()
    broken = _TracedBranchPolicy(ActorCritic(4, 2, (64, 64), [-1.0, -0.5], [1.0, 0.5]))
    broken.load_state_dict(policy.state_dict())
    with pytest.raises(ExportError, match=r"policy\.onnx: onnxruntime disagrees with torch"):
        export_deterministic(broken, meta, shield_spec(), config_hash="x", out_dir=tmp_path / "b",
                             registry_root=tmp_path / "models")
    assert not (tmp_path / "b").exists() and not (tmp_path / "models" / "planar").exists()


def test_export_refuses_when_parity_exceeds_the_tolerance(tmp_path):
    policy, meta = trained_like_policy()
    with pytest.raises(ExportError, match="tolerance"):
        export_deterministic(policy, meta, shield_spec(), config_hash="x", out_dir=tmp_path / "b", parity_tol=-1.0)
    assert not (tmp_path / "b").exists()


def test_export_refuses_a_shield_spec_that_does_not_fit_the_policy(tmp_path):
    policy, meta = trained_like_policy()
    spec = shield_spec()
    spec["obs_dim"] = 5
    with pytest.raises(ExportError, match=r"^shield\.json: "):
        export_deterministic(policy, meta, spec, config_hash="x", out_dir=tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_checker_rejects_an_invalid_graph():
    policy, _ = trained_like_policy()
    from pipeline.deployment.export import to_onnx
    model = to_onnx(policy, 4, {})
    model.graph.node[-1].input[0] = "no_such_tensor"
    with pytest.raises(ExportError, match=r"policy\.onnx: onnx\.checker rejected"):
        check_graph(model)


def _run_dir(tmp_path):
    """A real run directory: config.yaml + an atomic checkpoint, as pipeline.training.train writes them."""
    cfg = load_config("configs/cartpole.yaml")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    import gymnasium as gym

    import envs  # noqa: F401  (registers the sim2real ids)
    env = gym.make(cfg.task.env_id)
    obs_dim, act_dim = env.observation_space.shape[0], env.action_space.shape[0]
    env.close()
    ac = ActorCritic(obs_dim, act_dim, (32, 32))
    ac.obs_rms.update(torch.randn(256, obs_dim, dtype=torch.float64) * 2 + 1)
    write_checkpoint(run_dir, 5, dict(model=ac.state_dict(), model_spec=ac.spec(), updates=5, env_steps=640,
                                      env_id=cfg.task.env_id, task=cfg.task.name, config_hash=cfg.config_hash()))
    return run_dir, cfg


def test_export_policy_from_a_run_dir_registers_the_next_version(tmp_path, capsys):
    pytest.importorskip("pipeline.safety.shield_spec", reason="pipeline/shield_spec.py not landed yet")
    run_dir, cfg = _run_dir(tmp_path)
    models = tmp_path / "models"
    first = export_policy(run_dir, registry_root=models)
    assert first["version"] == 1 and first["parity_max_abs_err"] <= PARITY_TOL
    Registry(models).promote("cartpole", 1)

    class Args:
        out, registry, json = None, str(models), True
    Args.run_dir = str(run_dir)
    assert run_cli(Args) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["version"] == 2 and second["bundle"].endswith("cartpole/2")
    manifest = Registry(models).show("cartpole", 2)
    assert manifest["parent"] == 1 and manifest["config_hash"] == cfg.config_hash()
    assert manifest["production"] is False and Registry(models).production("cartpole") == 1


def test_export_cli_reports_a_missing_run_dir_cleanly(tmp_path, capsys):
    class Args:
        run_dir, out, registry, json = str(tmp_path / "nope"), None, str(tmp_path / "models"), False
    assert run_cli(Args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and "nope" in err and "Traceback" not in err
