"""The learner: V-trace targets, the IMPALA / APPO loss and the update step, top to bottom.

One `update(batches)` call:
  1. stacks the actors' time-major batches along the env axis,
  2. merges their observations into the running normalizer,
  3. for each epoch and minibatch (a split of the env axis): evaluates the
     current policy, computes V-trace targets against the behaviour
     log-probs, and takes one Adam step on  policy loss + value_coef * value loss - entropy_coef * entropy,
     the policy loss being the algorithm's (`impala_policy_loss`, `appo_policy_loss`: the table in
     algorithms.py picks it),
  4. bumps the policy version.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pipeline.training.model import ActorCritic
from pipeline.training.nets import load_optimizer, to_cpu
from pipeline.training.vtrace import vtrace

LR_FLOOR = 0.05  # linear schedule: the learning rate never drops below this share of train.lr
_BATCH_KEYS = ("obs", "actions", "behaviour_logp", "behaviour_mean", "rewards", "terminated", "truncated", "final_obs")


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when torch sees a GPU, else cpu; 'cuda' without a GPU is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but torch sees no CUDA device; use 'auto' or 'cpu'")
    return torch.device(name)


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (taskset, a container's cpuset), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@contextmanager
def learner_threads(device: torch.device, actor_cpus: float):
    """torch's thread pool for a CPU learner that shares this machine with `actor_cpus` of local actors (an
    oversubscribed pool is ~10x slower than one thread on a busy 2-core box); the caller's setting comes
    back however the run ends."""
    before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(max(1, usable_cpus() - math.ceil(actor_cpus)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def stack_batches(batches: list[dict], device: torch.device) -> dict[str, torch.Tensor]:
    """Concatenate actor batches along the env axis (B) and move them to the learner's device."""
    out = {}
    for key in _BATCH_KEYS:
        array = np.concatenate([b[key] for b in batches], axis=1)
        out[key] = torch.as_tensor(array, device=device)
    # The behaviour log-std is state-independent: one row per actor batch, repeated over its envs.
    out["behaviour_log_std"] = torch.as_tensor(
        np.concatenate([np.broadcast_to(b["behaviour_log_std"], b["actions"].shape[1:]) for b in batches], axis=0),
        device=device,
    )
    return out


@dataclass
class PolicyTerms:
    """What a policy loss reads of one minibatch: time-major [T, B] tensors (kl: a scalar)."""

    logp: torch.Tensor  # log pi(a_t | x_t) under the current policy
    log_rhos: torch.Tensor  # logp - behaviour logp
    pg_advantages: torch.Tensor  # V-trace's clipped-rho advantages (IMPALA)
    vs: torch.Tensor  # V-trace value targets
    values: torch.Tensor  # the current baseline V(x_t), no gradient
    bootstrap_value: torch.Tensor  # V(x_T), no gradient
    rewards: torch.Tensor
    discounts: torch.Tensor
    kl: torch.Tensor  # KL(behaviour || current), mean over the minibatch


def impala_policy_loss(t: PolicyTerms, cfg) -> torch.Tensor:
    """IMPALA: policy gradient weighted by V-trace's clipped-rho advantages."""
    return -(t.logp * t.pg_advantages).mean()


def appo_policy_loss(t: PolicyTerms, cfg) -> torch.Tensor:
    """APPO: PPO's clipped surrogate on V-trace Q-estimates (+ kl_coef x KL(behaviour || current)).

    The surrogate's ratio already corrects for the behaviour policy, so the advantage is
    r_t + discount_t v_{t+1} - V(x_t), normalized over the minibatch, without a second rho weight.
    """
    vs_next = torch.cat([t.vs[1:], t.bootstrap_value[None]], dim=0)
    advantages = t.rewards + t.discounts * vs_next - t.values
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    ratio = torch.exp(t.log_rhos)
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_param, 1.0 + cfg.clip_param)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).mean()
    return loss + cfg.kl_coef * t.kl if cfg.kl_coef > 0 else loss


PolicyLoss = Callable[[PolicyTerms, Any], torch.Tensor]


