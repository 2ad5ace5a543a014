"""Bad input: one clear line on stderr, exit code 2, no traceback, nothing stored touched."""

import pytest

from tests.conftest import masktrl


@pytest.mark.parametrize(
    "args, needle",
    [
        (["train", "--set", "train.lr=abc"], "train.lr"),
        (["train", "--config", "missing.yaml"], "missing.yaml"),
        (["train", "--method", "nosuch"], "nosuch"),
        (["train", "--set", "rollout.nosuch=1"], "rollout.nosuch"),
        (["train", "--set", "method.divergence=topk-tv"], "divergence"),  # grpo has no divergence
        (["train", "--set", "method.dual_clip=0.9"], "method.dual_clip must be > 1"),
        (["train", "--method", "gspo", "--set", "method.dual_clip=3"], "dual_clip"),  # gspo has none
    ],
)
def test_user_errors_exit_2_with_one_line(tmp_path, args, needle):
    r = masktrl(*args, "--out", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert not any(tmp_path.glob("*/run.yaml"))  # no run folder was started


def test_existing_run_is_never_overwritten(tmp_path):
    run = tmp_path / "r1"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    r = masktrl("train", "--run", "r1", "--out", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "already exists" in r.stderr
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_debug_env_shows_the_traceback(tmp_path):
    r = masktrl("train", "--method", "nosuch", cwd=tmp_path, env={"MASKTRL_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_help_lists_working_subcommands():
    r = masktrl("--help")
    assert r.returncode == 0 and "train" in r.stdout


@pytest.mark.parametrize(
    "model, needle", [("/nonexistent/model", "no such model folder"), ("nosuchorg/nosuchmodel", "local hub cache")]
)
def test_missing_models_are_one_line_and_never_downloaded(tmp_path, model, needle):
    r = masktrl(
        "rollout",
        "--model",
        model,
        "--data",
        "synthetic",
        "--output",
        str(tmp_path / "r.parquet"),
        cwd=tmp_path,
        env={"HF_HOME": str(tmp_path / "hf")},
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "https://" not in r.stderr.replace(lines[0], "")  # no download attempt was logged


def test_usage_errors_are_one_line_like_every_other_error(cli_error):
    """An unknown flag, a missing option or an unknown command: one red line and exit code 2
    (typer alone draws a multi-line box)."""
    assert "No such option: --bogus" in cli_error("train", "--bogus") and "train --help" in cli_error(
        "train", "--bogus"
    )
    assert "Missing option '--model'" in cli_error("rollout", "--data", "synthetic")
    assert "No such command 'nosuch'" in cli_error("nosuch")
