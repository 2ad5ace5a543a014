"""train.gradient_checkpointing: per-layer activation checkpointing with the shared-prompt
forward kept (prompt pass unchecked, read-only cache in the checkpointed response pass), the
same numbers as without it, and a visible fallback where transformers cannot keep the cache."""

import pytest
import torch

from masktrl.models import checkpointing
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from masktrl.rl import policy
from tests.test_prompt_sharing import _samples


@pytest.fixture()
def tiny():
    tok = build_char_tokenizer("0123456789+=")
    model = build_tiny_model(tok, TinyModelConfig(hidden_size=64, intermediate_size=128), seed=0).eval()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ["12+3=", "1+2=", "345+67=", "8="]]
    return model, tok, prompts


def _grads(model, samples, share=None):
    model.train()
    model.zero_grad(set_to_none=True)
    out = policy.policy_token_batch(model, samples, temperature=0.9, chunk=7, share=share)
    (out.batch.logp * out.advantages).sum().add(out.batch.topk_logp.sum() * 1e-3).backward()
    model.eval()
    return out, {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("share", [True, False], ids=["shared-prompt", "whole-sequence"])
def test_checkpointed_forward_and_gradients_equal_the_plain_ones_bit_for_bit(tiny, share):
    model = tiny[0]
    samples = _samples(tiny)
    plain, g_plain = _grads(model, samples, share)
    checkpointing.enable(model)
    assert checkpointing.is_enabled(model) and checkpointing.shared_prompt_supported(model.base_model)
    ckpt, g_ckpt = _grads(model, samples, share)
    assert plain.shared_prompt is ckpt.shared_prompt is share  # the path asked for is the path that ran
    assert torch.equal(plain.batch.logp, ckpt.batch.logp) and torch.equal(plain.batch.topk_logp, ckpt.batch.topk_logp)
    assert all(torch.equal(g_plain[k], g_ckpt[k]) for k in g_plain)
    assert checkpointing.is_enabled(model)  # the prompt pass switched it off for itself only


def test_layers_are_really_replayed_in_the_backward_pass(tiny, monkeypatch):
    model, samples = tiny[0], _samples(tiny)
    checkpointing.enable(model)
    calls = []
    layer = model.base_model.layers[0]
    real = layer.mlp.forward
    monkeypatch.setattr(layer.mlp, "forward", lambda *a, **k: calls.append(torch.is_grad_enabled()) or real(*a, **k))
    _grads(model, samples, share=True)
    # prompt pass (not checkpointed), response pass, and its replay during backward
    assert len(calls) == 3


def test_unsupported_transformers_falls_back_to_whole_sequences(tiny, monkeypatch):
    model = tiny[0]
    checkpointing.enable(model)
    monkeypatch.setattr(checkpointing, "shared_prompt_supported", lambda base: False)
    out, _ = _grads(model, _samples(tiny))
    assert out.shared_prompt is False


def test_read_only_cache_returns_what_a_dynamic_cache_would_and_stores_nothing():
    from masktrl.models.kvcache import new_cache

    cfg = build_tiny_model(
        build_char_tokenizer("01"),
        TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64),
        seed=0,
    ).config
    k0, v0, k1, v1 = (torch.randn(2, 1, n, 16) for n in (3, 3, 2, 2))
    a, b = new_cache(cfg), new_cache(cfg)
    a.update(k0, v0, 0), b.update(k0, v0, 0)
    checkpointing.read_only(b)
    ka, va = a.update(k1, v1, 0)
    kb, vb = b.update(k1, v1, 0)
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert b.get_seq_length() == 3 and a.get_seq_length() == 5
    kb2, _ = b.update(k1, v1, 0)  # the replay sees the same cache
    assert torch.equal(kb2, kb)
