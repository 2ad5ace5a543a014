"""Every shipped config loads and validates (no model is loaded), and every accelerate config
is one that ``accelerate launch`` reads."""

from pathlib import Path

import pytest

from masktrl.config import load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_loads_and_validates(path):
    cfg = load_config(path)
    if path.name.startswith("qwen3-"):
        assert cfg.model.path.startswith("Qwen/Qwen3-") and cfg.model.dtype == "bfloat16"
        assert cfg.rollout.engine == "vllm" and cfg.rollout.logprobs_k == 20 and cfg.train.lr == 1e-6
        assert cfg.task.name == "dapo-math" and cfg.train.eval_benchmarks == ("aime",) and cfg.eval.k == 16
        assert 8 <= cfg.rollout.n <= 16
        size = "4b" if "-4b-" in path.name else "8b"
        assert load_config(CONFIGS / f"qwen3-{size}-grpo.yaml").model == cfg.model  # variants differ in the method only


def test_every_recipe_exists_for_both_models():
    for size in ("4b", "8b"):
        for method in ("grpo", "dppo-topk-kl", "pdm-agg", "pdm-uniform", "sis-dapo"):
            assert (CONFIGS / f"qwen3-{size}-{method}.yaml").is_file()


@pytest.mark.parametrize("path", sorted((CONFIGS / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_configs_parse(path):
    from accelerate.commands.config.config_args import load_config_from_file

    conf = load_config_from_file(str(path))
    assert conf.num_processes >= 2 and conf.num_machines == 1
    if path.stem.startswith("zero"):
        assert conf.distributed_type.value == "DEEPSPEED" and str(conf.mixed_precision) == "bf16"
        assert conf.deepspeed_config["zero_stage"] == int(path.stem[-1])
