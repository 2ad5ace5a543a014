"""The vLLM engine is built from the config: max_logprobs follows rollout.logprobs_k (K = 30/50
work), sleep mode and the memory share are config keys. vLLM itself is not needed here (a
stand-in records the arguments); tests/test_vllm_train.py runs the real CPU build."""

import pytest

from masktrl.config import load_config
from masktrl.rollout import make_engine


class Recorder:
    def __init__(self, model_path, tokenizer, **kwargs):
        self.model_path, self.kwargs = model_path, kwargs


@pytest.mark.parametrize("k, expected", [(5, 20), (20, 20), (30, 30), (50, 50)])
def test_vllm_engine_gets_the_config_settings(monkeypatch, k, expected):
    import masktrl.rollout.vllm as vllm_module

    monkeypatch.setattr(vllm_module, "VLLMEngine", Recorder)
    cfg = load_config(
        None,
        [
            "rollout.engine=vllm",
            f"rollout.logprobs_k={k}",
            "rollout.sleep_mode=true",
            "rollout.gpu_memory_utilization=0.35",
        ],
    )
    engine = make_engine(cfg.rollout, None, None, "ckpt", dtype="bfloat16", seed=7)
    assert engine.kwargs["max_logprobs"] == expected  # never below vLLM's default of 20
    assert engine.kwargs["enable_sleep_mode"] is True and engine.kwargs["gpu_memory_utilization"] == 0.35
    assert engine.kwargs["dtype"] == "bfloat16" and engine.kwargs["seed"] == 7 and engine.model_path == "ckpt"


def test_sleep_mode_is_off_by_default():
    cfg = load_config(None, [])
    assert cfg.rollout.sleep_mode is False
