"""V-trace off-policy targets (Espeholt et al. 2018, IMPALA, section 4.1).

All inputs are time-major `[T, B]` (bootstrap_value `[B]`). Episode ends are
encoded as discount 0 at the step whose transition ends the episode, so the
recursion never reaches across episodes inside a batch.

    delta_t = rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t)),   rho_t = min(rho_bar, pi/mu)
    v_s - V(x_s) = delta_s + gamma_s c_s (v_{s+1} - V(x_{s+1})),  c_s = min(1, pi/mu)
    A_s = min(rho_bar_pg, pi/mu) (r_s + gamma_s v_{s+1} - V(x_s))

Targets carry no gradient: they are regression/advantage targets, not
differentiable functions of the network.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def vtrace(
    log_rhos: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    clip_rho_threshold: float = 1.0,
    clip_pg_rho_threshold: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(vs, pg_advantages), both `[T, B]`, detached, by the backward recursion."""
    if not (log_rhos.shape == discounts.shape == rewards.shape == values.shape) or log_rhos.dim() != 2:
        raise ValueError(
            f"vtrace: log_rhos, discounts, rewards, values must share a [T, B] shape; got "
            f"{tuple(log_rhos.shape)}, {tuple(discounts.shape)}, {tuple(rewards.shape)}, {tuple(values.shape)}"
        )
    if bootstrap_value.shape != values.shape[1:]:
        raise ValueError(
            f"vtrace: bootstrap_value must be [B]={tuple(values.shape[1:])}, got {tuple(bootstrap_value.shape)}"
        )
    log_rhos, values, bootstrap_value = log_rhos.detach(), values.detach(), bootstrap_value.detach()

    rhos = torch.exp(log_rhos)
    clipped_rhos = torch.clamp(rhos, max=clip_rho_threshold)
    cs = torch.clamp(rhos, max=1.0)
    values_next = torch.cat([values[1:], bootstrap_value[None]], dim=0)
    deltas = clipped_rhos * (rewards + discounts * values_next - values)

    # Backward recursion on (v_s - V(x_s)); the acc holds v_{s+1} - V(x_{s+1}).
    vs_minus_v = torch.zeros_like(values)
    acc = torch.zeros_like(bootstrap_value)
    for t in range(values.shape[0] - 1, -1, -1):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs_minus_v[t] = acc
    vs = vs_minus_v + values

    vs_next = torch.cat([vs[1:], bootstrap_value[None]], dim=0)
    clipped_pg_rhos = torch.clamp(rhos, max=clip_pg_rho_threshold)
    pg_advantages = clipped_pg_rhos * (rewards + discounts * vs_next - values)
    return vs, pg_advantages
