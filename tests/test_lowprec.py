"""Low-precision rollout copies: the FP8 round trip against a float64 reference, the choice of
quantised weights, and the transformers engine sampling from the copy (models/lowprec.py)."""

import math

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from masktrl.models.lowprec import E4M3_MAX, LowPrecisionCopy, fp8_roundtrip, fp8_scale, quantized_weights
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from masktrl.rollout.base import SamplingSettings
from masktrl.rollout.hf import HFEngine


def e4m3_grid() -> torch.Tensor:
    """Every non-negative finite float8_e4m3fn value in float64, ascending, built from the format's
    definition (4 exponent bits, bias 7, 3 mantissa bits, no inf, S.1111.111 is NaN), not from torch:
    index i of the grid is the value's bit pattern, so an even index has an even mantissa."""
    vals = [m / 8 * 2.0**-6 for m in range(8)]  # subnormals (and 0)
    vals += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if (e, m) != (15, 7)]
    return torch.tensor(vals, dtype=torch.float64)


def round_e4m3_ref(y: torch.Tensor) -> torch.Tensor:
    """float64 round-to-nearest-even onto the e4m3 grid, saturating at 448 (y already clamped)."""
    grid = e4m3_grid()
    a = y.abs().clamp(max=E4M3_MAX)
    hi = torch.searchsorted(grid, a).clamp(max=len(grid) - 1)  # first grid value >= a
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.sign(y) * torch.where(pick_hi, grid[hi], grid[lo])


def fp8_ref(x: torch.Tensor) -> torch.Tensor:
    """The round trip in float64 from its definition: s = amax(|row|) / 448 (1 for a zero row),
    x_hat = round_e4m3(x / s) * s."""
    x = x.double()
    s = x.abs().amax(dim=-1, keepdim=True) / 448.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    return round_e4m3_ref(x / s) * s


def test_grid_is_e4m3():
    grid = e4m3_grid()
    assert len(grid) == 127 and grid[-1] == 448.0 == torch.finfo(torch.float8_e4m3fn).max
    assert grid[1] == 2.0**-9  # smallest subnormal


def test_torch_cast_rounds_to_nearest_even_on_the_grid():
    grid = e4m3_grid()
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties: must go to the even pattern
    g = torch.Generator().manual_seed(0)
    rand = torch.rand(20000, generator=g, dtype=torch.float64) * 448
    tiny = torch.rand(2000, generator=g, dtype=torch.float64) * 2.0**-5  # subnormal range
    y = torch.cat([grid, mids, rand, tiny, -rand[:500]]).float().double()  # float32-representable
    got = y.float().to(torch.float8_e4m3fn).double()
    assert torch.equal(got, round_e4m3_ref(y))


def test_roundtrip_matches_float64_reference():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 2, 64)[:, None]  # rows of very different scales
    w[3, 7] = 40.0  # an outlier: its row's scale
    got = fp8_roundtrip(w).double()
    ref = fp8_ref(w)
    # float32 computes s, x / s and q * s with one rounding each: the results agree with the float64
    # reference to float32 precision, except where x / s lies within a float32 rounding of an
    # e4m3 rounding boundary (then one e4m3 step apart)
    same = (got - ref).abs() <= ref.abs() * 2.0**-22
    assert same.float().mean() > 0.999
    step = (ref.abs() / 8).clamp_min(fp8_scale(w).double().expand_as(ref) * 2.0**-9)
    assert ((got - ref).abs() <= step * 1.0001).all()
    torch.testing.assert_close(fp8_scale(w).double().squeeze(1), w.double().abs().amax(1) / 448, rtol=1e-7, atol=0)
    # relative error of a normal e4m3 value is at most 2^-4 (half a step of a 3-bit mantissa)
    big = w.double().abs() >= fp8_scale(w).double() * 2.0**-6
    assert ((got - w.double()).abs()[big] <= w.double().abs()[big] * 2.0**-4 * 1.0001).all()


def test_saturation_zero_rows_and_scale_invariance():
    w = torch.tensor([[0.0, 0.0, 0.0], [1.0, -2.0, 3.0], [1e30, -1e30, 5.0], [-7.0, 0.0, 0.0]])
    out = fp8_roundtrip(w)
    assert torch.equal(out[0], torch.zeros(3)) and torch.isfinite(out).all()
    for row in range(1, 4):  # each row's amax maps to 448 and back to itself (float32 rounding of s * 448)
        i = w[row].abs().argmax()
        assert math.isclose(out[row, i].item(), w[row, i].item(), rel_tol=1e-6)
    assert out[2, 2] == 0.0  # 5 / (1e30 / 448) underflows e4m3: flushed to 0
    # x / s never leaves [-448, 448]: a value just over it (float32 rounding) saturates instead of NaN
    edge = torch.tensor([[448.0, 448.00003]])
    assert torch.isfinite(fp8_roundtrip(edge)).all()
    # one scale per row: scaling a row by 2^k scales its result by exactly 2^k, other rows unchanged
    w2 = w.clone()
    w2[1] *= 2.0**5
    out2 = fp8_roundtrip(w2)
    assert torch.equal(out2[1], out[1] * 2.0**5) and torch.equal(out2[3], out[3])
    assert fp8_roundtrip(torch.tensor([[float("nan"), 1.0]]))[0, 0].isnan()  # NaN stays NaN


def test_roundtrip_dtype_and_3d_experts():
    w = torch.randn(4, 8, 16)  # [E, out, in]: one scale per (expert, output channel)
    out = fp8_roundtrip(w, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and fp8_scale(w).shape == (4, 8, 1)
    assert torch.equal(out, fp8_ref(w).to(torch.bfloat16)) or (out.double() - fp8_ref(w)).abs().max() < 0.02


@pytest.fixture(scope="module")
def tiny():
    tok = build_char_tokenizer("0123456789+=")
    model = build_tiny_model(tok, TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2), seed=0).eval()
    return model, tok


