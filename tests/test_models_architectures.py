"""The tiny model in every architecture of ``model.architecture``: the default is today's Qwen3
bit for bit, each architecture's chunked log-probabilities are its own logits', and the
shared-prompt forward equals the whole-sequence one wherever ``shared_prompt_cache_ok`` allows
it (and is refused, with the reason, where it would be wrong)."""

import random

import pytest
import torch

from masktrl.errors import MasktrlError
from masktrl.models import checkpointing
from masktrl.models.architectures import ARCHITECTURES, check_lm_head, get_architecture, shared_prompt_cache_ok
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from masktrl.rl import policy
from masktrl.rollout.base import Sample, SamplingSettings
from masktrl.rollout.hf import HFEngine

SLIDING = {"mistral", "gemma2", "gemma3"}  # the architectures whose KV cache keeps a sliding window
SHAPE = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer("0123456789+=")


def _samples(model, tok, seed=0):
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ["12+3=", "1+2=", "345+67=89+1=", "8="]]
    gens = HFEngine(model, tok).generate(prompts, SamplingSettings(n=3, max_new_tokens=10, logprobs_k=4), seed=seed)
    out = [
        Sample(f"e{g}", "", "", p, g, gen, advantage=random.Random(g * 7 + j).uniform(-1, 1))
        for g, (p, group) in enumerate(zip(prompts, gens))
        for j, gen in enumerate(group)
    ]
    random.Random(seed).shuffle(out)  # groups interleaved
    return out


def test_default_architecture_is_the_qwen3_model_built_before(tok):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = TinyModelConfig()
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(5)
        reference = Qwen3ForCausalLM(config)
    model = build_tiny_model(tok, cfg, seed=5)
    assert type(model) is Qwen3ForCausalLM and model.config.to_dict() == reference.config.to_dict()
    ref = reference.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items()) and set(ref) == set(model.state_dict())


def test_unknown_architecture_is_one_line_naming_the_choices(tok):
    with pytest.raises(MasktrlError, match="unknown model.architecture 'gpt5'.*llama.*qwen3-moe"):
        get_architecture("gpt5")


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_log_probs_and_shared_prompt(tok, name, monkeypatch):
    model = build_tiny_model(tok, SHAPE, seed=0, architecture=name)
    check_lm_head(model)
    ok, why = shared_prompt_cache_ok(model.base_model)
    assert ok == (name not in SLIDING) and (ok or "sliding" in why)
    samples = _samples(model, tok)
    model.train()
    whole = policy.policy_token_batch(model, samples, temperature=1.0, chunk=7, share=False)
    # the chunked top-K log-probs are log_softmax of the model's own logits at the listed ids
    seq = samples[0].prompt_ids + samples[0].gen.response_ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0, len(samples[0].prompt_ids) - 1 : -1]  # [T, V]
    ref = torch.log_softmax(logits.double(), -1)
    t = len(samples[0].gen.response_ids)
    ids = torch.cat([whole.batch.sampled_ids[:t, None], whole.batch.topk_ids[:t]], 1)  # sample 0's tokens come first
    got = torch.cat([whole.batch.logp[:t, None], whole.batch.topk_logp[:t]], 1)
    torch.testing.assert_close(got.double(), ref.gather(1, ids), atol=1e-5, rtol=0)
    # and equal the rollout engine's behaviour log-probs at the same weights (T = 1)
    torch.testing.assert_close(whole.batch.logp.double(), whole.batch.behavior_logp.double(), atol=1e-5, rtol=0)
    shared = policy.policy_token_batch(model, samples, temperature=1.0, chunk=7, share=True)
    assert shared.shared_prompt == ok  # the policy falls back where the cache cannot be shared
    gap = (shared.batch.logp - whole.batch.logp).abs().max().item()
    assert gap < 1e-5
    torch.testing.assert_close(shared.batch.topk_logp, whole.batch.topk_logp, atol=1e-5, rtol=0)
    if not ok:  # why: forced through the shared cache, log pi would be silently wrong
        monkeypatch.setattr(policy, "shared_prompt_cache_ok", lambda base: (True, ""))
        forced = policy.policy_token_batch(model, samples, temperature=1.0, chunk=7, share=True)
        assert forced.shared_prompt and (forced.batch.logp - whole.batch.logp).abs().max().item() > 1e-3


@pytest.mark.parametrize("name", sorted(set(ARCHITECTURES) - SLIDING))
def test_shared_prompt_under_gradient_checkpointing(tok, name):
    model = build_tiny_model(tok, SHAPE, seed=1, architecture=name)
    samples = _samples(model, tok, seed=1)
    model.train()

    def grads():
        model.zero_grad(set_to_none=True)
        out = policy.policy_token_batch(model, samples, temperature=0.9, chunk=5, share=True)
        (out.batch.logp * out.advantages).sum().backward()
        return out.batch.logp.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    lp_plain, g_plain = grads()
    checkpointing.enable(model)
    assert checkpointing.shared_prompt_supported(model.base_model)
    lp_ckpt, g_ckpt = grads()
    torch.testing.assert_close(lp_ckpt, lp_plain, atol=1e-6, rtol=0)
    assert set(g_ckpt) == set(g_plain)
    for k in g_plain:
        torch.testing.assert_close(
            g_ckpt[k], g_plain[k], atol=1e-6 * max(1.0, g_plain[k].abs().max().item()), rtol=1e-5
        )


def test_soft_capped_head_is_refused(tok):
    model = build_tiny_model(tok, SHAPE, seed=0, architecture="gemma2")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(MasktrlError, match="final_logit_softcapping=30.0 is not supported"):
        check_lm_head(model)


def test_a_head_that_is_not_the_linear_layer_is_caught(tok):
    model = build_tiny_model(tok, SHAPE, seed=0, architecture="llama")
    head = model.lm_head
    orig = head.forward
    head.forward = lambda h: orig(h) * 2.0  # a hidden scale the config does not name
    with pytest.raises(MasktrlError, match="not the linear head"):
        check_lm_head(model)
