"""The exact derivative of the top-K KL along v = e_k - pi (docs/METHODS.md §4.7), against torch
autograd of the top-K KL written from its definition, in float64; its place between the two tail
estimators, its limit K >= V, and what the certified bracket does and does not contain."""

from __future__ import annotations

import math

import pytest
import torch

from masktrl.methods import (
    TokenBatch,
    ddot_kl_bracket,
    ddot_topk_exact,
    divergence,
    divergence_rate,
    divergence_rate_full,
    square_mass,
)
from tests.test_methods_reference import F64, make_batch, random_rows, ref_support


def topk_kl_of_logits(z: torch.Tensor, support_ids: list[int], mu_s: list[float]) -> torch.Tensor:
    """D_K(mu || softmax(z)) = sum_S mu_i log(mu_i/pi_i) + mu_T log(mu_T/pi_T), pi_T = 1 - pi(S) (unfloored)."""
    pi = torch.softmax(z, -1)
    ids = torch.tensor(support_ids)
    mu = torch.tensor(mu_s, dtype=F64)
    pos = mu > 0
    atoms = (mu[pos] * (mu[pos].log() - pi[ids][pos].log())).sum()
    mu_t = max(0.0, 1.0 - math.fsum(mu_s))
    pi_t = 1.0 - pi[ids].sum()
    return atoms + (mu_t * (math.log(mu_t) - pi_t.log()) if mu_t > 0 else 0.0)


def autograd_rate(r, atoms) -> float:
    """d/dt D_K(z + t v) at t = 0 with v = e_k - pi held fixed."""
    z = r.z.clone()
    v = torch.zeros_like(z)
    v[r.k] = 1.0
    v = v - torch.softmax(z, -1)
    t = torch.zeros((), dtype=F64, requires_grad=True)
    d = topk_kl_of_logits(z + t * v, [i for i, _, _ in atoms], [math.exp(a) for _, a, _ in atoms])
    (g,) = torch.autograd.grad(d, t)
    return float(g)


def exact_rate(rows, v):
    b = make_batch(rows, v)
    pi_sq = square_mass(torch.stack([r.pi_lp for r in rows]))
    return b, ddot_topk_exact(b, pi_sq)


@pytest.mark.parametrize(
    "flags", [{}, {"outside": True}, {"outside": False}, {"zero_mass": True}, {"padding": True, "duplicates": True}]
)
@pytest.mark.parametrize("v, k_list", [(12, 4), (30, 6), (7, 1)])
def test_equals_autograd_of_the_topk_kl(flags, v, k_list):
    rows = random_rows(3 + v + k_list, 24, v, k_list, **flags)
    _, got = exact_rate(rows, v)
    for i, r in enumerate(rows):
        want = autograd_rate(r, ref_support(r, "union"))
        assert float(got[i]) == pytest.approx(want, rel=1e-9, abs=1e-12), (i, flags)


def test_sampled_token_inside_and_outside_the_list_both_covered():
    rows = random_rows(5, 40, 15, 4)
    b = make_batch(rows, 15)
    inside = [r.k in r.top for r in rows]
    assert any(inside) and not all(inside)
    _, got = exact_rate(rows, 15)
    for i, r in enumerate(rows):
        assert float(got[i]) == pytest.approx(autograd_rate(r, ref_support(r, "union")), rel=1e-9, abs=1e-12)
    assert b.n == 40


def test_lies_between_the_aggregated_and_the_uniform_tail():
    rows = random_rows(11, 200, 40, 5)
    b, got = exact_rate(rows, 40)
    agg, uni = divergence_rate(b, "kl", "agg"), divergence_rate(b, "kl", "uniform")
    lo, hi = torch.minimum(agg, uni), torch.maximum(agg, uni)
    assert bool(((lo - 1e-12 <= got) & (got <= hi + 1e-12)).all())
    assert float((got - agg).abs().max()) > 1e-4  # not one of them
    assert float((got - uni).abs().max()) > 1e-4


def test_list_covering_the_vocabulary_equals_the_full_vocabulary_rate():
    rows = random_rows(2, 30, 9, 9)
    b, got = exact_rate(rows, 9)
    mu = torch.stack([r.mu_lp for r in rows])
    pi = torch.stack([r.pi_lp for r in rows])
    full = divergence_rate_full(mu, pi, b.sampled_ids, "kl")
    assert torch.allclose(got, full, atol=1e-12)


def test_one_unseen_token_equals_the_aggregated_tail():
    rows = random_rows(4, 30, 6, 5, outside=False, padding=False, duplicates=False)
    rows = [r for r in rows if r.k in r.top]
    b, got = exact_rate(rows, 6)
    assert torch.allclose(got, divergence_rate(b, "kl", "agg"), atol=1e-12)


