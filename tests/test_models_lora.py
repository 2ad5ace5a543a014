"""LoRA adapters (``models/lora.py``): zero-initialised adapters leave every log-probability
bit-identical, only the adapters train, the reference policy is the base model, and the merged
weights a separate engine loads give the adapted model's outputs."""

import copy
import sys

import pytest
import torch

from masktrl.errors import MasktrlError
from masktrl.models import checkpointing
from masktrl.models.architectures import ARCHITECTURES
from masktrl.models.lora import (
    LoraSettings,
    adapter_state_dict,
    apply_lora,
    has_lora,
    is_adapter_folder,
    load_adapter_state_dict,
    merge_and_unload,
    merged_state_dict,
    read_adapter,
    reference_policy,
    save_adapter,
)
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from masktrl.rl import policy
from masktrl.rollout.base import Sample, SamplingSettings
from masktrl.rollout.hf import HFEngine

pytest.importorskip("peft")

SHAPE = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer("0123456789+=")


def _samples(model, tok):
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ["12+3=", "1+2=", "345+67="]]
    gens = HFEngine(model, tok).generate(prompts, SamplingSettings(n=3, max_new_tokens=8, logprobs_k=4), seed=0)
    return [
        Sample(f"e{g}", "", "", p, g, gen, advantage=0.3 * (j - 1))
        for g, (p, grp) in enumerate(zip(prompts, gens))
        for j, gen in enumerate(grp)
    ]


