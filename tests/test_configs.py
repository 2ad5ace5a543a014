"""Every shipped config loads and validates (no model is loaded): the bases alone, every base
with every method overlay, the tiny overlay; and every accelerate config is one that
``accelerate launch`` reads."""

from pathlib import Path

import pytest

from masktrl.config import Config, load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
BASES = ["qwen3-4b.yaml", "qwen3-8b.yaml"]
METHODS = {  # overlay -> the method block it must give
    "grpo": {"name": "grpo"},
    "dppo-topk-kl": {"name": "dppo", "divergence": "topk-kl", "delta_pos": 0.15, "delta_neg": 0.15},
    "pdm-agg": {"name": "pdm", "divergence": "kl", "tail": "agg", "delta_pos": 0.15, "delta_neg": 0.15},
    "pdm-uniform": {"name": "pdm", "divergence": "kl", "tail": "uniform", "delta_pos": 0.15, "delta_neg": 0.15},
    "sis-dapo": {"name": "sis", "base": "dapo"},
    "cispo": {"name": "cispo"},
    "grpo-tis-decoupled": {"name": "grpo", "correction": {"kind": "token-tis", "cap": 2.0, "mode": "decoupled"}},
    # the anchors' defaults (tests/test_presets_anchors.py checks them key by key)
    "verl-grpo": {
        "name": "grpo",
        "eps_low": 0.2,
        "eps_high": 0.2,
        "dual_clip": 3.0,
        "loss_agg": "token-mean",
        "adv_norm": "group-std",
        "kl_coef": 0.0,
        "entropy_coef": 0.0,
        "correction": {"kind": "none", "mode": "decoupled"},
    },
    "verl-bypass": {
        "name": "grpo",
        "eps_low": 0.2,
        "eps_high": 0.2,
        "dual_clip": 3.0,
        "loss_agg": "token-mean",
        "adv_norm": "group-std",
        "kl_coef": 0.0,
        "entropy_coef": 0.0,
    },
    "trl-grpo": {
        "name": "grpo",
        "eps_low": 0.2,
        "eps_high": 0.2,
        "loss_agg": "token-mean",
        "adv_norm": "group-std",
        "kl_coef": 0.0,
        "entropy_coef": 0.0,
        "correction": {
            "kind": "seq-mis",
            "mode": "decoupled",
            "stat": "product",
            "weight": "sequence",
            "lo": 0.0,
            "hi": 3.0,
        },
    },
}


def test_the_shipped_files_are_the_bases_the_overlays_the_tiny_presets_and_the_lab():
    labs = [
        "lab.yaml",
        "lab-long.yaml",
        "lab-long200.yaml",
        "lab-scratch.yaml",
        "lab-credit.yaml",
        "lab-moe.yaml",
        "lab-deep.yaml",
        "agentic.yaml",
    ]
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(BASES + ["tiny.yaml", "tiny-offpolicy.yaml", *labs])
    assert sorted(p.stem for p in (CONFIGS / "methods").glob("*.yaml")) == sorted(METHODS)


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_base_with_every_method_overlay(base, method):
    cfg = load_config([CONFIGS / base, CONFIGS / "methods" / f"{method}.yaml"])
    assert cfg.method.to_dict() == METHODS[method]
    alone = load_config(CONFIGS / base)
    assert alone.method.to_dict() == {"name": "grpo"}
    assert cfg.to_dict() | {"method": None} == alone.to_dict() | {"method": None}  # the overlay changes the method only
    assert cfg.model.path == f"Qwen/Qwen3-{base[6:8].upper()}-Base" and cfg.model.dtype == "bfloat16"
    assert cfg.rollout.engine == "vllm" and cfg.rollout.logprobs_k == 20 and cfg.train.lr == 1e-6
    assert cfg.task.name == "dapo-math" and cfg.train.eval_benchmarks == ("aime",) and cfg.eval.k == 16
    assert cfg.rollout.n == 16 and cfg.rollout.prompts_per_step * cfg.rollout.n == 1024


def test_the_bases_differ_in_the_model_and_vllm_memory_only():
    from masktrl.config import diff_configs

    a, b = (load_config(CONFIGS / base) for base in BASES)
    assert diff_configs(a, b) == ["model.path", "rollout.gpu_memory_utilization"]


