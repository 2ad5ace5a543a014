"""Chunked token log-probabilities against naive full log_softmax (values, gradients, entropy, memory)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from masktrl.models import logprobs
from masktrl.models.logprobs import token_entropy, token_logprobs, token_logprobs_and_entropy

F64 = torch.float64


def naive(hidden, weight, ids, temperature=1.0, bias=None):
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    lp = torch.log_softmax(logits / temperature, dim=-1)
    out = lp.gather(-1, ids.clamp_min(0))
    return out.masked_fill(ids < 0, 0.0), -(lp.exp() * lp).sum(-1)


def inputs(seed, lead=(3, 13), h=6, v=17, j=4, dtype=F64, bias=True):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, h, generator=gen, dtype=dtype).requires_grad_(True)
    weight = torch.randn(v, h, generator=gen, dtype=dtype).requires_grad_(True)
    b = torch.randn(v, generator=gen, dtype=dtype).requires_grad_(True) if bias else None
    ids = torch.randint(0, v, (*lead, j), generator=gen)
    pad = torch.rand(*lead, j, generator=gen) < 0.2
    ids[pad] = -1
    ids.view(-1, j)[0] = -1  # one row all padding
    return hidden, weight, b, ids


@pytest.mark.parametrize("chunk", [1, 5, 7, 39, 1000])  # N = 39: chunks that do not divide N, and one chunk
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_match_naive_float64(chunk, temperature, bias):
    hidden, weight, b, ids = inputs(chunk + int(10 * temperature), bias=bias)
    lp = token_logprobs(hidden, weight, ids, temperature=temperature, chunk_size=chunk, bias=b)
    ref, _ = naive(hidden, weight, ids, temperature, b)
    assert lp.shape == ids.shape and lp.dtype == F64
    assert torch.allclose(lp, ref, atol=1e-12)
    assert bool((lp[ids < 0] == 0).all())
    g = torch.randn_like(lp)
    params = [hidden, weight] + ([b] if bias else [])
    got = torch.autograd.grad((lp * g).sum(), params)
    want = torch.autograd.grad((ref * g).sum(), params)
    for x, y in zip(got, want):
        assert torch.allclose(x, y, atol=1e-12)


def test_entropy_matches_naive_and_has_no_gradient():
    hidden, weight, b, ids = inputs(3)
    lp, ent = token_logprobs_and_entropy(hidden, weight, ids, temperature=0.8, chunk_size=6, bias=b)
    ref_lp, ref_ent = naive(hidden, weight, ids, 0.8, b)
    assert torch.allclose(lp, ref_lp, atol=1e-12) and torch.allclose(ent, ref_ent, atol=1e-12)
    assert ent.shape == hidden.shape[:-1] and not ent.requires_grad
    alone = token_entropy(hidden, weight, temperature=0.8, chunk_size=4, bias=b)
    assert torch.allclose(alone, ref_ent, atol=1e-12)


@pytest.mark.parametrize("banned", [[], [2], [0, 5, 16]])
def test_entropy_with_minus_inf_logits_is_that_of_the_finite_ones(banned):
    """A -inf logit (a banned token's bias) has probability 0 and adds nothing to the entropy
    (its 0 * -inf term counts as 0), and the other log-probabilities are unchanged."""
    hidden, weight, b, ids = inputs(5)
    b = b.detach().clone()
    b[banned] = float("-inf")
    ids = ids.masked_fill(torch.isin(ids, torch.tensor(banned, dtype=ids.dtype)), -1)
    lp, ent = token_logprobs_and_entropy(hidden, weight, ids, temperature=0.9, chunk_size=7, bias=b)
    logits = (hidden @ weight.T + b) / 0.9
    p = torch.softmax(logits, dim=-1)
    want = -(p * torch.log_softmax(logits, dim=-1)).nan_to_num(nan=0.0).sum(-1)
    assert bool(torch.isfinite(ent).all()) and torch.allclose(ent, want, atol=1e-12)
    assert torch.allclose(token_entropy(hidden, weight, temperature=0.9, chunk_size=5, bias=b), want, atol=1e-12)
    ref_lp, _ = naive(hidden, weight, ids, 0.9, b)
    assert torch.allclose(lp, ref_lp, atol=1e-12)


def test_frozen_weight_and_float32_and_bfloat16():
    hidden, weight, _, ids = inputs(4, bias=False)
    w = weight.detach()
    lp = token_logprobs(hidden, w, ids, chunk_size=8)
    (gh,) = torch.autograd.grad(lp.sum(), hidden)
    (gh_ref,) = torch.autograd.grad(naive(hidden, w, ids)[0].sum(), hidden)
    assert torch.allclose(gh, gh_ref, atol=1e-12)
    h32, w32 = hidden.detach().float().requires_grad_(True), weight.detach().float()
    lp32 = token_logprobs(h32, w32, ids, chunk_size=8)
    assert lp32.dtype == torch.float32
    assert torch.allclose(lp32.double(), naive(hidden, weight, ids)[0].detach(), atol=1e-5)
    hb = hidden.detach().bfloat16().requires_grad_(True)
    wb = weight.detach().bfloat16().requires_grad_(True)
    lpb = token_logprobs(hb, wb, ids, chunk_size=8)
    assert lpb.dtype == torch.float32  # logits are computed in float32 at least
    ghb, gwb = torch.autograd.grad(lpb.sum(), [hb, wb])
    assert ghb.dtype == torch.bfloat16 and gwb.dtype == torch.bfloat16
    ref = naive(hb.detach().float(), wb.detach().float(), ids)[0]
    assert torch.allclose(lpb.detach(), ref, atol=1e-5)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) produced by any op while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_materialises_more_than_one_chunk_of_logits():
    n, h, v, chunk = 96, 8, 500, 16
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).requires_grad_(True)
    weight = torch.randn(v, h, generator=gen).requires_grad_(True)
    ids = torch.randint(0, v, (n, 3), generator=gen)
    with LargestTensor() as mode:
        lp = token_logprobs(hidden, weight, ids, chunk_size=chunk)
        lp.sum().backward()
    assert mode.largest <= max(chunk * v, v * h)  # one [chunk, V] buffer or the [V, H] weight grad
    ref = naive(hidden, weight, ids)[0].sum()
    with LargestTensor() as ref_mode:
        ref.backward()
    assert ref_mode.largest >= n * v  # the mode sees backward ops: it would catch a full [N, V] tensor


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_kept_logits_give_the_recomputed_backward_bit_for_bit(monkeypatch, entropy_grad):
    """One chunk within KEEP_LOGITS_BYTES: the backward reads the forward's logits instead of
    recomputing them; values and gradients are the same bits, a second backward (retain_graph)
    recomputes and agrees too, and nothing is kept without grad or over the budget."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(40, 16, generator=gen).requires_grad_(True)
    weight = torch.randn(300, 16, generator=gen).requires_grad_(True)
    bias = torch.randn(300, generator=gen).requires_grad_(True)
    ids = torch.randint(0, 300, (40, 5), generator=gen)
    ids[2, 1] = -1
    kept = []
    forward = logprobs._forward
    monkeypatch.setattr(logprobs, "_forward", lambda *a: kept.append(a[7]) or forward(*a))

    def run():
        lp, ent = token_logprobs_and_entropy(
            hidden, weight, ids, temperature=0.8, chunk_size=64, bias=bias, entropy_grad=entropy_grad
        )
        loss = (lp * torch.linspace(-1, 1, 5)).sum() + (ent.sum() if entropy_grad else 0.0)
        first = torch.autograd.grad(loss, [hidden, weight, bias], retain_graph=True)
        second = torch.autograd.grad(loss, [hidden, weight, bias])
        return [lp.detach(), ent.detach(), *first, *second]

    got = run()
    monkeypatch.setattr(logprobs, "KEEP_LOGITS_BYTES", 40 * 300 * 4 - 1)  # one byte short: recomputed
    want = run()
    assert kept == [True, False]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with torch.no_grad():
        token_logprobs(hidden, weight, ids, chunk_size=64)
    token_logprobs(hidden.detach(), weight.detach(), ids, chunk_size=64)
    token_logprobs(hidden, weight, ids, chunk_size=39).sum().backward()  # two chunks
    assert kept == [True, False, False, False, False]


def test_bad_arguments():
    hidden, weight, _, ids = inputs(5, bias=False)
    with pytest.raises(ValueError, match="ids must be < V"):
        token_logprobs(hidden, weight, ids.clamp_min(0) + 100)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(hidden, weight, ids, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(hidden, weight, ids, chunk_size=0)
    with pytest.raises(ValueError, match="weight"):
        token_logprobs(hidden, weight.T, ids)
    with pytest.raises(ValueError, match="ids must be an integer"):
        token_logprobs(hidden, weight, ids[:2])
