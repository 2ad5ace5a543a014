"""``train.packing: auto`` and ``rollout.drop_finished: auto`` (the defaults): on for long responses
(``rollout.max_new_tokens >= AUTO_LONG_TOKENS``) where nothing refuses them, off otherwise, and
resolved once when a config is built, so a loaded config and run.yaml hold true or false. Below
the threshold every hash is what it was when both keys defaulted to false; every preset resolves
to what its committed results were made with."""

import dataclasses
import json

import pytest

from masktrl.config import AUTO_LONG_TOKENS, Config, RolloutConfig, load_config, save_config
from masktrl.errors import ConfigError

LONG = f"rollout.max_new_tokens={AUTO_LONG_TOKENS}"


def both(cfg: Config) -> tuple:
    return cfg.train.packing, cfg.rollout.drop_finished


def test_short_responses_keep_both_off_and_every_hash_as_before():
    assert both(Config()) == both(load_config(None)) == (False, False)
    off = ["train.packing=false", "rollout.drop_finished=false"]
    for overrides in ([], [f"rollout.max_new_tokens={AUTO_LONG_TOKENS - 1}"]):
        cfg = load_config(None, overrides)
        assert both(cfg) == (False, False)
        assert cfg.hash() == load_config(None, [*overrides, *off]).hash()  # the hash of the old defaults
        assert cfg.to_dict() == load_config(None, [*overrides, *off]).to_dict()


@pytest.mark.parametrize(
    "overlay",
    [
        [],
        ["configs/lab-long.yaml"],
        ["configs/lab-long200.yaml"],
        ["configs/lab-scratch.yaml"],
        ["configs/lab-deep.yaml"],
        ["configs/lab-moe.yaml"],
    ],
)
def test_every_lab_preset_resolves_to_both_off(overlay):
    """The presets' committed results were made with the padded forward and the fixed-batch loop
    (the 200-token labs pin train.packing false and run rollout.decode fused)."""
    assert both(load_config(["configs/lab.yaml", *overlay])) == (False, False)


@pytest.mark.parametrize("preset", ["tiny", "agentic", "qwen3-4b", "qwen3-8b"])
def test_the_other_presets_resolve_to_both_off(preset):
    assert both(load_config(f"configs/{preset}.yaml")) == (False, False)


def test_long_responses_turn_both_on_and_the_config_records_the_choice(tmp_path):
    cfg = load_config(None, [LONG])
    assert both(cfg) == (True, True)
    explicit = load_config(None, [LONG, "train.packing=true", "rollout.drop_finished=true"])
    assert cfg.hash() == explicit.hash()  # auto is the choice it makes, nothing more
    save_config(cfg, tmp_path / "run.yaml")
    text = (tmp_path / "run.yaml").read_text()
    assert "packing: true" in text and "drop_finished: true" in text
    assert "packing: auto" not in text and "drop_finished: auto" not in text
    recorded = load_config(tmp_path / "run.yaml", ["rollout.max_new_tokens=6"])
    assert both(recorded) == (True, True)  # recorded, not chosen again


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["rollout.decode=generate"], (True, False)),  # transformers' generate asked for
        (["rollout.decode=fused"], (True, False)),  # the fixed-batch loop asked for
        (["train.packing=false"], (False, True)),
        (["rollout.drop_finished=false"], (True, False)),
        (["model.architecture=mistral"], (False, True)),  # sliding-window attention cannot be packed
        (["model.architecture=gemma2"], (False, True)),
        (["model.architecture=qwen3-moe", "model.routing_replay=rollout"], (False, True)),  # replay runs whole rows
        (["model.architecture=qwen3-moe"], (True, True)),
    ],
)
def test_auto_stays_off_where_something_else_asks_or_refuses(overrides, expected):
    assert both(load_config(None, [LONG, *overrides])) == expected


def test_drop_finished_auto_is_off_for_another_engine():
    assert RolloutConfig(engine="vllm", max_new_tokens=4096).drop_finished is False
    assert RolloutConfig(engine="hf", max_new_tokens=4096).drop_finished is True


