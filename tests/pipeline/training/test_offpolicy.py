"""The off-policy (SAC + sharded prioritized replay) path on real Ray and MuJoCo.

Learning: with a fixed step budget the deterministic policy (what export ships)
reaches RETURN_RATIO x the legacy LQR's return on the train domains and exports to
a parity-checked ONNX bundle. The runs are asynchronous, so not repeatable: measured
on 2 cores, 8 runs at 30-40k steps gave 0.82-0.92 x legacy (median 0.87). The bar
sits below that spread, far above an untrained policy (~0.1 x): this test is about
SAC learning, not about passing a gate (the on-policy default does that).
The train set keeps reality's pushes (0.5 N, 1 %), the set this budget was measured
on: configs/cartpole.yaml trains PPO with pushes twice as strong, under which SAC at
this budget dropped the pole in some episodes (4 runs: 0.82-0.94, and 0.79 in CI).
Resume: a run continues at the checkpoint's update counter with the learner's
exact state and its replay contents.
"""

import json

import numpy as np
import pytest
import ray
import torch

import envs
from pipeline.config import ConfigError, load_config, parse_config
from pipeline.training.checkpoint import latest_checkpoint, read_checkpoint
from pipeline.training.policy import load_policy
from pipeline.training.train import train
from tests.pipeline.training.test_train_learning import ENV_ID, episode_returns

RETURN_RATIO = 0.75  # on the train domains (the on-policy test asks 0.95 there, with reality's pushes, and on reality)

SAC_STEP_BUDGET = 30_000


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def sac_config(**sac):
    """The shipped SAC cart-pole config (small enough for CI on 2 cores), with `sac` settings overridden."""
    cfg = load_config("configs/cartpole_sac.yaml")
    cfg.train.device = "cpu"
    for key, value in sac.items():
        setattr(cfg.train.sac, key, value)
    return cfg


def read_metrics(run_dir):
    with open(f"{run_dir}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.timeout(600)
def test_sac_reaches_cartpole_threshold_and_exports(ray_local, tmp_path):
    from pipeline.deployment.export import export_policy

    cfg = sac_config()
    result = train(cfg, out_dir=tmp_path / "run", steps=SAC_STEP_BUDGET, progress=False)
    assert result.env_steps >= SAC_STEP_BUDGET
    # The replay ratio is honoured: learned / collected approaches the target (warm-up excluded).
    target = cfg.train.sac.replay_ratio * (result.env_steps - cfg.train.sac.learning_starts) / result.env_steps
    assert 0.9 * target <= result.replay.replay_ratio <= 1.05 * target

    policy, meta = load_policy(result.run_dir)  # the checkpoint selected on validation, as export takes it
    assert meta["updates"] == result.best_updates and meta["env_id"] == ENV_ID
    randomization = cfg.randomization["train"].model_dump(mode="json")
    seeds = np.arange(10_000, 10_010)  # not the actors' seeds
    learned = episode_returns(lambda obs: policy(torch.from_numpy(obs)).detach().numpy(), randomization, seeds)
    legacy = episode_returns(envs.legacy_controller(ENV_ID), randomization, seeds)
    assert learned.mean() >= RETURN_RATIO * legacy.mean(), (learned.mean(), legacy.mean())

    records = read_metrics(result.run_dir)
    for key in (
        "replay_size",
        "replay_insert_per_s",
        "replay_sample_per_s",
        "priority_max",
        "replay_ratio",
        "is_weight_mean",
        "critic_loss",
        "temperature",
        "shard_restarts",
        "transitions_lost",
    ):
        assert key in records[-1], key
    assert 0 < records[-1]["is_weight_mean"] <= 1

    exported = export_policy(result.run_dir, out_dir=tmp_path / "bundle")
    assert exported["parity_max_abs_err"] <= 1e-5


def learner_tensors(state: dict) -> dict[str, torch.Tensor]:
    flat = {}
    for part, value in state.items():
        if isinstance(value, torch.Tensor):
            flat[part] = value
        elif isinstance(value, dict) and "state" in value:  # an optimizer
            for pid, pstate in value["state"].items():
                flat.update({f"{part}.{pid}.{k}": torch.as_tensor(v) for k, v in pstate.items()})
        elif isinstance(value, dict):
            flat.update({f"{part}.{k}": v for k, v in value.items()})
    return flat


@pytest.mark.timeout(300)
def test_resumed_run_continues_update_counter_and_replay(ray_local, tmp_path):
    cfg = sac_config(learning_starts=500, replay_ratio=16.0, log_every=20, checkpoint_every=100)
    run_dir = tmp_path / "run"
    first = train(cfg, out_dir=run_dir, steps=2_000, progress=False)
    k = first.updates
    ckpt = read_checkpoint(latest_checkpoint(run_dir))
    assert ckpt["algorithm"] == "sac" and ckpt["updates"] == k > 0 and ckpt["env_steps"] == first.env_steps
    saved = learner_tensors(ckpt["learner"])
    assert any(name.startswith("actor.obs_rms.") for name in saved) and any(".exp_avg" in n for n in saved)

    seen = {}

    def capture_start(state):
        if not seen:
            seen.update(
                updates=state["updates"],
                env_steps=state["env_steps"],
                tensors=learner_tensors(state["learner"].state_dict()),
            )

    second = train(cfg, resume=run_dir, steps=3_500, progress=False, callback=capture_start)
    assert seen["updates"] == k and seen["env_steps"] == first.env_steps
    assert seen["tensors"].keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(seen["tensors"][name], tensor), name
    # Every transition the first run counted is back in replay, bar those still waiting for their n-th step.
    pending = (cfg.train.sac.n_step - 1) * cfg.train.envs_per_actor * cfg.train.num_actors
    assert first.env_steps - pending <= second.replay.replay_restored <= cfg.train.replay.capacity
    assert second.updates > k and second.env_steps >= 3_500
    updates = [r["updates"] for r in read_metrics(run_dir)]
    assert updates == sorted(updates) and updates[-1] == second.updates


def test_each_algorithm_refuses_the_keys_it_would_ignore():
    appo = load_config("configs/cartpole.yaml").model_dump(mode="json")
    appo["train"]["sac"] = {"n_step": 3}
    with pytest.raises(ConfigError, match="train.sac: not read by train.algorithm 'appo'"):
        parse_config(appo)
    sac = load_config("configs/cartpole_sac.yaml").model_dump(mode="json")
    assert sac["validation"]["enabled"] is True  # SAC selects its checkpoint on validation too
    parse_config(sac)  # a run's resolved config.yaml loads again (--resume)
    for key, value in (
        ("lr_schedule", "linear"),
        ("sync", True),
        ("batches_per_update", 2),
        ("entropy_coef", 0.01),
        ("adr", {"enabled": True}),
        ("history_length", 0),
    ):
        bad = {**sac, "train": {**sac["train"], key: value}}
        with pytest.raises(ConfigError, match=f"train.{key}: not read by train.algorithm 'sac'"):
            parse_config(bad)
    assert parse_config({**sac, "validation": {"every_updates": 5}}).validation.every_updates == 5  # it selects too
    sac["train"]["replay"] = {"alpha": -1}
    with pytest.raises(ConfigError, match="train.replay.alpha"):
        parse_config(sac)
