"""Rollout engines behind one interface (see base.py). vLLM is imported only when chosen."""

from __future__ import annotations

from masktrl.rollout.base import Generation, RolloutEngine, Sample, SamplingSettings

__all__ = ["Generation", "RolloutEngine", "Sample", "SamplingSettings", "make_engine"]


def make_engine(cfg, model, tokenizer, model_dir: str | None) -> RolloutEngine:
    """The engine named by ``cfg.rollout.engine``; ``model_dir`` holds the weights vLLM starts from."""
    if cfg.rollout.engine == "hf":
        from masktrl.rollout.hf import HFEngine

        return HFEngine(model, tokenizer, batch_size=cfg.rollout.batch_size)
    from masktrl.rollout.vllm import VLLMEngine

    return VLLMEngine(
        str(model_dir),
        tokenizer,
        dtype=cfg.model.dtype,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        quantization=cfg.rollout.quantization,
        enforce_eager=cfg.rollout.enforce_eager,
        seed=cfg.seed,
    )
