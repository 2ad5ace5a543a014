"""SIS with its own list size (method.k, §6.2) and the exact full-vocabulary envelope when the
lists cover the vocabulary: with K = V the decisions are those of the full-vocabulary rejection
sampler, and its accepted tokens are distributed as pi."""

from __future__ import annotations

import pytest
import torch

from masktrl.methods import TokenBatch, make_params, sis_accept, token_losses, truncate_topk
from tests.test_methods_reference import F64, make_batch, random_rows


def test_full_lists_equal_the_full_vocabulary_rejection_sampler():
    v = 12
    rows = random_rows(4, 300, v, v, zero_mass=False, padding=False, duplicates=False)
    b = make_batch(rows, v)
    u = torch.rand(300, generator=torch.Generator().manual_seed(1), dtype=F64)
    dec = sis_accept(b, u)
    mu = torch.stack([r.mu_lp for r in rows]).exp()
    pi = torch.stack([r.pi_lp for r in rows]).exp()
    k = b.sampled_ids
    m_star = (pi / mu).amax(dim=1)  # the exact envelope max_i pi_i / mu_i over supp mu (all of V here)
    r = pi.gather(1, k[:, None])[:, 0] / mu.gather(1, k[:, None])[:, 0]
    a_ref = torch.clamp(r / m_star, max=1.0)
    assert torch.allclose(dec.accept_prob, a_ref, rtol=1e-12)
    assert torch.equal(dec.accepted, u < a_ref)


def test_exact_envelope_accepts_tokens_distributed_as_pi():
    """Monte Carlo of one token position: k ~ mu, accept with min(1, r/M*): accepted ~ pi, rate 1/M*."""
    g = torch.Generator().manual_seed(0)
    v, n = 6, 200_000
    mu = torch.softmax(torch.randn(v, generator=g, dtype=F64), 0)
    pi = torch.softmax(torch.randn(v, generator=g, dtype=F64), 0)
    k = torch.multinomial(mu, n, replacement=True, generator=g)
    ids = torch.arange(v).repeat(n, 1)
    b = TokenBatch(pi.log()[k], mu.log()[k], k, ids, mu.log().repeat(n, 1), pi.log().repeat(n, 1), torch.arange(n), v)
    dec = sis_accept(b, torch.rand(n, generator=g, dtype=F64))
    m_star = float((pi / mu).max())
    assert float(dec.accepted.double().mean()) == pytest.approx(1 / m_star, abs=0.005)
    freq = torch.bincount(k[dec.accepted], minlength=v).double() / dec.accepted.sum()
    assert float(0.5 * (freq - pi).abs().sum()) < 0.01


def test_method_k_recuts_the_list_for_the_envelope():
    rows = random_rows(7, 120, 30, 8)
    b = make_batch(rows, 30)
    u = torch.rand(120, generator=torch.Generator().manual_seed(2), dtype=F64)
    adv = torch.randn(120, generator=torch.Generator().manual_seed(3), dtype=F64)
    out = token_losses("sis", b, adv, u=u, k=3)
    want = sis_accept(truncate_topk(b, 3), u)
    assert torch.equal(out.accepted, want.accepted)
    assert not torch.equal(out.accepted, sis_accept(b, u).accepted)  # a smaller list changes decisions
    assert torch.equal(token_losses("sis", b, adv, u=u, k=8).accepted, sis_accept(b, u).accepted)  # k = stored K


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_method_k_is_validated(bad):
    with pytest.raises(ValueError, match="method.k must be an integer >= 1"):
        make_params("sis", k=bad)
