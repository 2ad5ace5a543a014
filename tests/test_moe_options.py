"""``model.num_experts`` / ``model.experts_per_token``: the tiny MoE model's shape; on a dense
architecture, a checkpoint or out of range they are one line, exit 2, and nothing is written."""

import pytest

from masktrl.config import HASH_UNLESS_SET, Config, load_config
from masktrl.models.tiny import TinyModelConfig
from masktrl.rl.warmstart import new_tiny_model, warmstart_key


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["--set", "model.num_experts=4"],
            "model.num_experts is a mixture-of-experts option, but model.architecture=qwen3 is dense",
        ),
        (
            ["--set", "model.architecture=llama", "--set", "model.experts_per_token=1"],
            "model.architecture=llama is dense",
        ),
        (
            [
                "--set",
                "model.architecture=qwen3-moe",
                "--set",
                "model.experts_per_token=3",
                "--set",
                "model.num_experts=2",
            ],
            "model.experts_per_token=3 exceeds model.num_experts=2",
        ),
        (
            ["--set", "model.architecture=qwen3-moe", "--set", "model.num_experts=0"],
            "model.num_experts must be an integer >= 1",
        ),
        (
            ["--set", "model.architecture=qwen3-moe", "--set", "model.experts_per_token=9"],
            "exceeds model.num_experts=8",
        ),
    ],
)
def test_refused_through_the_cli_with_nothing_written(cli_error, tmp_path, args, words):
    out = tmp_path / "out"
    line = cli_error("train", "--out", out, "--run", "r", *args)
    assert words in line
    assert not out.exists()  # no run folder, no cache


def test_a_checkpoint_has_its_own_experts(cli_error, tmp_path):
    line = cli_error(
        "train", "--out", tmp_path / "out", "--set", "model.path=some/model", "--set", "model.num_experts=4"
    )
    assert "option of the tiny model" in line and not (tmp_path / "out").exists()


def test_the_moe_model_takes_the_shape_and_the_defaults_are_the_presets():
    cfg = load_config(None, ["model.architecture=qwen3-moe", "model.num_experts=4", "model.experts_per_token=1"])
    from masktrl.models.tiny import build_char_tokenizer

    model = new_tiny_model(cfg, build_char_tokenizer("0123456789+="))
    assert (model.config.num_experts, model.config.num_experts_per_tok) == (4, 1)
    assert model.model.layers[0].mlp.gate.weight.shape[0] == 4
    preset = load_config(["configs/lab.yaml", "configs/lab-moe.yaml"])
    assert preset.model.moe_shape() == (8, 2) and TinyModelConfig.of(preset.model).num_experts == 8


def test_unset_keys_leave_the_config_hash_and_the_warmstart_key_as_before():
    """Unset, the new keys are absent from the hash: the warm-start caches of earlier runs stay valid."""
    import hashlib
    import json

    cfg = Config()
    d = cfg.to_dict()  # what run.yaml records (the method block as written)
    for key in HASH_UNLESS_SET:  # the MoE, routing-replay and environment keys, all unset by default
        section, name = key.split(".")
        del d[section][name]
    assert cfg.hash() == hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]
    moe = load_config(None, ["model.architecture=qwen3-moe"])
    assert warmstart_key(moe) != warmstart_key(
        load_config(None, ["model.architecture=qwen3-moe", "model.num_experts=4"])
    )


def test_a_sweep_refuses_it_too(cli_error, tmp_path):
    line = cli_error(
        "sweep", "--seeds", 1, "--methods", "grpo", "--set", "model.experts_per_token=2", "--out", tmp_path / "sw"
    )
    assert "model.architecture=qwen3 is dense" in line and not (tmp_path / "sw").exists()
