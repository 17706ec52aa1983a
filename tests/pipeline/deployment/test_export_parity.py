"""Export: onnxruntime matches torch, the graph is complete and labelled, and a bad export is refused."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
import yaml

from pipeline.commands.export import run as run_cli
from pipeline.config import load_config
from pipeline.deployment.export import (
    PARITY_TOL,
    ExportError,
    check_graph,
    export_deterministic,
    export_policy,
    parity_observations,
)
from pipeline.deployment.registry import Registry
from pipeline.training.checkpoint import write_checkpoint
from pipeline.training.model import ActorCritic, DeterministicPolicy
from shield.bundle import Bundle
from shield.policy import OnnxPolicy
from tests.helpers.bundle_helpers import OBS_MEAN, OBS_STD, shield_spec, trained_like_policy


def _export(tmp_path_factory, policy, meta, config_hash):
    out = tmp_path_factory.mktemp("export") / "bundle"
    result = export_deterministic(
        policy,
        meta,
        shield_spec(),
        config_hash=config_hash,
        out_dir=out,
        registry_root=tmp_path_factory.mktemp("models"),
    )
    return result, Bundle.load(out)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    policy, meta = trained_like_policy()
    return (policy, meta, *_export(tmp_path_factory, policy, meta, "c0ffee"))


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
        actions = np.concatenate([session(obs[i : i + batch]) for i in range(0, len(obs), batch)])
        assert actions.dtype == np.float32 and actions.shape == reference.shape
        assert np.abs(actions - reference).max() <= PARITY_TOL, f"batch {batch}"
    # One plant's call (`act`: the preallocated IOBinding) is the graph at batch 1, bit for bit, and every
    # action it returns is its own array (the binding's buffer is overwritten by the next call).
    singles = [session.act(o) for o in obs[:300]]
    assert np.stack(singles).tobytes() == np.concatenate([session.run(obs[i : i + 1]) for i in range(300)]).tobytes()


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
    assert (props["obs_dim"], props["act_dim"], props["bundle_version"]) == (
        "4",
        "2",
        "2",
    )  # schema 2: with the I/O contract
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
        export_deterministic(
            broken, meta, shield_spec(), config_hash="x", out_dir=tmp_path / "b", registry_root=tmp_path / "models"
        )
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
    write_checkpoint(
        run_dir,
        5,
        dict(
            model=ac.state_dict(),
            model_spec=ac.spec(),
            updates=5,
            env_steps=640,
            env_id=cfg.task.env_id,
            task=cfg.task.name,
            config_hash=cfg.config_hash(),
        ),
    )
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

    assert run_cli(Args) == 2  # a user error (pipeline.commands: exit 2, one line on stderr)
    err = capsys.readouterr().err
    assert err.startswith("sim2real export: error:") and "nope" in err and "Traceback" not in err
    assert err.count("\n") == 1


# ---- history policies (train.history_length > 0): the history is a graph input and part of the parity check


def history_policy(history_length: int = 3, seed: int = 1, estimates=None) -> tuple[DeterministicPolicy, dict]:
    """A 4-obs, 2-action policy over observation + 3 (obs, action) pairs, saturating on part of the data; with
    `estimates` ([name, low, high, log] each), an estimate head too (an adaptive student's)."""
    torch.manual_seed(seed)
    ac = ActorCritic(
        4,
        2,
        (64, 64),
        action_low=[-1.0, -0.5],
        action_high=[1.0, 0.5],
        history_length=history_length,
        estimates=estimates,
    )
    scale = torch.tensor(OBS_STD + history_length * (OBS_STD + [0.6, 0.3]), dtype=torch.float64)
    shift = torch.tensor(OBS_MEAN + history_length * (OBS_MEAN + [0.0, 0.0]), dtype=torch.float64)
    ac.obs_rms.update(torch.randn(5000, ac.input_dim, dtype=torch.float64) * scale + shift)
    with torch.no_grad():
        ac.pi[-1].weight.mul_(300.0)
    meta = dict(task="planar", env_id="sim2real/Planar-test", updates=3, env_steps=99, **ac.spec())
    return DeterministicPolicy(ac), meta


@pytest.fixture(scope="module")
def exported_history(tmp_path_factory):
    policy, meta = history_policy()
    return (policy, *_export(tmp_path_factory, policy, meta, "h1st"))


def test_history_policy_graph_takes_the_history_and_matches_torch(exported_history):
    policy, result, bundle = exported_history
    assert result["parity_max_abs_err"] <= PARITY_TOL and result["parity_observations"] >= 10_000
    model = onnx.load_from_string(bundle.policy_onnx)
    names = [i.name for i in model.graph.input]
    assert names == ["obs", "history"]
    dims = [d.dim_value or d.dim_param for d in model.graph.input[1].type.tensor_type.shape.dim]
    assert dims[1:] == [3, 6] and isinstance(dims[0], str)
    assert bundle.manifest["history_length"] == 3
    session = OnnxPolicy(bundle.policy_onnx)
    assert session.history_length == 3
    # The history really drives the action: same observation, different histories, different actions.
    obs = np.tile(np.asarray(OBS_MEAN, np.float32), (2, 1))
    hist = np.random.default_rng(0).normal(size=(2, 3, 6)).astype(np.float32) * 3
    out = session.run(obs, hist)
    with torch.no_grad():
        ref = policy(torch.from_numpy(obs), torch.from_numpy(hist)).numpy()
    assert np.abs(out - ref).max() <= PARITY_TOL and np.abs(out[0] - out[1]).max() > 1e-3


def _torch_rollout(policy, observations, sent):
    """What the deployed policy must output along a trajectory: torch fed the history built by hand."""
    history, actions = np.zeros((3, 6), np.float32), []
    for obs, applied in zip(observations, sent):
        with torch.no_grad():
            actions.append(policy(torch.from_numpy(obs[None]), torch.from_numpy(history[None])).numpy()[0])
        history = np.concatenate([np.concatenate([obs, applied])[None], history[:-1]])
    return np.asarray(actions)


def test_per_plant_memory_keeps_each_plants_history(exported_history):
    policy, _, bundle = exported_history
    session = OnnxPolicy(bundle.policy_onnx)
    rng = np.random.default_rng(3)
    obs = (rng.normal(size=(2, 12, 4)) * OBS_STD + OBS_MEAN).astype(np.float32)
    sent = rng.uniform(-0.4, 0.4, size=(2, 12, 2)).astype(np.float32)  # what the shield let through
    memories = [session.new_memory(), session.new_memory()]
    got = np.zeros((2, 12, 2), np.float32)
    for t in range(12):  # two plants interleaved, as two clients of one server
        for p in (0, 1):
            got[p, t] = session.act(obs[p, t], memories[p])
            session.remember(memories[p], obs[p, t], sent[p, t])
    for p in (0, 1):
        assert np.abs(got[p] - _torch_rollout(policy, obs[p], sent[p])).max() <= PARITY_TOL
    from pipeline.deployment.export import to_onnx

    memoryless = OnnxPolicy(to_onnx(trained_like_policy()[0], 4, {}).SerializeToString())
    assert memoryless.new_memory() is None and memoryless.history_length == 0


def test_batch_interface_keeps_one_history_per_row_until_reset(exported_history):
    policy, _, bundle = exported_history
    session = OnnxPolicy(bundle.policy_onnx)
    rng = np.random.default_rng(4)
    obs = (rng.normal(size=(10, 2, 4)) * OBS_STD + OBS_MEAN).astype(np.float32)
    got = np.stack([session(obs[t]) for t in range(10)], axis=1)  # rows: two plants; the policy's own actions recorded
    for row in (0, 1):
        assert np.abs(got[row] - _torch_rollout(policy, obs[:, row], got[row])).max() <= PARITY_TOL
    session.reset(1)  # row 1 starts a new episode: its history is empty again, row 0 keeps its own
    nxt = session(obs[0])
    with torch.no_grad():
        fresh = policy(torch.from_numpy(obs[0, 1][None]), torch.zeros(1, 3, 6)).numpy()[0]
    assert np.abs(nxt[1] - fresh).max() <= PARITY_TOL
    assert np.abs(nxt[0] - session.run(obs[0, :1], np.zeros((1, 3, 6), np.float32))[0]).max() > 1e-4