def test_a_model_folder_is_read_for_its_architecture(tmp_path):
    from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer("0123456789+=")
    build_tiny_model(tok, TinyModelConfig(16, 1, 2, 1, 32), 0).save_pretrained(tmp_path / "m")
    assert load_config(None, [LONG, f"model.path={tmp_path / 'm'}"]).train.packing is True
    missing = load_config(None, [LONG, f"model.path={tmp_path / 'nowhere'}"])  # the run's own checks refuse it
    assert missing.train.packing is False


@pytest.mark.parametrize(
    "config, packs",
    [
        ({"model_type": "qwen3", "sliding_window": None}, True),
        ({"model_type": "mistral", "sliding_window": None}, True),
        ({"model_type": "mistral", "sliding_window": 4096}, False),
        ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}, True),
        ({"model_type": "qwen3", "layer_types": ["full_attention", "sliding_attention"]}, False),
        ({"model_type": "gemma2"}, False),  # not a type the list names
        ({"architectures": ["Qwen3ForCausalLM"]}, False),  # no model_type
        ("[1, 2", False),  # not JSON
    ],
)
def test_a_model_folders_config_json_decides(tmp_path, config, packs):
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    assert load_config(None, [LONG, f"model.path={tmp_path}"]).train.packing is packs


@pytest.mark.parametrize("key", ["train.packing", "rollout.drop_finished"])
@pytest.mark.parametrize("value", ["maybe", "1", "null", "[1]"])
def test_anything_but_true_false_or_auto_is_one_line_exit_2(cli_error, tmp_path, key, value):
    line = cli_error("train", "--dry-run", "--out", tmp_path / "out", "--set", f"{key}={value}")
    assert f"{key} must be true, false or auto" in line
    assert not (tmp_path / "out").exists()


def test_a_section_built_by_hand_with_a_wrong_value_is_refused():
    with pytest.raises(ConfigError, match="rollout.drop_finished must be true, false or auto"):
        RolloutConfig(drop_finished="yes").validate()
    with pytest.raises(ConfigError, match="train.packing must be true, false or auto"):
        dataclasses.replace(Config().train, packing="yes").validate()


def test_config_keys_documents_auto():
    from masktrl.config import config_keys

    docs = {k.key: k for k in config_keys()}
    for key in ("train.packing", "rollout.drop_finished"):
        assert docs[key].default == "auto" and "auto:" in docs[key].doc


def test_a_long_response_run_with_nothing_set_packs_and_drops_finished_rows(tmp_path, warm_out):
    """A 2-step run at 128 new tokens with nothing set: its run.yaml records both on, it trains,
    and the engine's log mu matches the trainer's packed log pi_old (mismatch/*)."""
    from tests.conftest import masktrl, write_tiny_config

    cfg = write_tiny_config(tmp_path / "c.yaml")
    args = ["train", "--config", cfg, "--out", warm_out, "--run", "auto-long", "--set", LONG]
    dry = masktrl(*args, "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "train.packing" in dry.stdout
    r = masktrl(*args, "--set", "train.threads=1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    run = load_config(warm_out / "auto-long" / "run.yaml")
    assert both(run) == (True, True)
    rows = [json.loads(line) for line in (warm_out / "auto-long" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2]
    assert all(x["mismatch/tokens"] == x["tokens"] > 0 for x in rows)
    assert max(x["mismatch/logp_abs_mean"] for x in rows) < 1e-5


def test_the_static_lists_agree_with_the_packed_forward():
    """config.py decides auto without importing the models: its lists of packable tiny
    architectures and model types are what models/packing.py says of each."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from masktrl.config import PACKING_MODEL_TYPES, TINY_ARCHITECTURES, TINY_PACKING
    from masktrl.models.packing import config_unsupported_reason

    for arch in TINY_ARCHITECTURES:
        cfg = load_config(None, [f"model.architecture={arch}"])
        assert (config_unsupported_reason(cfg.model) is None) == (arch in TINY_PACKING), arch
    for model_type in PACKING_MODEL_TYPES:
        model_class = AutoModelForCausalLM._model_mapping[CONFIG_MAPPING[model_type]]
        assert getattr(model_class, "_supports_attention_backend", False), model_type