def test_tiny_offpolicy_is_an_overlay_of_tiny():
    alone = load_config(CONFIGS / "tiny-offpolicy.yaml")
    on_tiny = load_config([CONFIGS / "tiny.yaml", CONFIGS / "tiny-offpolicy.yaml"])
    assert alone == on_tiny and on_tiny.train.minibatches == 4
    assert on_tiny.to_dict() | {"train": None} == load_config(CONFIGS / "tiny.yaml").to_dict() | {"train": None}
    assert load_config(CONFIGS / "tiny.yaml") == Config()  # so the overlay alone means the same


def test_the_lab_preset_is_the_lab_design_and_takes_every_method_overlay():
    """docs/LAB.md: many correct answers, one token per integer, stale batches cut into 8
    minibatch updates, sampled evaluation, the lab statistics; the methods compose on it."""
    lab = load_config(CONFIGS / "lab.yaml")
    assert lab.task.name == "residues" and lab.task.options == {"answers": 4, "distinct": True}
    assert (lab.model.tokenizer, lab.model.embedding_init, lab.model.num_layers) == ("numbers", "numbers", 2)
    assert (lab.rollout.staleness, lab.rollout.logprobs_k, lab.train.minibatches) == (2, 20, 8)
    assert lab.train.lab_stats and not lab.eval.greedy and lab.train.grad_clip == 1.0
    for method in sorted(METHODS):
        cfg = load_config([CONFIGS / "lab.yaml", CONFIGS / "methods" / f"{method}.yaml"])
        assert cfg.method.to_dict() == METHODS[method] and cfg.to_dict() | {"method": None} == lab.to_dict() | {
            "method": None
        }


def test_every_config_the_docs_name_exists():
    import re

    root = CONFIGS.parent
    texts = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted(CONFIGS.rglob("*.yaml"))]
    named = set()
    for path in texts:
        for ref in re.findall(r"configs/[\w./{},-]*\.yaml", path.read_text()):
            head, _, rest = ref.partition("{")
            options, _, tail = rest.partition("}")
            named |= {head + o + tail for o in options.split(",")} if rest else {ref}
    missing = sorted(n for n in named if not (root / n).is_file())
    assert not missing and len(named) > 10, missing


@pytest.mark.parametrize("path", sorted((CONFIGS / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_configs_parse(path):
    from accelerate.commands.config.config_args import load_config_from_file

    conf = load_config_from_file(str(path))
    assert conf.num_processes >= 2 and conf.num_machines == 1
    if path.stem.startswith("zero"):
        assert conf.distributed_type.value == "DEEPSPEED" and str(conf.mixed_precision) == "bf16"
        assert conf.deepspeed_config["zero_stage"] == int(path.stem[-1])


def test_the_lab_overlays_long_responses_and_moe():
    from masktrl.config import ModelConfig
    from masktrl.tasks import make_task

    lab = load_config(CONFIGS / "lab.yaml")
    long = load_config([CONFIGS / "lab.yaml", CONFIGS / "lab-long.yaml"])
    task = make_task(long.task, long.model)
    assert (task.answers, task.max_answers, task.ascending) == (47, 63, True)
    assert long.rollout.max_new_tokens == task.max_answers + 1  # 48 to 64 tokens with EOS
    assert long.model == lab.model and long.rollout.staleness == lab.rollout.staleness
    long200 = load_config([CONFIGS / "lab.yaml", CONFIGS / "lab-long200.yaml"])
    task200 = make_task(long200.task, long200.model)
    assert (task200.answers, task200.max_answers, task200.ascending) == (200, 240, True)
    assert task200.min_solutions == task200.max_solutions == task200.max_answers  # 240 correct numbers per prompt
    assert long200.rollout.max_new_tokens == task200.max_answers + 1  # 201 to 241 tokens with EOS
    assert long200.model == lab.model and long200.rollout.staleness == lab.rollout.staleness
    if "architecture" not in ModelConfig.__dataclass_fields__:
        pytest.skip("model.architecture (the tiny MoE model) is not in this build")
    deep = load_config([CONFIGS / "lab.yaml", CONFIGS / "lab-deep.yaml"])
    assert deep.model.num_layers == 8 and deep.task == lab.task and deep.model.hidden_size == lab.model.hidden_size
    assert (deep.rollout.dtype, deep.rollout.quantization) == ("bfloat16", "fp8-act")
    moe = load_config([CONFIGS / "lab.yaml", CONFIGS / "lab-moe.yaml"])
    assert moe.model.architecture == "qwen3-moe" and moe.task == lab.task and moe.rollout == lab.rollout
