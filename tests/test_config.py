"""Config: defaults < YAML < command line, strict validation naming the key."""

import pytest
import yaml

from masktrl.config import DEFAULT_CONFIG, Config, diff_configs, load_config
from masktrl.errors import ConfigError


def test_the_default_preset_is_configs_tiny_yaml_as_documented():
    from masktrl.config import from_dict

    written = from_dict(yaml.safe_load(DEFAULT_CONFIG.read_text()))  # fails if the file is gone or unreadable
    cfg = load_config()
    assert cfg == written
    # what the README says `masktrl train` runs
    assert cfg.method.to_dict() == {"name": "grpo"} and cfg.seed == 0
    assert (cfg.model.path, cfg.model.hidden_size, cfg.model.num_layers, cfg.model.dtype) == ("tiny", 128, 3, "float32")
    assert (cfg.task.name, cfg.task.ops, cfg.task.digits, cfg.task.answer_format, cfg.task.n_test) == (
        "arithmetic",
        "+",
        3,
        "plain",
        500,
    )
    assert (cfg.warmstart.steps, cfg.warmstart.target_accuracy, cfg.warmstart.lr) == (2000, 0.5, 3e-3)
    assert (cfg.rollout.engine, cfg.rollout.prompts_per_step, cfg.rollout.n, cfg.rollout.logprobs_k) == (
        "hf",
        64,
        8,
        20,
    )
    assert (cfg.train.steps, cfg.train.lr, cfg.train.minibatches, cfg.train.threads) == (800, 3e-4, 1, 1)
    assert cfg.eval.greedy
    # tiny.yaml writes the defaults out, so an overlay used alone means the same as on tiny.yaml
    assert written == Config()


def test_without_a_config_the_default_preset_file_is_read(monkeypatch, tmp_path):
    import masktrl.config

    preset = tmp_path / "preset.yaml"
    preset.write_text("seed: 7\ntrain: {steps: 3}\n")
    monkeypatch.setattr(masktrl.config, "DEFAULT_CONFIG", preset)
    assert load_config().seed == 7 and load_config().train.steps == 3
    assert load_config(None, ["seed=8"]).train.steps == 3  # overrides go on top of it


def test_precedence_yaml_then_direct_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("seed: 5\ntrain:\n  lr: 0.01\n  steps: 7\n")
    cfg = load_config(p, ["train.lr=1e-5", "rollout.n=4"], seed=9)
    assert cfg.seed == 9 and cfg.train.lr == 1e-5 and cfg.train.steps == 7 and cfg.rollout.n == 4
    assert cfg.task == Config().task  # untouched sections keep their defaults


def test_method_and_its_params():
    cfg = load_config(None, ["method.divergence=topk-tv"], method="dppo")
    assert cfg.method.to_dict() == {"name": "dppo", "divergence": "topk-tv"}
    with pytest.raises(ConfigError, match="divergence"):
        load_config(None, ["method.divergence=nosuch"], method="dppo")
    with pytest.raises(ConfigError, match="nosuch"):
        load_config(None, [], method="nosuch")
    with pytest.raises(ConfigError, match="bogus"):
        load_config(None, ["method.bogus=1"], method="grpo")


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.lr=abc", "train.lr"),
        ("train.lr=-1", "train.lr"),
        ("train.steps=1.5", "train.steps"),
        ("rollout.top_p=0", "rollout.top_p"),
        ("rollout.engine=tgi", "rollout.engine"),
        ("train.nosuch=1", "train.nosuch"),
        ("nosection.x=1", "nosection"),
        ("eval.greedy=maybe", "eval.greedy"),
        ("model.dtype=int8", "model.dtype"),
        ("rollout.n=1", "rollout.n"),
        ("task.ops=/", "task.ops"),
        ("train.lr_schedule=step", "train.lr_schedule"),
        ("train.adamw=apex", "train.adamw"),
        ("train.min_lr_ratio=1.5", "train.min_lr_ratio"),
        ("train.keep_checkpoints=0", "train.keep_checkpoints"),
        ("train.keep_steps=[0]", "train.keep_steps"),
        ("train.report_to=tensorbored", "train.report_to"),
        ("train.report_to=[wandb,wandb]", "train.report_to"),
        ("rollout.store=none", "rollout.store"),
        ("rollout.sleep_mode=true", "rollout.sleep_mode"),
    ],
)
def test_invalid_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(lst)
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["justakey"])


def test_hash_and_diff():
    a, b = load_config(), load_config(None, ["train.lr=0.1"])
    assert a.hash() != b.hash()
    assert a.hash("task") == b.hash("task")
    assert diff_configs(a, b) == ["train.lr"]


def test_every_key_is_documented():
    import dataclasses

    from masktrl.config import config_keys
    from masktrl.methods import method_names

    def keys(prefix, obj):  # nested sections (model.lora) list their own keys
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            yield from keys(f"{prefix}{f.name}.", value) if dataclasses.is_dataclass(value) else [f"{prefix}{f.name}"]

    sections = [
        (s.name, getattr(Config(), s.name)) for s in dataclasses.fields(Config) if s.name not in ("seed", "method")
    ]
    every = {"seed"} | {k for name, sec in sections for k in keys(f"{name}.", sec)}
    assert {k.key for k in config_keys() if not k.key.startswith("method.")} == every
    for name in method_names():
        undocumented = [k.key for k in config_keys(name) if len(k.doc) < 10]
        assert not undocumented, (name, undocumented)


