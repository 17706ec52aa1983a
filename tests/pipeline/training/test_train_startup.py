"""A training run that fails while its actors start leaves nothing behind: the Ray it started is shut
down and torch's thread pool is the caller's again (on real Ray; the failure is planted in the actor
pool, after the weight source and the actors were created).

This module starts no Ray of its own: `train` must find none up and start its own.
"""

import pytest
import ray
import torch

import pipeline.training.offpolicy as offpolicy
import pipeline.training.onpolicy as onpolicy
from pipeline.config import load_config
from pipeline.training.train import train


def _failing_pool(*args, **kwargs):
    raise RuntimeError("the actor pool failed to start")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "config, loop", [("configs/cartpole.yaml", onpolicy), ("configs/cartpole_sac.yaml", offpolicy)]
)
def test_a_failure_while_the_actors_start_shuts_ray_down_and_restores_torch(config, loop, monkeypatch, tmp_path):
    cfg = load_config(config)
    cfg.train.envs_per_actor, cfg.train.rollout_length, cfg.train.device = 4, 16, "cpu"
    cfg.validation.enabled = False
    assert not ray.is_initialized()
    torch.set_num_threads(3)  # the caller's own setting, whatever the learner wants
    monkeypatch.setattr(loop, "ActorPool", _failing_pool)
    with pytest.raises(RuntimeError, match="failed to start"):
        train(cfg, out_dir=tmp_path / "run", steps=2_000, progress=False)
    assert not ray.is_initialized()
    assert torch.get_num_threads() == 3
