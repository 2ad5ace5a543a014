"""``model.max_positions``: the tiny model's context (None: 256). Set, the model holds that many
positions and a longer response passes the context check; unset, every hash is as before; out of
range, on a checkpoint or not an integer it is one line, exit 2, and nothing is written."""

import pytest

from masktrl.config import load_config
from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer
from masktrl.rl.warmstart import new_tiny_model, warmstart_key


@pytest.mark.parametrize(
    "args, words",
    [
        (["--set", "model.max_positions=4"], "model.max_positions must be an integer in [8, 65536], got 4"),
        (["--set", "model.max_positions=true"], "model.max_positions must be an integer"),
        (["--set", "model.max_positions=1.5"], "model.max_positions must be an integer"),
        (["--set", "model.path=some/model", "--set", "model.max_positions=512"], "option of the tiny model"),
        (["--set", "rollout.max_new_tokens=300"], "leaves no room for a prompt in the model's context (256 positions)"),
        (
            ["--set", "model.max_positions=64", "--set", "rollout.max_new_tokens=64"],
            "leaves no room for a prompt in the model's context (64 positions)",
        ),
    ],
)
def test_refused_through_the_cli_with_nothing_written(cli_error, tmp_path, args, words):
    out = tmp_path / "out"
    fast = ["--set", "train.steps=1", "--set", "warmstart.steps=1"]  # should the refusal fail, a short run
    line = cli_error("train", "--out", out, "--run", "r", *fast, *args)
    assert words in line
    assert not out.exists()


def test_the_model_takes_the_context_and_unset_it_is_256_with_the_hash_as_before():
    tok = build_char_tokenizer("0123456789+=")
    wide = load_config(None, ["model.max_positions=512"])
    assert new_tiny_model(wide, tok).config.max_position_embeddings == 512
    plain = load_config(None)
    assert new_tiny_model(plain, tok).config.max_position_embeddings == 256 == TinyModelConfig.max_positions
    assert warmstart_key(wide) != warmstart_key(plain)
    assert load_config(None, ["model.max_positions=256"]).hash() != plain.hash()  # set is set, even to the default


def test_a_long_response_fits_a_wider_context(tmp_path):
    from typer.testing import CliRunner

    from masktrl.cli import app

    args = ["train", "--dry-run", "--out", str(tmp_path / "out"), "--set", "model.max_positions=512"]
    result = CliRunner().invoke(app, [*args, "--set", "rollout.max_new_tokens=300"])
    assert result.exit_code == 0, result.output