def test_quantized_weights_follow_vllm_layer_choice(tiny):
    model, _ = tiny
    names = quantized_weights(model)
    assert len(names) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert all(
        n.endswith(
            (
                "q_proj.weight",
                "k_proj.weight",
                "v_proj.weight",
                "o_proj.weight",
                "gate_proj.weight",
                "up_proj.weight",
                "down_proj.weight",
            )
        )
        for n in names
    )
    assert "lm_head.weight" not in names and not any("embed" in n or "norm" in n for n in names)


def tiny_moe():
    """A one-layer Qwen3-MoE of eight experts, two per token (shared with tests/test_fp8_training.py)."""
    cfg = Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
    )
    return Qwen3MoeForCausalLM(cfg)


def test_quantized_weights_moe_experts_not_router():
    model = tiny_moe()
    names = quantized_weights(model)
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.mlp.experts.down_proj" in names
    assert not any(n.startswith("model.layers.0.mlp.gate") for n in names)


def test_copy_differs_is_rebuilt_and_leaves_the_policy_alone(tiny):
    model, _ = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cp = LowPrecisionCopy(model, torch.float32, "fp8")
    q = "model.layers.0.self_attn.q_proj.weight"
    p_copy, p_src = dict(cp.model.named_parameters()), dict(model.named_parameters())
    assert torch.equal(p_copy[q], fp8_roundtrip(p_src[q].detach())) and not torch.equal(p_copy[q], p_src[q])
    assert torch.equal(p_copy["lm_head.weight"], p_src["lm_head.weight"])  # not quantised
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the policy is untouched
    changed = build_tiny_model(
        build_char_tokenizer("0123456789+="),
        TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2),
        seed=1,
    )
    cp.refresh(changed)
    assert torch.equal(
        dict(cp.model.named_parameters())[q], fp8_roundtrip(dict(changed.named_parameters())[q].detach())
    )
    bf = LowPrecisionCopy(model, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf.model.parameters())
    assert all(b.dtype == torch.float32 for n, b in bf.model.named_buffers() if "inv_freq" in n)  # rotary stays float32


def test_fp8_act_quantises_layer_inputs(tiny):
    model, _ = tiny
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    w_only = LowPrecisionCopy(model, torch.float32, "fp8").model(ids).logits
    act = LowPrecisionCopy(model, torch.float32, "fp8-act").model(ids).logits
    assert not torch.equal(w_only, act) and (w_only - act).abs().max() < 1.0


def _prompts(tok):
    return [tok("12+3=", add_special_tokens=False)["input_ids"], tok("7+8=", add_special_tokens=False)["input_ids"]]


def test_engine_float32_is_the_model_itself(tiny):
    model, tok = tiny
    s = SamplingSettings(n=3, max_new_tokens=5, logprobs_k=5)
    plain, f32 = HFEngine(model, tok), HFEngine(model, tok, dtype="float32")
    assert f32.model is model and f32.copy is None
    a, b = plain.generate(_prompts(tok), s, seed=3), f32.generate(_prompts(tok), s, seed=3)
    assert [[(g.response_ids, g.logp, g.topk_ids, g.topk_logp) for g in grp] for grp in a] == [
        [(g.response_ids, g.logp, g.topk_ids, g.topk_logp) for g in grp] for grp in b
    ]


@pytest.mark.parametrize("dtype,quant", [("bfloat16", None), ("float16", None), (None, "fp8"), ("bfloat16", "fp8")])
def test_engine_records_the_copys_distribution(tiny, dtype, quant):
    model, tok = tiny
    eng = HFEngine(model, tok, dtype=dtype, quantization=quant)
    assert eng.model is not model and eng.policy is model
    s = SamplingSettings(n=4, max_new_tokens=5, logprobs_k=5)
    gaps_copy, gaps_policy = [], []
    with torch.no_grad():
        for prompt, group in zip(_prompts(tok), eng.generate(_prompts(tok), s, seed=2)):
            for g in group:
                ids = torch.tensor([prompt + g.response_ids])
                resp = torch.tensor(g.response_ids)[:, None]
                lp_copy = torch.log_softmax(eng.model(ids).logits[0, len(prompt) - 1 : -1].float(), -1).gather(1, resp)
                lp_pol = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1).gather(1, resp)
                rec = torch.tensor(g.logp)[:, None]
                gaps_copy.append((rec - lp_copy).abs().max())
                gaps_policy.append((rec - lp_pol).abs().max())
    assert max(gaps_policy) > 0  # the copy is not the policy
    tol = 1e-5 if dtype is None else 0.05  # a bfloat16 forward with and without the KV cache rounds differently
    assert max(gaps_copy) <= tol and max(gaps_copy) < max(gaps_policy)


def test_engine_sync_remakes_the_copy(tiny):
    model, tok = tiny
    eng = HFEngine(model, tok, dtype="bfloat16")
    other = build_tiny_model(tok, TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2), seed=5)
    eng.sync_weights(other)
    assert eng.policy is other
    for (n, p), q in zip(eng.model.named_parameters(), other.parameters()):
        assert torch.equal(p, q.detach().to(torch.bfloat16)), n


def test_fp8_full_quantises_the_output_layer_too(tiny):
    model, _ = tiny
    full = LowPrecisionCopy(model, torch.float32, "fp8-full")
    assert full.quantized == set(quantized_weights(model)) | {"lm_head.weight"}
    head = dict(full.model.named_parameters())["lm_head.weight"]
    assert torch.equal(head, fp8_roundtrip(model.lm_head.weight.detach()))
    assert len(full._hooks) == len(full.quantized)  # every quantised layer's input too