class Learner:
    """Owns the trainable ActorCritic, its optimizer and normalizer; `update()` consumes batches."""

    def __init__(
        self, model_spec: dict, train_cfg, device: torch.device, policy_loss: PolicyLoss, log_std_init: float = -0.5
    ):
        self.cfg, self.policy_loss = train_cfg, policy_loss
        self.device = device
        self.model = ActorCritic(**model_spec, log_std_init=log_std_init).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=train_cfg.lr, eps=1e-5)
        self.version = 0

    def set_progress(self, fraction: float) -> None:
        """Share of the env-step budget used so far; sets the learning rate under `train.lr_schedule`."""
        if self.cfg.lr_schedule == "linear":
            lr = self.cfg.lr * max(LR_FLOOR, 1.0 - fraction)
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    def cpu_weights(self) -> dict[str, torch.Tensor]:
        """state_dict on the CPU (weights + normalizer), the form actors and checkpoints take."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def update(self, batches: list[dict]) -> dict[str, float]:
        """One learner step on a list of actor batches; returns loss and diagnostic scalars."""
        cfg, model = self.cfg, self.model
        start = time.perf_counter()
        b = stack_batches(batches, self.device)
        T, B = b["rewards"].shape
        model.obs_rms.update(b["obs"][:-1].reshape(T * B, -1))

        # A time-limit cut is not a failure: fold gamma * V(final obs) into the last reward
        # and then cut the trace there like any episode end.
        done = (b["terminated"] | b["truncated"]).float()
        discounts = cfg.gamma * (1.0 - done)
        with torch.no_grad():
            truncation_bootstrap = model(b["final_obs"])[2] * b["truncated"].float()
        rewards = b["rewards"] + cfg.gamma * truncation_bootstrap

        b["discounts"], b["rewards"] = discounts, rewards
        for _ in range(cfg.num_epochs):
            # Minibatches split the env axis, so every minibatch holds whole T-step traces for V-trace.
            for cols in torch.randperm(B, device=self.device).chunk(cfg.num_minibatches):
                mb = {k: v[cols] if k == "behaviour_log_std" else v[:, cols] for k, v in b.items()}
                mean, log_std, values_all = model(mb["obs"])
                mean, log_std = mean[:-1], log_std[:-1]
                values, bootstrap_value = values_all[:-1], values_all[-1]
                dist = torch.distributions.Normal(mean, log_std.exp())
                logp = dist.log_prob(mb["actions"]).sum(-1)
                log_rhos = logp - mb["behaviour_logp"]

                vs, pg_advantages = vtrace(
                    log_rhos,
                    mb["discounts"],
                    mb["rewards"],
                    values,
                    bootstrap_value,
                    cfg.clip_rho_threshold,
                    cfg.clip_pg_rho_threshold,
                )

                behaviour = torch.distributions.Normal(
                    mb["behaviour_mean"], mb["behaviour_log_std"].exp().expand_as(mean)
                )
                kl = torch.distributions.kl_divergence(behaviour, dist).sum(-1).mean()
                terms = PolicyTerms(
                    logp=logp,
                    log_rhos=log_rhos,
                    pg_advantages=pg_advantages,
                    vs=vs,
                    values=values.detach(),
                    bootstrap_value=bootstrap_value.detach(),
                    rewards=mb["rewards"],
                    discounts=mb["discounts"],
                    kl=kl,
                )
                policy_loss = self.policy_loss(terms, cfg)
                value_loss = 0.5 * (values - vs).pow(2).mean()
                entropy = dist.entropy().sum(-1).mean()
                loss = policy_loss + cfg.value_coef * value_loss - cfg.entropy_coef * entropy

                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                self.optimizer.step()

        self.version += 1
        with torch.no_grad():
            # k3 estimator of KL(behaviour || current): unbiased and always >= 0.
            approx_kl = ((torch.exp(-log_rhos) - 1) + log_rhos).mean()
            explained_var = 1 - (vs - values).var() / (vs.var() + 1e-8)
        return dict(
            policy_loss=policy_loss.item(),
            value_loss=value_loss.item(),
            entropy=entropy.item(),
            approx_kl=approx_kl.item(),
            kl=kl.item(),
            grad_norm=float(grad_norm),
            explained_variance=float(explained_var),
            lr=self.optimizer.param_groups[0]["lr"],
            samples=T * B,
            learner_s=time.perf_counter() - start,
        )

    def state_dict(self) -> dict:
        """Everything needed to continue exactly: weights, normalizer, optimizer, version."""
        optim_state = self.optimizer.state_dict()
        return dict(model=self.cpu_weights(), optimizer=to_cpu(optim_state), version=self.version)

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        load_optimizer(self.optimizer, state["optimizer"], self.cfg.lr)
        self.version = int(state["version"])
