"""Rollout engines behind one interface (see base.py). vLLM is imported only when chosen."""

from __future__ import annotations

from masktrl.rollout.base import Generation, RolloutEngine, Sample, SamplingSettings

__all__ = ["Generation", "RolloutEngine", "Sample", "SamplingSettings", "make_engine"]


DEFAULT_MAX_LOGPROBS = 20  # vLLM's own default for max_logprobs


def make_engine(rollout_cfg, model, tokenizer, model_dir: str | None, *, dtype: str, seed: int) -> RolloutEngine:
    """The engine named by ``rollout_cfg.engine`` (a ``RolloutConfig``); ``model_dir`` holds the
    weights vLLM starts from, in ``dtype`` (the training dtype; ``rollout.dtype`` when set is the
    engine's); ``seed`` is vLLM's engine seed. A LoRA adapter checkpoint (``models/lora.py``) is
    no folder vLLM loads: the engine starts from its base model and then receives ``model``'s
    weights (merged)."""
    if rollout_cfg.engine == "hf":
        from masktrl.rollout.hf import HFEngine

        return HFEngine(
            model,
            tokenizer,
            batch_size=rollout_cfg.batch_size,
            dtype=rollout_cfg.dtype,
            quantization=rollout_cfg.quantization,
            drop_finished=rollout_cfg.drop_finished,
            decode="fused" if rollout_cfg.decode_loop == "fused" else "generate",
            draw=rollout_cfg.draw,
        )
    from masktrl.models.lora import is_adapter_folder, read_adapter
    from masktrl.rollout.vllm import VLLMEngine

    adapter = model_dir is not None and is_adapter_folder(model_dir)
    if adapter:
        model_dir = read_adapter(model_dir)[1]
    engine = VLLMEngine(
        str(model_dir),
        tokenizer,
        dtype=rollout_cfg.dtype or dtype,
        gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
        quantization=rollout_cfg.quantization,
        enforce_eager=rollout_cfg.enforce_eager,
        seed=seed,
        enable_sleep_mode=rollout_cfg.sleep_mode,
        max_logprobs=max(rollout_cfg.logprobs_k, DEFAULT_MAX_LOGPROBS),  # K = 30/50 need vLLM's limit raised
    )
    if adapter:
        engine.sync_weights(model)
    return engine
