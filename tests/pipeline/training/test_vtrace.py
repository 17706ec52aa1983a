"""V-trace against a brute-force evaluation of the IMPALA paper's definition.

The reference uses the closed form (eq. 1 of Espeholt et al. 2018) with nested
sums and products, no recursion, so an off-by-one in the recursion shows up.
rho spans both sides of every clip threshold (a known trap: a reference test
that only used rho >= 1 once hid such an off-by-one).
"""

import numpy as np
import pytest
import torch

from pipeline.training.vtrace import vtrace


def brute_force_vtrace(log_rhos, discounts, rewards, values, bootstrap, rho_bar, pg_rho_bar):
    """v_s = V(x_s) + sum_{t>=s} (prod_{k<t, k>=s} gamma_k c_k) * delta_t, per column."""
    T, B = values.shape
    rhos = np.exp(log_rhos)
    values_ext = np.concatenate([values, bootstrap[None]], axis=0)
    vs = np.zeros((T, B))
    for b in range(B):
        for s in range(T):
            total = 0.0
            for t in range(s, T):
                weight = 1.0
                for k in range(s, t):
                    weight *= discounts[k, b] * min(1.0, rhos[k, b])
                delta = min(rho_bar, rhos[t, b]) * (
                    rewards[t, b] + discounts[t, b] * values_ext[t + 1, b] - values[t, b]
                )
                total += weight * delta
            vs[s, b] = values[s, b] + total
    vs_ext = np.concatenate([vs, bootstrap[None]], axis=0)
    pg_adv = np.minimum(pg_rho_bar, rhos) * (rewards + discounts * vs_ext[1:] - values)
    return vs, pg_adv


def random_inputs(T, B, seed):
    rng = np.random.default_rng(seed)
    # log rho in [-2, 2] -> rho in [0.14, 7.4]: below and above 0.5, 1.0 and 2.0.
    log_rhos = rng.uniform(-2.0, 2.0, (T, B))
    discounts = np.full((T, B), 0.97)
    discounts[rng.random((T, B)) < 0.15] = 0.0  # episode ends
    rewards = rng.normal(size=(T, B))
    values = rng.normal(size=(T, B))
    bootstrap = rng.normal(size=B)
    return log_rhos, discounts, rewards, values, bootstrap


@pytest.mark.parametrize("T,B", [(1, 1), (5, 3), (17, 4), (32, 2)])
@pytest.mark.parametrize("rho_bar,pg_rho_bar", [(1.0, 1.0), (0.5, 2.0), (2.0, 0.5)])
def test_vtrace_matches_paper_definition(T, B, rho_bar, pg_rho_bar):
    inputs = random_inputs(T, B, seed=T * 100 + B)
    rhos = np.exp(inputs[0])
    assert (rhos < min(rho_bar, pg_rho_bar, 1.0)).any() and (rhos > max(rho_bar, pg_rho_bar, 1.0)).any() or T * B < 10
    want_vs, want_adv = brute_force_vtrace(*inputs, rho_bar, pg_rho_bar)
    got_vs, got_adv = vtrace(
        *(torch.tensor(x, dtype=torch.float64) for x in inputs),
        clip_rho_threshold=rho_bar,
        clip_pg_rho_threshold=pg_rho_bar,
    )
    np.testing.assert_allclose(got_vs.numpy(), want_vs, atol=1e-6, rtol=0)
    np.testing.assert_allclose(got_adv.numpy(), want_adv, atol=1e-6, rtol=0)


def test_on_policy_no_discount_ends_is_discounted_return():
    # rho = 1 everywhere and no episode end: v_s is the n-step bootstrapped return.
    T, B, gamma = 6, 2, 0.9
    rewards = torch.rand(T, B, dtype=torch.float64)
    values = torch.rand(T, B, dtype=torch.float64)
    bootstrap = torch.rand(B, dtype=torch.float64)
    vs, _ = vtrace(
        torch.zeros(T, B, dtype=torch.float64),
        torch.full((T, B), gamma, dtype=torch.float64),
        rewards,
        values,
        bootstrap,
    )
    want = bootstrap.clone()
    for t in range(T - 1, -1, -1):
        want = rewards[t] + gamma * want
    np.testing.assert_allclose(vs[0].numpy(), want.numpy(), atol=1e-12)


def test_targets_carry_no_gradient():
    T, B = 4, 3
    values = torch.randn(T, B, requires_grad=True)
    log_rhos = torch.randn(T, B, requires_grad=True)
    bootstrap = torch.randn(B, requires_grad=True)
    vs, adv = vtrace(log_rhos, torch.full((T, B), 0.99), torch.randn(T, B), values, bootstrap)
    assert not vs.requires_grad and not adv.requires_grad
    loss = ((values - vs) ** 2).sum()
    loss.backward()
    # d/dV of (V - vs)^2 with vs constant is 2 (V - vs): only the direct path.
    torch.testing.assert_close(values.grad, 2 * (values - vs).detach())


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="bootstrap_value"):
        vtrace(torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(3, 2), torch.zeros(3))
