"""MoE routing decisions and the flip rate between a model and its low-precision copy (models/moe.py)."""

import math

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from masktrl.models.lowprec import LowPrecisionCopy
from masktrl.models.moe import moe_routers, routing, routing_flip_rate
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model


def tiny_moe(seed=0):
    cfg = Qwen3MoeConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for _, router, _ in moe_routers(model):
            router.weight.normal_(0, 0.5)  # transformers starts routers at zero: every token ties
    return model


def test_flip_rate_hand_computed():
    a = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    b = torch.tensor([[1, 0], [2, 4], [4, 5], [7, 6]])  # row 0 and 3: same sets in another order
    assert routing_flip_rate(a, b) == 0.25
    assert routing_flip_rate(a, b, torch.tensor([False, True, False, False])) == 1.0
    assert math.isnan(routing_flip_rate(a, b, torch.zeros(4, dtype=torch.bool)))
    with pytest.raises(ValueError):
        routing_flip_rate(a, b[:3])


def test_routing_of_a_moe_model_and_a_dense_one():
    model = tiny_moe()
    assert len(moe_routers(model)) == 2
    ids = torch.randint(0, 40, (3, 7))
    r = routing(model, ids)
    assert r.shape == (2, 3, 7, 2) and 0 <= r.min() and r.max() < 8
    manual = model.model.layers[0].mlp.gate  # the router's own choice: top-2 of softmax(h W^T)
    assert routing_flip_rate(r, routing(model, ids)) == 0.0  # deterministic
    assert manual.top_k == 2
    dense = build_tiny_model(
        build_char_tokenizer("0123"), TinyModelConfig(hidden_size=32, intermediate_size=64), seed=0
    )
    assert moe_routers(dense) == []
    with pytest.raises(ValueError, match="no MoE layers"):
        routing(dense, ids % 7)


def test_low_precision_copy_flips_some_routes():
    model = tiny_moe()
    ids = torch.randint(0, 40, (16, 12), generator=torch.Generator().manual_seed(1))
    full = routing(model, ids)
    same = routing(LowPrecisionCopy(model, torch.float32).model, ids)
    assert routing_flip_rate(full, same) == 0.0  # a float32 copy routes exactly as the model
    fp8 = routing(LowPrecisionCopy(model, torch.bfloat16, "fp8-act").model, ids)
    rate = routing_flip_rate(full, fp8)
    assert 0.0 < rate < 0.5


def test_a_batch_of_a_moe_policy_reports_routing_flips():
    from masktrl.rl.mismatch import measure_mismatch
    from masktrl.rollout.base import Sample, SamplingSettings
    from masktrl.rollout.hf import HFEngine

    tok = build_char_tokenizer("0123456789+=")
    model = tiny_moe()
    model.resize_token_embeddings(len(tok))
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("12+3=", "7+8=", "9+9=")]
    s = SamplingSettings(n=4, max_new_tokens=6, logprobs_k=5)

    def batch(engine):
        gens = engine.generate(prompts, s, seed=0)
        return [Sample(str(i), "", "", p, i, g) for i, (p, group) in enumerate(zip(prompts, gens)) for g in group]

    fp8 = HFEngine(model, tok, dtype="bfloat16", quantization="fp8-act")
    stats = measure_mismatch(model, model, fp8, batch(fp8), 1.0, 1024, pieces=2)
    assert stats["mismatch/tokens"] > 0 and stats["mismatch/logp_abs_mean"] > 0
    assert 0.0 < stats["mismatch/routing_flip_rate"] < 0.5
    plain = HFEngine(model, tok)
    stats = measure_mismatch(model, model, plain, batch(plain), 1.0, 1024)
    assert "mismatch/routing_flip_rate" not in stats and stats["mismatch/logp_abs_mean"] < 1e-4
