"""The differentiable chunked entropy (the entropy bonus, docs/METHODS.md §13.3): its gradient
against autograd of the full-softmax entropy in float64, alone and together with the log-probs,
the unchanged no-gradient path, and the memory bound (never a [N, V] tensor)."""

from __future__ import annotations

import pytest
import torch

from masktrl.models.logprobs import token_logprobs, token_logprobs_and_entropy
from tests.test_logprobs import F64, LargestTensor, inputs, naive


@pytest.mark.parametrize("chunk", [1, 5, 39, 1000])  # N = 39
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("bias", [False, True])
def test_entropy_gradient_matches_full_softmax_autograd(chunk, temperature, bias):
    hidden, weight, b, ids = inputs(100 + chunk, bias=bias)
    lp, ent = token_logprobs_and_entropy(
        hidden, weight, ids, temperature=temperature, chunk_size=chunk, bias=b, entropy_grad=True
    )
    ref_lp, ref_ent = naive(hidden, weight, ids, temperature, b)
    assert ent.requires_grad and torch.allclose(ent, ref_ent, atol=1e-12)
    gen = torch.Generator().manual_seed(chunk)
    g_lp = torch.randn(lp.shape, generator=gen, dtype=F64)
    g_ent = torch.randn(ent.shape, generator=gen, dtype=F64)
    params = [hidden, weight] + ([b] if bias else [])
    # both outputs used, as in a loss with an entropy bonus
    got = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), params)
    want = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), params)
    for x, y in zip(got, want):
        assert torch.allclose(x, y, atol=1e-11)
    # the entropy alone (the log-probs unused)
    lp, ent = token_logprobs_and_entropy(
        hidden, weight, ids, temperature=temperature, chunk_size=chunk, bias=b, entropy_grad=True
    )
    got = torch.autograd.grad((ent * g_ent).sum(), params)
    _, ref_ent = naive(hidden, weight, ids, temperature, b)
    want = torch.autograd.grad((ref_ent * g_ent).sum(), params)
    for x, y in zip(got, want):
        assert torch.allclose(x, y, atol=1e-11)


def test_entropy_gradient_by_hand_on_one_row():
    # H(softmax(x)) with x = h W^T: dH/dx_i = -p_i (log p_i + H); the hidden gradient is W^T of it
    h = torch.tensor([[0.3, -1.2]], dtype=F64, requires_grad=True)
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]], dtype=F64)
    _, ent = token_logprobs_and_entropy(h, w, torch.zeros(1, 1, dtype=torch.long), entropy_grad=True)
    (gh,) = torch.autograd.grad(ent.sum(), h)
    x = (h.detach() @ w.T)[0]
    p = torch.softmax(x, 0)
    H = -(p * p.log()).sum()
    assert torch.allclose(ent.detach(), H.reshape(1), atol=1e-15)
    assert torch.allclose(gh[0], (-p * (p.log() + H)) @ w, atol=1e-15)


def test_without_entropy_grad_nothing_changes():
    hidden, weight, b, ids = inputs(7)
    lp0 = token_logprobs(hidden, weight, ids, chunk_size=6, bias=b)
    g0 = torch.autograd.grad(lp0.sum(), [hidden, weight, b])
    lp1, ent1 = token_logprobs_and_entropy(hidden, weight, ids, chunk_size=6, bias=b)
    assert not ent1.requires_grad
    g1 = torch.autograd.grad(lp1.sum(), [hidden, weight, b])
    # with entropy_grad=True but the entropy unused: the same backward, bit for bit
    lp2, ent2 = token_logprobs_and_entropy(hidden, weight, ids, chunk_size=6, bias=b, entropy_grad=True)
    g2 = torch.autograd.grad(lp2.sum(), [hidden, weight, b])
    assert torch.equal(lp0, lp1) and torch.equal(lp1, lp2) and torch.equal(ent1, ent2.detach())
    for x, y, z in zip(g0, g1, g2):
        assert torch.equal(x, y) and torch.equal(y, z)


def test_entropy_backward_holds_two_chunks_of_logits_at_most():
    n, h, v, chunk = 96, 8, 500, 16
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).requires_grad_(True)
    weight = torch.randn(v, h, generator=gen).requires_grad_(True)
    ids = torch.randint(0, v, (n, 3), generator=gen)
    with LargestTensor() as mode:
        lp, ent = token_logprobs_and_entropy(hidden, weight, ids, chunk_size=chunk, entropy_grad=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
    assert mode.largest <= max(chunk * v, v * h)  # each buffer is one [chunk, V]; never [N, V]
