"""Bad input a hostile tester found past the checks, each run as the user types it: one line on
stderr and exit code 2, nothing stored replaced, nothing written outside what was asked."""

import pytest

from tests.conftest import cli, copy_run, write_tiny_config


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A complete 2-step run (copy it before changing it)."""
    base = tmp_path_factory.mktemp("hostile")
    config = write_tiny_config(base / "tiny.yaml")
    cli("train", "--config", config, "--out", base / "out", "--run", "r")
    return config, base / "out", base / "out" / "r"


def snapshot(root):
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("dry_run", [(), ("--dry-run",)])
def test_resume_force_cannot_shorten_a_run(finished, tmp_path, cli_error, dry_run):
    """``--resume --force --set train.steps=1`` on a run of 2 steps rewrote its summary and
    run.yaml to say 1 step while checkpoint 2 and its metrics stayed."""
    _, out, root = copy_run(finished, tmp_path)
    before = snapshot(root)
    line = cli_error("train", "--resume", root, "--force", "--set", "train.steps=1", *dry_run)
    assert "train.steps=1 is below the 2 steps this run has trained" in line and "nothing was changed" in line
    assert snapshot(root) == before


@pytest.mark.parametrize("damage", ["truncate", "folder"])
def test_runs_lists_a_run_with_a_damaged_run_yaml_as_damaged(finished, tmp_path, damage):
    """``masktrl runs`` listed a run whose run.yaml fails its recorded hash (or is a folder) as
    complete, while eval, resume and the analyses refuse it."""
    _, out, root = copy_run(finished, tmp_path)
    text = (root / "run.yaml").read_text()
    if damage == "truncate":
        (root / "run.yaml").write_text(text[:100])
    else:
        (root / "run.yaml").unlink()
        (root / "run.yaml").mkdir()
    result = cli("runs", "--out", out)
    assert "damaged r: run.yaml: " in result.output and "complete" not in result.output
