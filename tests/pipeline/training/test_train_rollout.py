"""RolloutActor and model pieces, in-process (no Ray): seeding, batch layout, env recreation."""

import gymnasium as gym
import numpy as np
import pytest
import torch

from pipeline.training.model import ActorCritic, DeterministicPolicy
from pipeline.training.rollout import RolloutActor

ENV_ID = "sim2real/CartPoleRail-v0"
SPEC = dict(obs_dim=5, act_dim=1, hidden_sizes=[16, 16], action_low=[-1.0], action_high=[1.0])


class FlakyPendulum(gym.Wrapper):
    """InvertedPendulum that raises on its 20th step, like a simulator hitting a bad state."""

    def __init__(self):
        super().__init__(gym.make("InvertedPendulum-v5"))
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps == 20:
            raise RuntimeError("simulated MuJoCo instability")
        return self.env.step(action)


gym.register("test/FlakyPendulum-v0", entry_point=FlakyPendulum)


def make_actor(seed, env_id=ENV_ID, spec=SPEC, num_envs=3, T=40):
    actor = RolloutActor(0, env_id, "train" if env_id == ENV_ID else None, None, num_envs, T, seed, spec)
    torch.manual_seed(123)
    actor.set_weights(7, ActorCritic(**spec).state_dict())
    return actor


def test_same_seed_same_batch_and_layout():
    a, b, c = make_actor(seed=1).rollout(), make_actor(seed=1).rollout(), make_actor(seed=2).rollout()
    for key in ("obs", "actions", "behaviour_logp", "rewards", "terminated"):
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert not np.array_equal(a["obs"], c["obs"])
    assert a["obs"].shape == (41, 3, 5) and a["obs"].dtype == np.float32  # T+1: bootstrap observation
    assert a["actions"].shape == (40, 3, 1) and a["rewards"].shape == (40, 3)
    assert a["version"] == 7 and a["env_restarts"] == 0
    # Behaviour log-probs are those of the stored (unclipped) actions under the stored mean/std.
    dist = torch.distributions.Normal(torch.from_numpy(a["behaviour_mean"]), float(np.exp(a["behaviour_log_std"][0])))
    np.testing.assert_allclose(
        dist.log_prob(torch.from_numpy(a["actions"])).sum(-1).numpy(), a["behaviour_logp"], rtol=1e-5, atol=1e-5
    )


def test_env_that_raises_is_recreated_and_counted():
    spec = dict(SPEC, obs_dim=4)
    actor = make_actor(seed=0, env_id="test/FlakyPendulum-v0", spec=spec, num_envs=2, T=30)
    batch = actor.rollout()
    assert batch["env_restarts"] == 2  # each env raised once, at its 20th step (the counter spans episodes)
    assert batch["terminated"].any()
    assert np.isfinite(batch["obs"]).all()
    assert actor.rollout()["rewards"].shape == (30, 2)  # the actor keeps going


def test_deterministic_policy_is_normalized_clipped_mean():
    model = ActorCritic(**SPEC)
    model.obs_rms.update(torch.randn(500, 5, dtype=torch.float64) * 4 + 2)
    with torch.no_grad():
        model.pi[-1].weight.mul_(1000)  # push the mean far outside the action bounds
        obs = torch.randn(64, 5) * 8
        mean, _, _ = model(obs)
        want = mean.clamp(-1, 1)
        got = DeterministicPolicy(model)(obs)
    torch.testing.assert_close(got, want)
    assert (got.abs() == 1).any()


def test_bad_action_bounds_are_rejected():
    with pytest.raises(ValueError, match="action_low"):
        ActorCritic(5, 1, [8], action_low=1.0, action_high=-1.0)


def test_bad_override_names_the_key_before_anything_starts(tmp_path):
    from pipeline.config import load_config
    from pipeline.training.train import train

    with pytest.raises(ValueError, match=r"train\.total_env_steps=-5"):
        train(load_config("configs/cartpole.yaml"), out_dir=tmp_path / "run", steps=-5, progress=False)
    assert not (tmp_path / "run").exists()


def test_the_training_shield_keeps_its_own_margin_and_the_bundle_the_deployed_one():
    # shield.train_margin: the policy trains (and is selected) behind a wider clearance than the edge box enforces.
    from pathlib import Path

    from pipeline.config import load_config
    from pipeline.safety.shield_spec import build_shield_spec
    from pipeline.training.rollout import make_env
    from pipeline.training.scaffold import shield_in_loop
    from shield.cbf import CbfShield

    cfg = load_config(Path(__file__).resolve().parents[3] / "configs" / "quadrotor.yaml")
    assert shield_in_loop(cfg)["spec"]["margin"] == cfg.shield.train_margin  # the shipped config sets one
    cfg.shield.train_margin = None  # unset: the loop runs the deployed margin
    assert shield_in_loop(cfg)["spec"]["margin"] == cfg.shield.margin == 0.1
    cfg.shield.train_margin = 0.3
    loop = shield_in_loop(cfg)
    assert loop["spec"]["margin"] == 0.3 and build_shield_spec(cfg)["margin"] == 0.1  # export builds the latter
    # At rest 1.45 m from the person's axis (radius 1.0): inside the training margin, outside the deployed one
    # (each plus the ~0.2 m a plant at rest may need: a push's speed and the inner loop's 0.15 s lag).
    obs = np.zeros(15, np.float32)
    obs[:3], obs[11] = (1.45, 0.0, 1.5), 1.0
    hover = np.zeros(3, np.float32)
    assert CbfShield(loop["spec"]).filter(obs, hover)[1]["intervened"]
    assert not CbfShield(build_shield_spec(cfg)).filter(obs, hover)[1]["intervened"]
    assert make_env(cfg.task.env_id, None, 50, loop).shield.spec.margin == 0.3  # what the actors' envs run
    cfg.shield.train_in_loop = False
    assert shield_in_loop(cfg) is None
