"""Per-group prompt sharing changes the work, not the numbers.

The HF engine prefills each prompt once for its n samples, and the policy forward runs each
distinct prompt once and continues every response from its KV cache. Both must give what
the plain paths (every sequence runs its own prompt) give.
"""

import random

import pytest
import torch

from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from masktrl.rl import policy
from masktrl.rollout import hf
from masktrl.rollout.base import Sample, SamplingSettings
from masktrl.rollout.hf import HFEngine


@pytest.fixture(scope="module")
def tiny():
    tok = build_char_tokenizer("0123456789+=")
    model = build_tiny_model(tok, TinyModelConfig(hidden_size=64, intermediate_size=128), seed=0).eval()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ["12+3=", "1+2=", "345+67=", "8="]]
    return model, tok, prompts


def _unshared(monkeypatch):
    monkeypatch.setattr(
        hf,
        "shared_prefill",
        lambda model, ids, att, n: {"input_ids": ids, "attention_mask": att, "num_return_sequences": n},
    )
    monkeypatch.setattr(
        policy, "_distinct_prompts", lambda samples: ([s.prompt_ids for s in samples], list(range(len(samples))))
    )


def test_shared_prefill_samples_and_records_what_num_return_sequences_does(tiny, monkeypatch):
    model, tok, prompts = tiny
    s = SamplingSettings(n=4, max_new_tokens=6, temperature=0.8, logprobs_k=5)
    shared = HFEngine(model, tok).generate(prompts, s, seed=3)
    _unshared(monkeypatch)
    plain = HFEngine(model, tok).generate(prompts, s, seed=3)
    for ga, gb in zip(shared, plain):
        for a, b in zip(ga, gb):
            assert a.response_ids == b.response_ids and a.topk_ids == b.topk_ids and a.finished == b.finished
            torch.testing.assert_close(torch.tensor(a.logp), torch.tensor(b.logp), atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.tensor(a.topk_logp), torch.tensor(b.topk_logp), atol=1e-5, rtol=0)


def _samples(tiny, seed=0, truncate=None):
    model, tok, prompts = tiny
    gens = HFEngine(model, tok).generate(prompts, SamplingSettings(n=3, max_new_tokens=5, logprobs_k=4), seed=seed)
    out = []
    for g, (p, group) in enumerate(zip(prompts, gens)):
        for gen in group:
            if truncate:
                gen.response_ids, gen.logp, gen.topk_ids, gen.topk_logp = (
                    x[:truncate] for x in (gen.response_ids, gen.logp, gen.topk_ids, gen.topk_logp)
                )
            out.append(Sample(f"e{g}", "", "", p, g, gen, advantage=random.Random(len(out)).uniform(-1, 1)))
    random.Random(seed).shuffle(out)  # groups interleaved, as after the minibatch permutation
    return out


def _forward_backward(model, samples):
    model.zero_grad(set_to_none=True)
    out = policy.policy_token_batch(model, samples, temperature=0.9, chunk=7)
    (out.batch.logp * out.advantages).sum().add(out.batch.topk_logp.sum() * 1e-3).backward()
    return out, {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("truncate", [None, 1])  # 1: every response is a single token
def test_shared_prompt_forward_equals_whole_sequences(tiny, monkeypatch, truncate):
    model = tiny[0].train()
    samples = _samples(tiny, truncate=truncate)
    calls = []
    shared = policy.shared_prompt_hidden
    monkeypatch.setattr(policy, "shared_prompt_hidden", lambda *args: calls.append(1) or shared(*args))
    a, ga = _forward_backward(model, samples)
    assert calls == [1]  # the shared path ran
    with monkeypatch.context() as m:
        _unshared(m)
        b, gb = _forward_backward(model, samples)
    model.eval()
    for name in ("logp", "topk_logp"):
        torch.testing.assert_close(getattr(a.batch, name), getattr(b.batch, name), atol=1e-5, rtol=0)
    torch.testing.assert_close(a.entropy, b.entropy, atol=1e-5, rtol=0)
    assert torch.equal(a.batch.seq_ids, b.batch.seq_ids) and torch.equal(a.batch.sampled_ids, b.batch.sampled_ids)
    for k in gb:
        torch.testing.assert_close(ga[k], gb[k], atol=1e-6 * max(1.0, gb[k].abs().max().item()), rtol=1e-4)