def test_bracket_contains_the_full_rate_but_not_always_the_topk_rate():
    """The bracket of §4.4 bounds the full-vocabulary Ddot_KL (always); the top-K KL's own
    derivative can lie above its upper end when mu_T > mu_cap and the training tail sits on one
    unseen token."""
    rows = random_rows(8, 400, 25, 3, padding=False, duplicates=False, zero_mass=False)
    b, got = exact_rate(rows, 25)
    lo, hi = ddot_kl_bracket(b)
    full = divergence_rate_full(
        torch.stack([r.mu_lp for r in rows]), torch.stack([r.pi_lp for r in rows]), b.sampled_ids, "kl"
    )
    assert bool(((lo - 1e-12 <= full) & (full <= hi + 1e-12)).all())
    assert bool((got >= lo - 1e-12).all())  # Q <= pi_T^2 always gives the lower end
    # V = 10, mu uniform, list [0] (mu_cap = 0.1, mu_T = 0.9), pi = (0.9, 0.1 - 8e-6, 1e-6 x 8), k = 0
    mu = torch.full((10,), 0.1, dtype=F64)
    pi = torch.tensor([0.9, 0.1 - 8e-6] + [1e-6] * 8, dtype=F64)
    one = TokenBatch(
        pi[:1].log(),
        mu[:1].log(),
        torch.tensor([0]),
        torch.tensor([[0]]),
        mu[:1].log()[None],
        pi[:1].log()[None],
        torch.tensor([0]),
        10,
    )
    lo1, hi1 = ddot_kl_bracket(one)
    top = ddot_topk_exact(one, square_mass(pi.log()[None]))
    full1 = divergence_rate_full(mu.log()[None], pi.log()[None], torch.tensor([0]), "kl")
    assert float(lo1) <= float(full1) <= float(hi1)
    assert float(top) > float(hi1) + 0.05  # base + Q (mu_T/pi_T - 1) ~ base + 0.08 against hi ~ base + 0.009


def test_shape_is_checked():
    rows = random_rows(1, 3, 8, 2)
    b = make_batch(rows, 8)
    with pytest.raises(ValueError, match="pi_sq_sum"):
        ddot_topk_exact(b, torch.ones(2, dtype=F64))


def test_divergence_unchanged_and_float32_close():
    rows = random_rows(6, 50, 20, 5)
    b, got = exact_rate(rows, 20)
    b32 = TokenBatch(
        b.logp.float(),
        b.behavior_logp.float(),
        b.sampled_ids,
        b.topk_ids,
        b.topk_behavior_logp.float(),
        b.topk_logp.float(),
        b.seq_ids,
        b.vocab_size,
    )
    pi_sq = square_mass(torch.stack([r.pi_lp for r in rows]).float())
    got32 = ddot_topk_exact(b32, pi_sq)
    assert got32.dtype == torch.float32
    assert torch.allclose(got32.double(), got, atol=2e-6)
    assert torch.isfinite(divergence(b, "topk-kl")).all()


def test_chunked_square_mass_equals_the_dense_one():
    from masktrl.models.logprobs import token_square_mass

    g = torch.Generator().manual_seed(0)
    h, w, bias = torch.randn(13, 6, generator=g), torch.randn(40, 6, generator=g), torch.randn(40, generator=g)
    got = token_square_mass(h, w, temperature=0.7, chunk_size=4, bias=bias)
    want = square_mass(torch.log_softmax((h.double() @ w.double().t() + bias.double()) / 0.7, -1))
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, rtol=1e-5)


def test_pdm_tail_exact_masks_on_the_topk_rate_and_refuses_without_full_pi():
    from masktrl.methods import make_params, token_losses

    rows = random_rows(9, 60, 20, 4)
    b, rate = exact_rate(rows, 20)
    with pytest.raises(ValueError, match="tail=exact needs"):
        token_losses("pdm", b, torch.ones(60, dtype=F64), tail="exact")
    from dataclasses import replace

    bb = replace(b, pi_sq_sum=square_mass(torch.stack([r.pi_lp for r in rows])))
    adv = torch.where(torch.arange(60) % 2 == 0, 1.0, -1.0).to(F64)
    out = token_losses("pdm", bb, adv, tail="exact", delta_pos=0.0, delta_neg=0.0)
    d = divergence(bb, "topk-kl")
    want = (d > 0) & (torch.sign(adv * rate) > 0)
    assert torch.equal(out.mask, want) and torch.allclose(out.ddot, rate)
    assert bool(want.any()) and not bool(want.all())
    assert make_params("pdm", tail="exact").uses_full_pi and not make_params("pdm").uses_full_pi
    with pytest.raises(ValueError, match="tail=exact requires method.divergence=kl"):
        make_params("pdm", tail="exact", divergence="tv")