def _perturb_adapters(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_zero_adapters_reproduce_the_base_log_probs_bit_for_bit(tok, name):
    model = build_tiny_model(tok, SHAPE, seed=0, architecture=name)
    samples = _samples(model, tok)
    model.train()
    before = policy.policy_token_batch(model, samples, temperature=0.9, chunk=5)
    rng = torch.random.get_rng_state()
    apply_lora(model, LoraSettings(rank=4, alpha=8), seed=0)
    assert torch.equal(torch.random.get_rng_state(), rng)  # the adapters' draws leave the caller's stream alone
    assert has_lora(model)
    after = policy.policy_token_batch(model, samples, temperature=0.9, chunk=5)
    assert torch.equal(after.batch.logp, before.batch.logp) and torch.equal(
        after.batch.topk_logp, before.batch.topk_logp
    )
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # the gradient reaches the adapters only (B = 0: A's gradient is zero, B's is not)
    (after.batch.logp * after.advantages).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(trainable) and any(g.abs().sum() > 0 for n, g in grads.items() if ".lora_B." in n)


def test_adapters_with_gradient_checkpointing_and_the_shared_prompt(tok):
    model = build_tiny_model(tok, SHAPE, seed=2)
    samples = _samples(model, tok)
    apply_lora(model, LoraSettings(rank=4, alpha=8, target_modules=("q_proj", "v_proj")), seed=0)
    _perturb_adapters(model)
    model.train()

    def run():
        model.zero_grad(set_to_none=True)
        out = policy.policy_token_batch(model, samples, temperature=1.0, chunk=5)
        assert out.shared_prompt
        (out.batch.logp * out.advantages).sum().backward()
        return out.batch.logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    lp, g = run()
    checkpointing.enable(model)
    lp_c, g_c = run()
    torch.testing.assert_close(lp_c, lp, atol=1e-6, rtol=0)
    assert set(g) == set(g_c) and all(".lora_" in n for n in g)
    for n in g:
        torch.testing.assert_close(g_c[n], g[n], atol=1e-6 * max(1.0, g[n].abs().max().item()), rtol=1e-5)


@pytest.mark.parametrize("name", ["qwen3", "gpt-neox", "qwen3-moe"])
def test_reference_policy_is_the_base_model_and_merged_weights_are_the_adapted_one(tok, name):
    model = build_tiny_model(tok, SHAPE, seed=0, architecture=name).eval()
    base = copy.deepcopy(model)
    ids = torch.tensor([[4, 5, 6, 7, 8, 9]])
    apply_lora(model, LoraSettings(rank=4, alpha=8), seed=0)
    _perturb_adapters(model)
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        want_base = base(input_ids=ids).logits
        assert (adapted - want_base).abs().max() > 1e-3  # the adapters matter
        grads_before = {n: p.requires_grad for n, p in model.named_parameters()}
        with reference_policy(model):
            torch.testing.assert_close(model(input_ids=ids).logits, want_base, atol=0, rtol=0)
        assert {n: p.requires_grad for n, p in model.named_parameters()} == grads_before
        torch.testing.assert_close(model(input_ids=ids).logits, adapted, atol=0, rtol=0)  # adapters back on
        merged = merged_state_dict(model)
        assert set(merged) == set(base.state_dict())  # the base model's own key names
        fresh = copy.deepcopy(base)
        fresh.load_state_dict(merged)
        torch.testing.assert_close(fresh(input_ids=ids).logits, adapted, atol=1e-5, rtol=1e-5)


def test_merged_weight_is_w_plus_scaled_b_a(tok):
    model = build_tiny_model(tok, SHAPE, seed=0)
    w = model.model.layers[0].self_attn.q_proj.weight.detach().clone().double()
    apply_lora(model, LoraSettings(rank=2, alpha=6, target_modules=("q_proj",)), seed=0)
    _perturb_adapters(model)
    layer = model.model.layers[0].self_attn.q_proj
    a, b = layer.lora_A["default"].weight.double(), layer.lora_B["default"].weight.double()
    got = merged_state_dict(model)["model.layers.0.self_attn.q_proj.weight"].double()
    torch.testing.assert_close(got, w + 3.0 * b @ a, atol=1e-6, rtol=0)  # alpha / r = 3


def test_adapter_state_round_trip(tok):
    model = build_tiny_model(tok, SHAPE, seed=0)
    apply_lora(model, LoraSettings(rank=4), seed=0)
    _perturb_adapters(model, seed=3)
    saved = {k: v.clone() for k, v in adapter_state_dict(model).items()}
    assert saved and all(".lora_" in k for k in saved)
    other = apply_lora(build_tiny_model(tok, SHAPE, seed=0), LoraSettings(rank=4), seed=1)
    load_adapter_state_dict(other, saved)
    ids = torch.tensor([[4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(other(input_ids=ids).logits, model(input_ids=ids).logits)
    with pytest.raises(ValueError, match="do not fit"):
        load_adapter_state_dict(other, {k: v for k, v in list(saved.items())[1:]})


@pytest.mark.parametrize(
    "settings, message",
    [
        (LoraSettings(rank=0), "model.lora.rank must be a positive integer"),
        (LoraSettings(rank=-2), "model.lora.rank must be a positive integer"),
        (LoraSettings(rank=4, alpha=0), "model.lora.alpha must be > 0"),
        (LoraSettings(rank=4, dropout=1.0), r"model.lora.dropout must be in \[0, 1\)"),
        (
            LoraSettings(rank=4, target_modules=("q_proj", "query_key_value")),
            r"\['query_key_value'\] match no linear layer.*q_proj",
        ),
        (LoraSettings(rank=4, target_modules=()), "model.lora.target_modules must be"),
    ],
)
def test_bad_settings_are_one_line(tok, settings, message):
    model = build_tiny_model(tok, SHAPE, seed=0)
    with pytest.raises(MasktrlError, match=message):
        apply_lora(model, settings, seed=0)
    assert not has_lora(model)


def test_missing_peft_is_one_line(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft -> ImportError
    with pytest.raises(MasktrlError, match=r"needs the peft package: pip install 'masktrl\[lora\]'"):
        apply_lora(build_tiny_model(tok, SHAPE, seed=0), LoraSettings(rank=4), seed=0)


def test_reference_policy_needs_adapters(tok):
    with pytest.raises(ValueError, match="LoRA adapters"):
        with reference_policy(build_tiny_model(tok, SHAPE, seed=0)):
            pass


def test_vllm_sync_of_a_lora_model_sends_merged_weights_under_the_base_names(tok):
    """``VLLMEngine.sync_weights`` with a recording stand-in for ``vllm.LLM`` (no vLLM needed):
    the tensors pushed are the merged ones, named as the base model's."""
    from masktrl.rollout.vllm import VLLMEngine

    class Recorder:
        def collective_rpc(self, method, kwargs):
            self.pushed = dict(kwargs["weights_iterator"])

        def reset_prefix_cache(self):
            self.reset = True

    base = build_tiny_model(tok, SHAPE, seed=0)
    names = set(base.state_dict())
    model = apply_lora(base, LoraSettings(rank=4), seed=0)
    _perturb_adapters(model)
    engine = object.__new__(VLLMEngine)
    engine.llm, engine._asleep, engine.enable_sleep_mode = Recorder(), False, False
    engine.sync_weights(model)
    merged = merged_state_dict(model)
    assert set(engine.llm.pushed) == names and engine.llm.reset
    assert all(torch.equal(engine.llm.pushed[k], merged[k]) for k in names)
    q = "model.layers.0.self_attn.q_proj"
    assert not torch.equal(engine.llm.pushed[f"{q}.weight"], model.get_submodule(q).base_layer.weight)


def test_merge_and_unload_leaves_a_plain_model_with_the_adapted_outputs(tok):
    model = apply_lora(build_tiny_model(tok, SHAPE, seed=0), LoraSettings(rank=4), seed=0)
    _perturb_adapters(model)
    ids = torch.tensor([[4, 5, 6, 7]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        merge_and_unload(model)
        assert not has_lora(model) and all(p.requires_grad for p in model.parameters())
        assert set(model.state_dict()) == set(build_tiny_model(tok, SHAPE, seed=0).state_dict())
        torch.testing.assert_close(model(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)


def test_an_adapter_checkpoint_loads_as_the_merged_model_and_reads_in_peft(tok, tmp_path):
    from peft import PeftModel

    from masktrl.models.loading import load_model_and_tokenizer, load_model_config

    base = build_tiny_model(tok, SHAPE, seed=0)
    base.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    model = apply_lora(
        copy.deepcopy(base), LoraSettings(rank=4, alpha=8, target_modules=("q_proj", "down_proj")), seed=0
    )
    _perturb_adapters(model)
    ckpt = tmp_path / "run" / "ckpt"
    ckpt.mkdir(parents=True)
    save_adapter(ckpt, model, LoraSettings(rank=4, alpha=8, target_modules=("q_proj", "down_proj")), base="../../base")
    tok.save_pretrained(ckpt)
    assert is_adapter_folder(ckpt) and sorted(p.name for p in ckpt.glob("adapter_*")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    settings, where, weights = read_adapter(ckpt)
    assert settings.rank == 4 and settings.alpha == 8 and where == str((tmp_path / "base").resolve())
    assert set(weights) == set(adapter_state_dict(model))
    ids = torch.tensor([[4, 5, 6, 7]])
    loaded, _ = load_model_and_tokenizer(ckpt)
    assert not has_lora(loaded) and load_model_config(ckpt).hidden_size == SHAPE.hidden_size
    with torch.no_grad():
        want = model(input_ids=ids).logits
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
        peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(ckpt))  # peft's own reader
        torch.testing.assert_close(peft_model(input_ids=ids).logits, want, atol=1e-6, rtol=1e-6)


def test_a_vllm_engine_for_an_adapter_checkpoint_starts_from_the_base_and_gets_merged_weights(
    tok, tmp_path, monkeypatch
):
    from types import SimpleNamespace

    import masktrl.rollout.vllm as vllm_module
    from masktrl.rollout import make_engine

    built = {}

    class FakeEngine:
        def __init__(self, path, tokenizer, **kwargs):
            built["path"] = path

        def sync_weights(self, model):
            built["synced"] = model

    monkeypatch.setattr(vllm_module, "VLLMEngine", FakeEngine)
    base = build_tiny_model(tok, SHAPE, seed=0)
    base.save_pretrained(tmp_path / "base")
    model = apply_lora(copy.deepcopy(base), LoraSettings(rank=2), seed=0)
    ckpt = tmp_path / "run" / "ckpt"
    ckpt.mkdir(parents=True)
    save_adapter(ckpt, model, LoraSettings(rank=2), base="../../base")
    cfg = SimpleNamespace(
        engine="vllm",
        gpu_memory_utilization=0.5,
        quantization=None,
        dtype=None,
        enforce_eager=True,
        sleep_mode=False,
        logprobs_k=5,
        batch_size=8,
    )
    make_engine(cfg, model, tok, str(ckpt), dtype="float32", seed=0)
    assert built["path"] == str((tmp_path / "base").resolve()) and built["synced"] is model
    built.clear()
    make_engine(cfg, base, tok, str(tmp_path / "base"), dtype="float32", seed=0)  # a plain folder: no extra sync
    assert built == {"path": str(tmp_path / "base")}
