"""FP8 training (train.quantization, models/lowprec.py): the straight-through round trip against
the float64 reference, its gradient against autograd at the quantised point, the trainer's
quantised forward against the engine's copy, MoE and LoRA, and the command-line behaviour."""

import copy
import json

import pytest
import torch

from masktrl.models.lowprec import (
    LowPrecisionCopy,
    fp8_roundtrip,
    fp8_ste,
    quantize_training,
    quantized_head,
    quantized_weights,
    strip_training_quantization,
    training_quantization,
)
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from masktrl.rl.policy import ForwardInputs, PolicyForward
from tests.conftest import masktrl, write_tiny_config
from tests.test_lowprec import fp8_ref, tiny_moe


def _tiny(seed=0):
    tok = build_char_tokenizer("0123456789+=")
    return build_tiny_model(tok, TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2), seed=seed)


def _moe():
    torch.manual_seed(0)
    return tiny_moe()


IDS = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 3, 4, 1, 2]])


def test_ste_forward_is_the_float64_reference_and_backward_the_identity():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 48, generator=g) * torch.logspace(-4, 2, 48)).requires_grad_(
        True
    )  # [out, in], wide range per row
    q = fp8_ste(w)
    assert torch.equal(q, fp8_roundtrip(w.detach()))  # the engine's round trip, value for value
    ref = fp8_ref(w.detach())  # float64, from the format's definition (tests/test_lowprec.py)
    same = (q.detach().double() - ref).abs() <= ref.abs() * 2.0**-22  # float32 rounding of s, x / s and q * s
    assert same.float().mean() > 0.999
    step = (ref.abs() / 8).clamp_min(w.detach().abs().amax(1, keepdim=True).double() / 448 * 2.0**-9)
    assert (
        (q.detach().double() - ref).abs() <= step * 1.0001
    ).all()  # elsewhere at most one e4m3 step (a boundary tie)
    up = torch.randn(64, 48, generator=g)
    q.backward(up)
    assert torch.equal(w.grad, up)  # straight through
    zero = torch.zeros(3, 5, requires_grad=True)  # limit case: an all-zero row stays zero, gradient still passes
    fp8_ste(zero).sum().backward()
    assert torch.equal(fp8_ste(zero.detach()), zero.detach()) and torch.equal(zero.grad, torch.ones(3, 5))


def test_ste_gradient_is_the_float32_gradient_at_the_quantised_point():
    """d L(W_hat(W)) / dW through the hooks == dL/dW evaluated at W = W_hat, on a plain float32
    model holding the quantised weights (autograd on both sides; the same graph, so equal)."""
    model = _tiny()
    ref = copy.deepcopy(model)
    names = quantize_training(model, "fp8")
    assert training_quantization(model) and not training_quantization(ref)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n in names:
                p.copy_(fp8_roundtrip(p))
    layout = ForwardInputs(IDS, torch.ones_like(IDS), torch.tensor([0, 1, 1]), torch.tensor([4, 3, 5]))
    args = (layout, torch.tensor([[5, 1], [2, 7], [3, 3]]), 1.0, 64)
    loss_q = PolicyForward(model)(*args)[0].sum()
    loss_r = PolicyForward(ref)(*args)[0].sum()
    assert torch.equal(loss_q, loss_r)
    loss_q.backward()
    loss_r.backward()
    grads_r = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads_r[n].grad, rtol=1e-6, atol=1e-9), n
    assert sum(p.grad.abs().sum() for n, p in model.named_parameters() if n in names) > 0


def test_fp8_full_head_gradient_at_the_quantised_point():
    """fp8-full's output layer (quantized_head): the weight's gradient is dL/dW at W_hat, the
    hidden state's is dL/dh at h_hat (both straight through)."""
    model = _tiny()
    quantize_training(model, "fp8-full")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 64, generator=g).requires_grad_(True)
    w = model.lm_head.weight
    hq, wq = quantized_head(model, h, w)
    (hq @ wq.t()).log_softmax(-1)[:, 3].sum().backward()
    h_hat, w_hat = fp8_roundtrip(h.detach()).requires_grad_(True), fp8_roundtrip(w.detach()).requires_grad_(True)
    (h_hat @ w_hat.t()).log_softmax(-1)[:, 3].sum().backward()
    assert torch.equal(h.grad, h_hat.grad) and torch.equal(w.grad, w_hat.grad)


@pytest.mark.parametrize("scheme", ["fp8", "fp8-act", "fp8-full"])
def test_trainer_forward_equals_the_engine_copy_and_masters_stay(scheme):
    """The trainer's quantised forward computes what the engine's float32 copy with the same
    scheme computes (the two FP8 copies are the same values); the master weights are untouched."""
    model = _tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantize_training(model, scheme)
    engine = LowPrecisionCopy(model, torch.float32, scheme)
    assert not training_quantization(engine.model)  # the copy quantises itself, from the masters
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, engine.model(IDS).logits)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.is_leaf for p in model.parameters())
    plain = _tiny()
    with torch.no_grad():
        assert not torch.equal(model(IDS).logits, plain(IDS).logits)


