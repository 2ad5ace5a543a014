"""Selective importance sampling (docs/METHODS.md §6): acceptance rule, Monte Carlo properties, gradients."""

from __future__ import annotations

import math

import torch

from masktrl.methods import TokenBatch, sis_accept, token_losses
from tests.test_methods_reference import F64, NEG_INF

# chi-square critical values at p = 0.001
CHI2_999 = {2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46}


def draw_batch(mu: torch.Tensor, pi: torch.Tensor, list_ids: list[int], n: int, seed: int):
    """n tokens k ~ mu, each with the same recorded list; returns the batch and k."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.multinomial(mu, n, replacement=True, generator=gen)  # [n]
    ids = torch.tensor(list_ids)[None].expand(n, -1).clone()
    mu_lp, pi_lp = mu.log(), pi.log()
    b = TokenBatch(pi_lp[k], mu_lp[k], k, ids, mu_lp[ids], pi_lp[ids], torch.arange(n), mu.shape[0])
    u = torch.rand(n, generator=gen, dtype=F64)
    return b, k, u


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_exact_envelope_accepts_samples_of_pi_at_rate_one_over_m():
    mu = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.07, 0.03], dtype=F64)
    pi = torch.tensor([0.2, 0.3, 0.1, 0.15, 0.15, 0.1], dtype=F64)
    n = 40000
    b, k, u = draw_batch(mu, pi, list(range(6)), n, seed=0)  # K = V: exact envelope M*
    dec = sis_accept(b, u)
    m_star = float((pi / mu).max())
    rate = float(dec.accepted.double().mean())
    assert abs(rate - 1 / m_star) < 4 * math.sqrt(rate * (1 - rate) / n)
    counts = torch.bincount(k[dec.accepted], minlength=6).double()
    assert chi2(counts, pi) < CHI2_999[5]
    # the test would notice sampling from mu instead
    assert chi2(counts, mu) > CHI2_999[5]


def test_topk_envelope_accepts_pi_restricted_to_list():
    mu = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.08, 0.07], dtype=F64)
    pi = torch.tensor([0.15, 0.3, 0.25, 0.1, 0.1, 0.1], dtype=F64)
    top = [0, 1, 2]
    n = 40000
    b, k, u = draw_batch(mu, pi, top, n, seed=1)
    dec = sis_accept(b, u)
    pi_t = float(pi[top].sum())
    m_k = float((pi[top] / mu[top]).max())
    rate = float(dec.accepted.double().mean())
    assert abs(rate - pi_t / m_k) < 4 * math.sqrt(rate * (1 - rate) / n)
    assert not bool(dec.accepted[~torch.isin(k, torch.tensor(top))].any())  # outside T_K: never
    counts = torch.bincount(k[dec.accepted], minlength=6).double()
    assert chi2(counts[top], pi[top] / pi_t) < CHI2_999[2]
    emp = counts / counts.sum()
    tv = 0.5 * float((emp - pi).abs().sum())
    assert abs(tv - (1 - pi_t)) < 0.01  # TV(accepted, pi) = residual mass 1 - pi(T_K)


def test_expected_weight_formula():
    mu = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=F64)
    pi = torch.tensor([0.25, 0.4, 0.15, 0.2], dtype=F64)
    top = [0, 1, 2]
    m = float((pi[top] / mu[top]).max())
    r = pi / mu
    want = torch.where(torch.tensor([True, True, True, False]), pi * (1 + (1 - r) / m), pi)
    # exactly, from accept_prob: E_u[w | k = i] = a_i + (1 - a_i) r_i
    k = torch.arange(4)
    ids = torch.tensor(top)[None].expand(4, -1)
    b = TokenBatch(pi.log(), mu.log(), k, ids, mu.log()[ids], pi.log()[ids], k, 4)
    dec = sis_accept(b, torch.zeros(4, dtype=F64))
    a = torch.nan_to_num(dec.accept_prob, nan=0.0)
    assert torch.allclose(mu * (a + (1 - a) * r), want, atol=1e-12)
    assert torch.isnan(dec.accept_prob[3])
    # and by Monte Carlo through log_w
    n = 60000
    b, kk, u = draw_batch(mu, pi, top, n, seed=2)
    w = sis_accept(b, u).log_w.exp()
    for i in range(4):
        x = torch.where(kk == i, w, torch.zeros_like(w))
        assert abs(float(x.mean()) - float(want[i])) < 4 * float(x.std()) / math.sqrt(n)


def test_acceptance_rule_details():
    # columns: list [0, 1, 2, 3]; token 2 is a zero-mass atom with large pi (excluded from M),
    # token 3 has finite but tiny mu (included: test the logprob, never exp(lp) > 0)
    mu_lp = torch.tensor([math.log(0.6), math.log(0.4), NEG_INF, -800.0], dtype=F64)
    pi_lp = torch.tensor([math.log(0.3), math.log(0.5), math.log(0.1), math.log(0.1)], dtype=F64)
    ids = torch.tensor([[0, 1, 2, -1], [0, 1, 2, -1], [0, 1, 2, 3], [1, 0, 1, -1], [0, 2, -1, -1]])
    k = torch.tensor([0, 1, 0, 0, 1])
    lists_mu = torch.where(ids >= 0, mu_lp[ids.clamp_min(0)], torch.tensor(0.0, dtype=F64))
    lists_pi = torch.where(ids >= 0, pi_lp[ids.clamp_min(0)], torch.tensor(0.0, dtype=F64))
    b = TokenBatch(pi_lp[k], mu_lp[k], k, ids, lists_mu, lists_pi, torch.arange(5), 4)
    a0 = 0.5 / (0.5 / 0.4)  # row 0: r = 0.5, M = max(0.5, 1.25) = 1.25
    first = sis_accept(b, torch.zeros(5, dtype=F64))
    u = torch.tensor([float(first.accept_prob[0]), 0.999, 0.0, 0.0, 0.0], dtype=F64)
    dec = sis_accept(b, u)
    assert abs(float(dec.accept_prob[0]) - a0) < 1e-12
    assert not bool(dec.accepted[0])  # u == a is rejected
    assert bool(sis_accept(b, u - 1e-15).accepted[0])  # just below a: accepted
    assert not bool(dec.accepted[2])  # a underflows to 0: u = 0 never accepts
    assert float(dec.accept_prob[1]) == 1.0 and bool(dec.accepted[1])  # k attains the envelope
    assert float(dec.accept_prob[2]) < 1e-300  # the finite tiny-mu entry dominates M
    assert abs(float(dec.accept_prob[3]) - a0) < 1e-12  # duplicate id 1 ignored
    assert torch.isnan(dec.accept_prob[4]) and not bool(dec.accepted[4])  # k = 1 not in T_K
    assert float(dec.log_w[1]) == 0.0 and abs(float(dec.log_w[0]) - math.log(0.5)) < 1e-12


def test_accepted_tokens_have_on_policy_gradient():
    gen = torch.Generator().manual_seed(3)
    n, v = 64, 7
    z = torch.randn(n, v, generator=gen, dtype=F64, requires_grad=True)
    z_mu = z.detach() + 0.5 * torch.randn(n, v, generator=gen, dtype=F64)
    mu_lp = torch.log_softmax(z_mu, -1)
    k = torch.multinomial(mu_lp.exp(), 1, generator=gen).squeeze(1)
    ids = mu_lp.topk(4, dim=1).indices
    adv = torch.randn(n // 8, generator=gen, dtype=F64).repeat_interleave(8)
    seq = torch.arange(n) // 8
    for base in ("grpo", "dapo", "gspo"):
        lp = torch.log_softmax(z, -1)
        b = TokenBatch(
            lp.gather(1, k[:, None]).squeeze(1),
            mu_lp.gather(1, k[:, None]).squeeze(1),
            k,
            ids,
            mu_lp.gather(1, ids),
            lp.gather(1, ids),
            seq,
            v,
        )
        u = torch.rand(n, generator=gen, dtype=F64)
        out = token_losses("sis", b, adv, u=u, base=base)
        (g,) = torch.autograd.grad(out.loss.sum(), z)
        acc = out.accepted
        assert acc.sum() > 10
        pi = lp.detach().exp()
        v_dir = -pi
        v_dir[torch.arange(n), k] += 1.0
        if base == "gspo":  # token gradient -A s (e_k - pi) unless the sequence is clipped
            s = torch.zeros(n // 8, dtype=F64).index_add_(0, seq, out.log_w).div(8).exp()[seq]
            coef = torch.where(out.mask, 0.0, -adv * s)
        else:
            coef = -adv
        want = coef[:, None] * v_dir
        assert torch.allclose(g[acc], want[acc], atol=1e-12)
        assert not bool(out.mask[acc].any()) or base == "gspo"
        assert torch.allclose(out.loss[acc], -adv[acc]) or base == "gspo"
