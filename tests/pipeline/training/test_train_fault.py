"""Fault tolerance and run-directory behaviour of the training driver, on real Ray.

A rollout actor killed mid-run is restarted by Ray and the run completes;
a run stopped after K updates resumes at update K with bit-identical learner
state; sync mode has zero policy lag; checkpoints load with weights_only.
"""

import json

import pytest
import ray
import torch

from pipeline.commands.train import run as run_cli
from pipeline.config import load_config, parse_config
from pipeline.training.checkpoint import CheckpointError, latest_checkpoint, read_checkpoint
from pipeline.training.policy import load_policy
from pipeline.training.train import train
from tests.helpers.cli_args import cli_args


@pytest.fixture(scope="module")
def ray_local():
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture
def cfg():
    cfg = load_config("configs/cartpole.yaml")
    cfg.train.envs_per_actor = 4
    cfg.train.rollout_length = 16
    return cfg


def read_metrics(run_dir):
    with open(f"{run_dir}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.timeout(300)
def test_killed_actor_is_restarted_and_run_completes(ray_local, cfg, tmp_path):
    killed = []

    def kill_first_actor_once(state):
        if state["updates"] == 3 and not killed:
            ray.kill(state["actors"][0], no_restart=False)
            killed.append(state["updates"])

    steps = 12_000
    result = train(cfg, out_dir=tmp_path / "run", steps=steps, progress=False, callback=kill_first_actor_once)
    assert killed == [3]
    assert result.env_steps >= steps
    assert result.actor_restarts >= 1
    assert read_metrics(result.run_dir)[-1]["actor_restarts"] >= 1


def learner_tensors(state: dict) -> dict[str, torch.Tensor]:
    """Flatten model + optimizer state into name -> tensor for comparison."""
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    for pid, pstate in state["optimizer"]["state"].items():
        for k, v in pstate.items():
            flat[f"optim.{pid}.{k}"] = torch.as_tensor(v)
    return flat


@pytest.mark.timeout(300)
def test_resume_continues_from_checkpoint_state(ray_local, cfg, tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = train(cfg, out_dir=run_dir, steps=4_000, progress=False)
    k = first.updates
    ckpt = read_checkpoint(latest_checkpoint(run_dir))
    assert ckpt["updates"] == k and ckpt["env_steps"] == first.env_steps
    saved = learner_tensors(ckpt["learner"])
    assert any(name.startswith("model.obs_rms.") for name in saved)  # normalizer is checkpointed
    assert any(name.endswith(".exp_avg") for name in saved)  # so are Adam's moments

    seen_at_start = {}

    def capture_start(state):
        if not seen_at_start:
            seen_at_start["updates"] = state["updates"]
            seen_at_start["env_steps"] = state["env_steps"]
            seen_at_start["tensors"] = learner_tensors(state["learner"].state_dict())

    second = train(cfg, resume=run_dir, steps=8_000, progress=False, callback=capture_start)
    assert seen_at_start["updates"] == k
    assert seen_at_start["env_steps"] == first.env_steps
    resumed = seen_at_start["tensors"]
    assert resumed.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(resumed[name], tensor), name
    assert second.updates > k and second.env_steps >= 8_000
    assert [r["updates"] for r in read_metrics(run_dir)] == list(range(1, second.updates + 1))

    policy, meta = load_policy(run_dir, "latest")  # the default, "selected", is the best validation checkpoint
    assert meta["updates"] == second.updates and meta["obs_dim"] == 5 and meta["act_dim"] == 1
    assert policy(torch.zeros(3, 5)).shape == (3, 1)

    # The CLI resumes with the run's own config.yaml and prints exactly one JSON object.
    args = cli_args("train", "--steps", "10000", "--resume", str(run_dir), "--json")
    capsys.readouterr()
    assert run_cli(args) == 0
    third = json.loads(capsys.readouterr().out)
    assert third["run_dir"] == str(run_dir) and third["updates"] > second.updates and third["env_steps"] >= 10_000
    batch_steps = {r["env_steps"] - p["env_steps"] for p, r in zip(read_metrics(run_dir), read_metrics(run_dir)[1:])}
    assert batch_steps == {2 * cfg.train.envs_per_actor * cfg.train.rollout_length}  # the run's config, not the default


@pytest.mark.timeout(300)
def test_sync_mode_has_zero_policy_lag_and_impala_runs(ray_local, cfg, tmp_path):
    data = cfg.model_dump(mode="json")
    data["train"].update(algorithm="impala", sync=True)
    for appo_only in ("clip_param", "kl_coef"):
        del data["train"][appo_only]
    cfg = parse_config(data)
    result = train(cfg, out_dir=tmp_path / "run", steps=3_000, progress=False)
    records = read_metrics(result.run_dir)
    assert len(records) == result.updates > 0
    assert max(r["policy_lag_max"] for r in records) == 0
    required = {
        "env_steps",
        "env_steps_per_s",
        "learner_samples_per_s",
        "learner_utilization",
        "policy_lag_mean",
        "policy_lag_max",
        "entropy",
        "approx_kl",
        "policy_loss",
        "value_loss",
        "grad_norm",
        "actor_restarts",
    }
    assert all(required <= r.keys() for r in records)
    assert any("episode_return" in r and "episode_cost" in r for r in records)
    assert list((tmp_path / "run").glob("events.out.tfevents.*"))  # TensorBoard
    assert all(torch.isfinite(torch.tensor(r["policy_loss"])) for r in records)


def test_corrupt_or_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        latest_checkpoint(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    bad = tmp_path / "checkpoints" / "ckpt_00000001.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_policy(tmp_path)


def test_a_restart_counts_even_when_the_first_life_never_answered():
    """On a loaded machine an actor can be killed while still booting: the driver never saw its first
    life, yet Ray rebuilt it. The rebuilt life says so and counts once; a life change counts once too."""
    from pipeline.training.actor_pool import ActorPool

    pool = ActorPool([object(), object()], max_in_flight=2)
    assert pool._note_life(0, "b", reconstructed=True) == 1  # first life never seen: still a restart
    assert pool._note_life(0, "b", reconstructed=True) == 0  # the same life again
    assert pool._note_life(1, "x", reconstructed=False) == 0  # a first life
    assert pool._note_life(1, "y", reconstructed=True) == 1  # a new life
    assert pool._note_life(1, "z", reconstructed=False) == 1  # a new life even without the flag
    assert pool.restarts == 3
    # The off-policy replay shards count the same way (pipeline.training.actor_pool.Lives), with what a
    # restarted shard held when last seen counted as lost.
    from pipeline.training.replay import ReplayClient

    client = ReplayClient([object(), object()], batch_size=8, prefetch=1, seed=0)
    client._note(0, dict(life="a", reconstructed=True, size=0, total_mass=0.0))  # rebuilt before the first poll
    client._note(1, dict(life="x", size=500, total_mass=9.0))
    client._note(1, dict(life="x", size=700, total_mass=9.0))
    client._note(1, dict(life="y", reconstructed=True, size=0, total_mass=0.0))
    assert client.restarts == 2 and client.transitions_lost == 700
