"""A policy trained with 16-bit weights outside DeepSpeed is warned about (masktrl/rl/start.py:
sixteen_bit_weights_warning): torch's AdamW updates such weights in their own dtype, with no
float32 master copy, so an update smaller than half a weight's spacing rounds away. The threshold
the warning names is checked against AdamW itself."""

import pytest
import torch

from masktrl.rl.start import _HALF_SPACING, sixteen_bit_weights_warning
from tests.conftest import cli, write_tiny_config


def _model(dtype):
    from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer("0123456789+=")
    cfg = TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)
    return build_tiny_model(tok, cfg, seed=0).to(dtype)


def test_the_warning_names_the_dtype_and_threshold_of_16_bit_trainable_weights():
    assert sixteen_bit_weights_warning(_model(torch.float32), 1e-6, deepspeed=False) is None
    bf16 = sixteen_bit_weights_warning(_model(torch.bfloat16), 1e-6, deepspeed=False)
    assert bf16.startswith("warning: the policy's trainable weights are bfloat16") and "2^-9" in bf16
    assert "train.lr=1e-06" in bf16 and "\n" not in bf16
    assert "2^-12" in sixteen_bit_weights_warning(_model(torch.float16), 1e-6, deepspeed=False)
    assert sixteen_bit_weights_warning(_model(torch.bfloat16), 1e-6, deepspeed=True) is None  # float32 masters


def test_frozen_16_bit_weights_under_float32_trainables_are_not_warned_about():
    """As LoRA trains float32 adapters over a frozen 16-bit base: only trainable weights count."""
    model = _model(torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(False)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().float())
    assert sixteen_bit_weights_warning(model, 1e-6, deepspeed=False) is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_adamw_loses_every_update_below_the_named_share_of_a_weight(dtype):
    """AdamW's first step is lr in size (m / sqrt(v) = sign(g), eps aside; gradients of size 1, so
    that float16's v does not underflow). On weights of [1, 2) a step of just under the warning's
    share of 1 leaves every 16-bit weight as it was and moves every float32 one; a step of twice
    the share moves 16-bit weights too (the warning's figure is the threshold, not a bound far
    below it)."""
    share = 2.0 ** -int(_HALF_SPACING[dtype].removeprefix("2^-"))
    g = torch.Generator().manual_seed(0)
    w = 1 + torch.rand(4096, generator=g)
    grad = torch.randn(4096, generator=g).sign()

    def step(dt, lr):
        p = torch.nn.Parameter(w.to(dt))
        before = p.detach().clone()
        p.grad = grad.to(dt)
        torch.optim.AdamW([p], lr=lr, weight_decay=0.0).step()
        return (p.detach() != before).float().mean().item()

    assert step(getattr(torch, dtype), 0.9 * share) == 0.0
    assert step(torch.float32, 0.9 * share) == 1.0
    assert step(getattr(torch, dtype), 2.0 * share) > 0.0


def test_a_bfloat16_run_warns_once_and_a_float32_run_does_not(tmp_path):
    out = tmp_path / "out"
    for dtype in ("bfloat16", "float32"):
        cfg = write_tiny_config(tmp_path / f"{dtype}.yaml", {"model": {"dtype": dtype}, "train": {"steps": 1}})
        r = cli("train", "--config", cfg, "--out", out, "--run", dtype)
        lines = [line for line in r.output.splitlines() if "trainable weights are" in line]
        assert len(lines) == (1 if dtype == "bfloat16" else 0), r.output
