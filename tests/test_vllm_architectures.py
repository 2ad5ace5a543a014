"""Each tiny architecture in the vLLM engine (run in the vLLM venv: scripts/test_vllm.sh): the
behaviour log-probabilities vLLM records equal a transformers float32 recomputation, and a
LoRA model's merged weights sync in. Architectures this vLLM build cannot serve are listed in
``UNSUPPORTED`` with the reason (docs/MODELS.md)."""

from __future__ import annotations

import copy

import pytest
import torch

from masktrl.models.architectures import ARCHITECTURES
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from masktrl.rollout.base import SamplingSettings

pytestmark = pytest.mark.vllm

CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCH_COMPILE_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
SHAPE = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_positions=256
)
SETTINGS = SamplingSettings(n=2, max_new_tokens=10, temperature=1.0, logprobs_k=4)
UNSUPPORTED: dict[str, str] = {  # measured with vllm-cpu 0.32.0 (transformers 5.19), scripts/setup_vllm_venv.sh
    "qwen3-moe": "vLLM's log-probabilities differ from transformers' by up to 0.03 nats on the tiny MoE (float32)",
    "gemma2": "vLLM's Gemma2 has no lm_head (it always ties it to the embedding): the untied tiny model does not load",
    "olmo2": "vllm-cpu fails at start-up ('Olmo2Model' object has no attribute 'do_not_compile')",
    "gpt-neox": "vllm-cpu fails at start-up (pipeline model parallel group is not initialized)",
}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_vllm_serves_the_architecture(arch, tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    if arch in UNSUPPORTED:
        pytest.skip(UNSUPPORTED[arch])
    from masktrl.rollout.vllm import VLLMEngine

    for key, value in CPU_ENV.items():
        monkeypatch.setenv(key, value)
    tok = build_char_tokenizer("0123456789+=")
    model = build_tiny_model(tok, SHAPE, seed=0, architecture=arch).float().eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    prompts = [tok.encode(t) for t in ["12+3=", "1+2=45+6="]]
    engine = VLLMEngine(str(tmp_path), tok, dtype="float32", enforce_eager=True, seed=0)

    def worst(reference, gens):
        err = 0.0
        for prompt, group in zip(prompts, gens):
            for g in group:
                ids = torch.tensor([prompt + g.response_ids])
                with torch.no_grad():
                    lp = torch.log_softmax(reference(input_ids=ids).logits[0, len(prompt) - 1 : -1].double(), -1)
                want = lp.gather(1, torch.tensor(g.response_ids)[:, None]).squeeze(1)
                err = max(err, (want - torch.tensor(g.logp, dtype=torch.float64)).abs().max().item())
        return err

    assert worst(model, engine.generate(prompts, SETTINGS, seed=1)) < 1e-4
    pytest.importorskip("peft")
    from masktrl.models.lora import LoraSettings, apply_lora

    adapted = apply_lora(copy.deepcopy(model), LoraSettings(rank=4, alpha=8), seed=0)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    engine.sync_weights(adapted.eval())
    gens = engine.generate(prompts, SETTINGS, seed=2)
    assert worst(adapted, gens) < 1e-4 and worst(model, gens) > 1e-3
