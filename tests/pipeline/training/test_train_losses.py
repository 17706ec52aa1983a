"""Each algorithm's loss against a case worked by hand (numbers in the comments).

V-trace itself is test_vtrace.py; these take its outputs as given. Ratios sit on both sides of the
clip range and advantages of both signs, so a surrogate that clipped the wrong side would show.
"""

import math

import pytest
import torch

from pipeline.config import Td3Config
from pipeline.training.learner import PolicyTerms, appo_policy_loss, impala_policy_loss
from pipeline.training.sac import soft_actor_loss, soft_target, temperature_loss, twin_critic_loss
from pipeline.training.td3 import Td3Learner, smoothed


class Cfg:
    clip_param, kl_coef = 0.2, 0.0


def terms(rewards, log_rhos, kl=0.0):
    """T = 2 steps of one trace: discounts 0.9, V-trace targets vs = [2, 1], bootstrap 3, baseline V = [1.5, 0.5]."""
    return PolicyTerms(
        logp=torch.tensor([[-1.0], [-2.0]]),
        log_rhos=torch.tensor(log_rhos, requires_grad=True),
        pg_advantages=torch.tensor([[0.5], [-1.0]]),
        vs=torch.tensor([[2.0], [1.0]]),
        values=torch.tensor([[1.5], [0.5]]),
        bootstrap_value=torch.tensor([3.0]),
        rewards=torch.tensor(rewards),
        discounts=torch.tensor([[0.9], [0.9]]),
        kl=torch.tensor(kl),
    )


RATIOS = [[math.log(1.5)], [math.log(0.5)]]  # ratio 1.5 above 1 + clip, 0.5 below 1 - clip


def test_appo_loss_keeps_the_pessimistic_side_of_the_clip():
    # advantages r + 0.9 vs_next - V = [1 + 0.9 * 1 - 1.5, 0 + 0.9 * 3 - 0.5] = [0.4, 2.2], normalized: [-1, 1] /
    # sqrt(2)
    # t0: min(1.5 * -0.7071, 1.2 * -0.7071) = -1.0607 (unclipped); t1: min(0.5 * 0.7071, 0.8 * 0.7071) = 0.3536
    # (unclipped)
    t = terms([[1.0], [0.0]], RATIOS)
    loss = appo_policy_loss(t, Cfg())
    assert loss.item() == pytest.approx(-(-1.5 + 0.5) / math.sqrt(2) / 2, abs=1e-6)  # 0.35355
    loss.backward()
    # d/d log_rho_t = -ratio_t * adv_t / 2 on the unclipped side
    assert t.log_rhos.grad.flatten().tolist() == pytest.approx(
        [1.5 / math.sqrt(2) / 2, -0.5 / math.sqrt(2) / 2], abs=1e-6
    )


def test_appo_loss_has_no_gradient_where_the_clip_binds():
    # advantages [1 + 0.9 - 1.5 + 1.8, 0 + 2.7 - 0.5 - 1.8] = [2.2, 0.4] -> [1, -1] / sqrt(2)
    # t0: min(1.5 * 0.7071, 1.2 * 0.7071) = 0.8485 (clipped); t1: min(0.5 * -0.7071, 0.8 * -0.7071) = -0.5657 (clipped)
    t = terms([[2.8], [-1.8]], RATIOS)
    loss = appo_policy_loss(t, Cfg())
    assert loss.item() == pytest.approx(-(1.2 - 0.8) / math.sqrt(2) / 2, abs=1e-6)  # -0.14142
    loss.backward()
    assert t.log_rhos.grad.abs().max().item() == 0.0


def test_appo_loss_adds_the_kl_penalty():
    cfg = Cfg()
    cfg.kl_coef = 0.5
    assert appo_policy_loss(terms([[1.0], [0.0]], RATIOS, kl=0.1), cfg).item() == pytest.approx(
        0.35355 + 0.05, abs=1e-5
    )


