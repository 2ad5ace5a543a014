"""Messages that named the wrong problem, and flags that contradicted each other silently: each
is one line naming what is wrong, exit code 2, nothing written."""

import pytest

from masktrl.config import load_config
from masktrl.errors import ConfigError


@pytest.mark.parametrize(
    "flags, override, line",
    [
        (("--seed", "1"), "seed=2", "error: --set seed=2 conflicts with --seed 1: drop one"),
        (
            ("--method", "grpo"),
            "method.name=dppo",
            "error: --set method.name=dppo conflicts with --method grpo: drop one",
        ),
        (("--method", "grpo"), "method=dppo", "error: --set method=dppo conflicts with --method grpo: drop one"),
    ],
)
@pytest.mark.parametrize("command", ["train", "config"])
def test_a_set_that_contradicts_its_flag_is_refused(tmp_path, cli_error, command, flags, override, line):
    """``--seed 1 --set seed=2`` trained seed 2 and ``--method grpo --set method.name=dppo``
    trained dppo: the flag was dropped without a word (``sweep`` refused the same conflict)."""
    argv = ("train", "--dry-run", "--out", tmp_path / "out") if command == "train" else ("config", "show")
    assert cli_error(*argv, *flags, "--set", override) == line
    assert not (tmp_path / "out").exists()


def test_a_set_that_repeats_its_flag_is_no_conflict():
    cfg = load_config(None, ["seed=3", "method.name=sis"], seed=3, method="sis")
    assert (cfg.seed, cfg.method.name) == (3, "sis")
    assert load_config(None, ["seed=3"]).seed == 3  # no flag: --set alone sets it
    with pytest.raises(ConfigError, match="conflicts with --seed 4"):
        load_config(None, ["seed=3"], seed=4)


def test_config_that_is_a_folder_or_empty(tmp_path, cli_error):
    """``--config DIR`` said "config file not found: DIR", and ``--config ''`` "config file not
    found: .", both followed by the list of presets."""
    line = cli_error("train", "--config", tmp_path, "--out", tmp_path / "out")
    assert line == f"error: config {tmp_path} is a folder: give a YAML file or a preset name"
    for empty in ("", " "):
        line = cli_error("config", "show", "--config", "lab", "--config", empty)
        assert "'--config' / '-c': is empty; give a YAML file or a preset name" in line
    assert not (tmp_path / "out").exists()


def test_eval_data_that_is_a_folder(tmp_path, cli_error):
    """``eval --data DIR`` said "unsupported file type '(none)'"."""
    line = cli_error("eval", "aime", "--data", tmp_path, "--model", "tiny", "--out", tmp_path / "out")
    assert line == f"error: {tmp_path} is a folder: give a .jsonl/.json/.parquet file"
    assert not (tmp_path / "out").exists()


def test_a_file_where_a_folder_of_runs_or_a_run_is_expected(tmp_path, cli_error):
    """``runs --out FILE`` and ``analyze compare FILE`` said "no such folder" of a file."""
    path = tmp_path / "notes.txt"
    path.write_text("x")
    assert cli_error("runs", "--out", path) == f"error: {path} is a file, not a folder of runs"
    assert cli_error("analyze", "compare", path) == f"error: {path}: a file, not a run folder"
    assert path.read_text() == "x"


def test_sweep_empty_baseline(tmp_path, cli_error):
    """``sweep --baseline ''`` said "--baseline  is not among the swept methods"."""
    line = cli_error("sweep", "--baseline", "", "--out", tmp_path / "out")
    assert line == "error: --baseline is empty: give one of the swept methods (grpo, dppo, pdm, sis)"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["1e-320", "1e-6", "0"])
def test_a_vanishing_rollout_temperature_is_refused(tmp_path, cli_error, value):
    """``--set rollout.temperature=1e-320`` passed ``--dry-run`` and failed at step 1 with "its
    weights have diverged" (1e-320 is 0 in float32: logits / T are infinite)."""
    line = cli_error("train", "--dry-run", "--out", tmp_path / "out", "--set", f"rollout.temperature={value}")
    assert line.startswith("error: rollout.temperature must be a finite number >= 1e-05 (below it sampling is greedy")
    assert line.endswith(f"got {float(value)}") or line.endswith(f"got {value}")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["", "  "])
def test_compare_empty_metric(tmp_path, cli_error, value):
    """``analyze compare --metric ''`` said "metric  was never logged" of the first run."""
    line = cli_error("analyze", "compare", tmp_path, "--metric", value)
    assert line.startswith(
        "error: Invalid value for '--metric': is empty; give a logged metric (eval/heldout/accuracy, "
        "eval/<bench>/avg_at_k), or leave --metric out (see `"
    )


def test_a_value_with_a_line_break_stays_on_the_error_line(tmp_path, cli_error):
    """``runs --out $'a\\nb'`` (and ``--config``, ``--baseline``, ``--accelerate-config`` alike)
    printed the value's line break: an error of two lines. Control characters are now shown escaped."""
    line = cli_error("runs", "--out", tmp_path / "a\nb\x1b[31m")
    assert line == f"error: no such folder: {tmp_path}/a\\nb\\x1b[31m"
