"""The transformers engine records exactly the distribution it samples from."""

import pytest
import torch

from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from masktrl.rollout.base import SamplingSettings
from masktrl.rollout.hf import HFEngine


@pytest.fixture(scope="module")
def engine():
    tok = build_char_tokenizer("0123456789+=")
    model = build_tiny_model(tok, TinyModelConfig(hidden_size=64, intermediate_size=128), seed=0).eval()
    return HFEngine(model, tok, batch_size=16)


def _recompute(engine, prompt, gen, temperature):
    ids = torch.tensor([prompt + gen.response_ids])
    logits = engine.model(ids).logits[0, len(prompt) - 1 : -1]  # predicts the response tokens
    return torch.log_softmax(logits.double() / temperature, -1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_logprobs_match_recomputation(engine, temperature):
    tok = engine.tokenizer
    prompts = [tok("12+3=", add_special_tokens=False)["input_ids"], tok("1+2=", add_special_tokens=False)["input_ids"]]
    s = SamplingSettings(n=3, max_new_tokens=6, temperature=temperature, logprobs_k=5)
    out = engine.generate(prompts, s, seed=1)
    assert [len(g) for g in out] == [3, 3]
    for prompt, group in zip(prompts, out):
        for gen in group:
            T = len(gen.response_ids)
            assert len(gen.logp) == len(gen.topk_ids) == len(gen.topk_logp) == T
            assert all(len(row) == 5 for row in gen.topk_ids)
            ref = _recompute(engine, prompt, gen, temperature)  # [T, V]
            got = torch.tensor(gen.logp, dtype=torch.float64)
            want = ref.gather(1, torch.tensor(gen.response_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
            top_lp, top_ids = ref.topk(5, -1)
            torch.testing.assert_close(torch.tensor(gen.topk_logp, dtype=torch.float64), top_lp, atol=2e-5, rtol=0)
            assert torch.equal(torch.tensor(gen.topk_ids), top_ids)
            assert all(a >= b for row in gen.topk_logp for a, b in zip(row, row[1:]))  # descending
            # EOS ends a finished response and appears nowhere else
            eos = tok.eos_token_id
            assert gen.finished == (gen.response_ids[-1] == eos)
            assert eos not in gen.response_ids[:-1]
            assert T <= 6


def test_same_seed_same_samples_and_global_rng_untouched(engine):
    tok = engine.tokenizer
    prompts = [tok("7+8=", add_special_tokens=False)["input_ids"]]
    s = SamplingSettings(n=4, max_new_tokens=5)
    state = torch.get_rng_state()
    a = engine.generate(prompts, s, seed=5)
    b = engine.generate(prompts, s, seed=5)
    c = engine.generate(prompts, s, seed=6)
    assert torch.equal(state, torch.get_rng_state())
    assert [g.response_ids for g in a[0]] == [g.response_ids for g in b[0]]
    assert [g.response_ids for g in a[0]] != [g.response_ids for g in c[0]]


def test_greedy_is_argmax(engine):
    tok = engine.tokenizer
    prompt = tok("5+5=", add_special_tokens=False)["input_ids"]
    (group,) = engine.generate([prompt], SamplingSettings(n=1, max_new_tokens=4, greedy=True), seed=0)
    gen = group[0]
    ids = torch.tensor([prompt + gen.response_ids])
    logits = engine.model(ids).logits[0, len(prompt) - 1 : -1]
    assert logits.argmax(-1).tolist() == gen.response_ids