def test_a_key_masktrl_does_not_have_is_refused_in_a_file_and_on_the_command_line(tmp_path):
    from masktrl.config import from_dict

    old = Config().to_dict()
    old["eval"]["batch_size"] = 500  # generation batches are rollout.batch_size
    with pytest.raises(ConfigError, match=r"unknown config key eval\.batch_size"):
        from_dict(old)
    with pytest.raises(ConfigError, match=r"unknown config key eval\.batch_size"):
        load_config(None, ["eval.batch_size=8"])


def test_config_command_lists_keys_and_shows_the_resolved_config():
    from typer.testing import CliRunner

    from masktrl.cli import app
    from masktrl.config import from_dict

    r = CliRunner().invoke(app, ["config", "keys", "train.lr"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "train.lr" in r.output and "AdamW learning rate" in r.output, r.output
    r = CliRunner().invoke(app, ["config", "keys", "method", "--method", "dppo"], env={"COLUMNS": "200"})
    assert "method.divergence" in r.output and "binary-tv" in r.output
    r = CliRunner().invoke(app, ["config", "show", "--method", "sis", "--set", "train.lr=0.5"])
    assert from_dict(yaml.safe_load(r.output)) == load_config(None, ["train.lr=0.5"], method="sis")


def test_presets_compose_later_wins_key_by_key(tmp_path):
    base, over = tmp_path / "base.yaml", tmp_path / "over.yaml"
    base.write_text(
        "seed: 1\nmethod: {name: dppo, divergence: topk-tv}\ntrain: {lr: 0.01, steps: 7, "
        "eval_benchmarks: [synthetic, gsm8k]}\n"
        "eval: {data: {gsm8k: a.jsonl, math500: b.jsonl}}\n"
    )
    over.write_text("train: {lr: 0.02, eval_benchmarks: [synthetic]}\neval: {data: {gsm8k: c.jsonl}}\n")
    cfg = load_config([base, over])
    assert cfg.seed == 1 and cfg.train.steps == 7 and cfg.train.lr == 0.02  # merged key by key, later wins
    assert cfg.train.eval_benchmarks == ("synthetic",)  # a list is replaced whole
    assert cfg.eval.data == {"gsm8k": "c.jsonl", "math500": "b.jsonl"}  # a mapping merges
    assert cfg.method.to_dict() == {"name": "dppo", "divergence": "topk-tv"}
    assert load_config([over, base]).train.lr == 0.01  # the order decides


def test_a_method_overlay_replaces_another_method_and_tunes_the_same_one(tmp_path):
    base, other, tune = tmp_path / "base.yaml", tmp_path / "other.yaml", tmp_path / "tune.yaml"
    base.write_text("method: {name: dppo, divergence: topk-tv, delta_pos: 0.3}\n")
    other.write_text("method: {name: sis, base: dapo}\n")
    tune.write_text("method: {delta_neg: 0.1}\n")
    assert load_config([base, other]).method.to_dict() == {
        "name": "sis",
        "base": "dapo",
    }  # dppo's parameters mean nothing to sis
    assert load_config([base, tune]).method.to_dict() == {
        "name": "dppo",
        "divergence": "topk-tv",
        "delta_pos": 0.3,
        "delta_neg": 0.1,
    }
    assert (
        load_config([base, tune], method="dppo").method.params.delta_neg == 0.1
    )  # --method naming the same method keeps them
    assert load_config([base, tune], method="grpo").method.to_dict() == {"name": "grpo"}


def test_the_command_line_takes_several_configs(tmp_path):
    from typer.testing import CliRunner

    from masktrl.cli import app

    over = tmp_path / "over.yaml"
    over.write_text("rollout: {n: 4}\n")
    r = CliRunner().invoke(
        app,
        [
            "config",
            "show",
            "-c",
            str(DEFAULT_CONFIG.parent / "tiny-offpolicy.yaml"),
            "--config",
            str(over),
            "--set",
            "rollout.n=6",
        ],
    )
    cfg = yaml.safe_load(r.output)
    assert cfg["train"]["minibatches"] == 4 and cfg["rollout"]["n"] == 6 and cfg["rollout"]["prompts_per_step"] == 64


def test_eval_and_rollout_task_files_compose_the_same_way(tmp_path):
    from masktrl.config import read_overrides

    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("task: {name: dataset, source: x.jsonl, template: dapo}\n")
    b.write_text("task: {template: raw}\n")
    assert read_overrides([a, b], ["task.source=y.jsonl"]) == {
        "task": {"name": "dataset", "source": "y.jsonl", "template": "raw"}
    }
    assert read_overrides(a) == read_overrides([a])


def test_shipped_presets_by_name_from_any_folder(tmp_path, monkeypatch):
    """--config lab reads configs/lab.yaml wherever the command runs; a path that does not exist
    names the presets one can type instead."""
    from masktrl.config import PRESETS, load_config, presets

    monkeypatch.chdir(tmp_path)
    assert load_config("lab").to_dict() == load_config(PRESETS / "lab.yaml").to_dict()
    assert load_config(["qwen3-4b", "methods/pdm-agg"]).method_name == "pdm"
    assert {"lab", "tiny", "methods/pdm-agg"} <= set(presets()) and not any(
        p.startswith("accelerate") for p in presets()
    )
    with pytest.raises(ConfigError) as info:
        load_config("configs/lab.yaml")  # relative to the repository root, not to this folder
    assert "config file not found: configs/lab.yaml (shipped presets, by name from any folder: agentic, lab," in str(
        info.value
    )