def test_impala_loss_is_the_advantage_weighted_log_likelihood():
    t = terms([[1.0], [0.0]], RATIOS)
    t.logp.requires_grad_(True)
    loss = impala_policy_loss(t, Cfg())
    assert loss.item() == pytest.approx(-((-1.0 * 0.5) + (-2.0 * -1.0)) / 2)  # -0.75
    loss.backward()
    assert t.logp.grad.flatten().tolist() == pytest.approx([-0.25, 0.5])  # -pg_advantage / 2


def test_sac_target_and_losses():
    temperature = torch.tensor(0.2)
    # y = r + discount (min(Q'1, Q'2) - 0.2 log pi'): [1 + 0.9 (2 + 0.2), 0.5 + 0 (the episode ended)]
    target = soft_target(
        torch.tensor([1.0, 0.5]),
        torch.tensor([0.9, 0.0]),
        torch.tensor([2.0, 1.0]),
        torch.tensor([3.0, 0.5]),
        torch.tensor([-1.0, 0.5]),
        temperature,
    )
    assert target.tolist() == pytest.approx([2.98, 0.5])
    # Q1 - y = [-0.48, 0.5], Q2 - y = [0.02, -0.5], weights [1, 0.5]: 0.5 mean([0.2304 + 0.0004, 0.5 (0.25 + 0.25)])
    critic = twin_critic_loss(torch.tensor([2.5, 1.0]), torch.tensor([3.0, 0.0]), target, torch.tensor([1.0, 0.5]))
    assert critic.item() == pytest.approx(0.5 * (0.2308 + 0.25) / 2)
    # mean(0.2 log pi - min(Q1, Q2)) = mean([-0.2 - 1, 0.1 - 1])
    actor = soft_actor_loss(torch.tensor([-1.0, 0.5]), torch.tensor([1.0, 2.0]), torch.tensor([2.0, 1.0]), temperature)
    assert actor.item() == pytest.approx(-1.05)


def test_sac_temperature_falls_while_the_entropy_is_above_its_target():
    log_temperature = torch.tensor(math.log(0.2), requires_grad=True)
    # entropy -mean(log pi) = 0.25 above the target -1: -log(0.2) mean(log pi - 1) = log(0.2) 1.25
    loss = temperature_loss(log_temperature, torch.tensor([-1.0, 0.5]), target_entropy=-1.0)
    assert loss.item() == pytest.approx(math.log(0.2) * 1.25)
    loss.backward()
    assert log_temperature.grad.item() == pytest.approx(1.25)  # > 0: a descent step lowers the temperature


def test_td3_target_smoothing_clips_the_noise_and_the_action():
    # [0.9 + min(0.7, 0.5), -0.2 + max(-0.1, -0.5), -0.95 - 0.5] clipped to [-1, 1]
    out = smoothed(torch.tensor([0.9, -0.2, -0.95]), torch.tensor([0.7, -0.1, -0.8]), noise_clip=0.5)
    assert out.tolist() == pytest.approx([1.0, -0.3, -1.0])


def test_td3_updates_its_actor_every_policy_delay_critic_steps():
    spec = dict(obs_dim=3, act_dim=1, hidden_sizes=[8], action_low=[-1.0], action_high=[1.0])
    learner = Td3Learner(spec, Td3Config(policy_delay=2, lr=1e-2), gamma=0.99, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    batch = {
        k: torch.randn(16, n, generator=gen).squeeze(-1).numpy()
        for k, n in (("obs", 3), ("next_obs", 3), ("action", 1), ("reward", 1))
    }
    batch.update(
        action=batch["action"][:, None].clip(-1, 1),
        discount=torch.full((16,), 0.9).numpy(),
        weight=torch.ones(16).numpy(),
    )
    before_pi, before_q = copied(learner.actor.pi), copied(learner.critic)
    learner.update(batch)
    assert same(before_pi, learner.actor.pi) and not same(before_q, learner.critic)  # step 1: critics only
    learner.update(batch)
    assert not same(before_pi, learner.actor.pi)  # step 2: the actor too


def copied(net: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def same(params: list[torch.Tensor], net: torch.nn.Module) -> bool:
    return all(torch.equal(a, b) for a, b in zip(params, net.parameters()))