def test_fp8_full_head_matches_the_engine():
    model = _tiny()
    quantize_training(model, "fp8-full")
    engine = LowPrecisionCopy(model, torch.float32, "fp8-full")
    h = model.model(
        IDS
    ).last_hidden_state  # [B, S, H]: the engine's shape (a [S, H] GEMM splits otherwise with 2 threads)
    hq, wq = quantized_head(model, h, model.lm_head.weight)
    with torch.no_grad():
        assert torch.equal(torch.nn.functional.linear(hq, wq), engine.model(IDS).logits)
    plain = _tiny()
    assert quantized_head(plain, h, plain.lm_head.weight)[1] is plain.lm_head.weight  # not quantised: unchanged


def test_moe_experts_quantised_router_not_and_gradients_flow():
    model = _moe()
    names = quantize_training(model, "fp8")
    assert any(n.endswith("experts.gate_up_proj") for n in names) and not any(
        n.endswith("mlp.gate.weight") for n in names
    )
    engine = LowPrecisionCopy(model, torch.float32, "fp8")
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, engine.model(IDS).logits)
    model(IDS).logits.sum().backward()
    experts = dict(model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts.grad is not None and experts.grad.abs().sum() > 0


def test_lora_trainer_and_engine_quantise_the_same_layers():
    pytest.importorskip("peft")
    from masktrl.models.lora import LoraSettings, apply_lora

    model = apply_lora(_tiny(), LoraSettings(rank=4), seed=0)
    with torch.no_grad():  # adapters that have moved (B starts at zero)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    names = quantize_training(model, "fp8")
    assert any(".base_layer." in n for n in names) and any(".lora_A." in n for n in names)
    engine = LowPrecisionCopy(model, torch.float32, "fp8")
    assert set(names) == engine.quantized
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, engine.model(IDS).logits)
    model(IDS).logits.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_strip_removes_every_hook():
    model = _tiny()
    quantize_training(model, "fp8-act")
    clone = copy.deepcopy(model)
    strip_training_quantization(clone)
    assert not training_quantization(clone)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in clone.modules())
    assert len(quantized_weights(model)) == sum(bool(m._forward_pre_hooks) for m in model.modules())


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_bad_train_quantization_exit_2_nothing_written(tmp_path):
    for args, needle in (
        (["--set", "train.quantization=int4"], "train.quantization"),
        (["--set", "train.quantization=fp8", "--set", "train.quantization_backend=torchao"], "torchao"),
    ):
        r = masktrl("train", *args, "--out", str(tmp_path), "--dry-run", cwd=tmp_path)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr
        assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_fp8_end_to_end_run_trains_and_measures_the_two_copies(tmp_path, warm_out):
    cfg = write_tiny_config(
        tmp_path / "c.yaml",
        {"train": {"steps": 2, "quantization": "fp8"}, "rollout": {"quantization": "fp8", "mismatch": "always"}},
    )
    r = masktrl("train", "--config", cfg, "--out", warm_out, "--run", "fp8-e2e", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = _rows(warm_out / "fp8-e2e")
    assert [row["step"] for row in rows] == [1, 2]
    # the same scheme on the same master weights: the engine's copy holds the trainer's quantised values,
    # so the gap is generation (KV cache) against the training forward, float32 rounding only
    assert all(row["mismatch/logp_abs_mean"] < 1e-4 for row in rows)
    from safetensors.torch import load_file

    from masktrl.analysis.step_replay import load_replay, replay_step

    replay = load_replay(
        warm_out / "fp8-e2e", 2
    )  # the step replay runs the FP8 forward too: it reproduces the checkpoint
    replay_step(replay, replay.cfg.seed, replay.cfg.train.minibatches)
    stored = load_file(warm_out / "fp8-e2e" / "checkpoints" / "000002" / "model.safetensors")
    now = replay.model.state_dict()
    assert all(torch.equal(now[k], stored[k]) for k in stored)
    r = masktrl(
        "train",
        "--config",
        cfg,
        "--out",
        warm_out,
        "--run",
        "fp8-only-engine",
        "--set",
        "train.quantization=null",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert all(row["mismatch/logp_abs_mean"] > 1e-3 for row in _rows(warm_out / "fp8-only-engine"))


def test_train_quantization_counts_as_a_sampling_change_on_resume():
    from masktrl.runs.plan import stale_batch_keys

    assert stale_batch_keys(["train.quantization", "train.lr", "rollout.top_k"]) == [
        "train.quantization",
        "rollout.top_k",
    ]
