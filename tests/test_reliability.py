"""Hostile input and flaky machines (docs/RELIABILITY.md): every probe of the table there, each
answered by one line and exit code 2, or by a run that stays true."""

import json
import os
import shutil
import stat

import pytest
from typer.testing import CliRunner

from masktrl.cli import app
from masktrl.config import load_config
from masktrl.errors import ConfigError
from masktrl.io import atomic_write_json, file_mode
from tests.conftest import TINY_TEST_YAML

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def one_line_error(result, needle: str) -> str:
    """The command failed as a user error: exit 2, one line naming ``needle``, no traceback."""
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert "Traceback" not in result.output
    assert any(needle in line for line in lines), result.output
    return lines[-1]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A complete 2-step run (copy it before changing it)."""
    base = tmp_path_factory.mktemp("rel")
    config = base / "tiny.yaml"
    config.write_text(TINY_TEST_YAML)
    r = invoke("train", "--config", config, "--out", base / "out", "--run", "r")
    assert r.exit_code == 0, (r.output, r.exception)
    return config, base / "out", base / "out" / "r"


def copy_run(finished, tmp_path):
    config, out, root = finished
    shutil.copytree(out, tmp_path / "out")
    return config, tmp_path / "out", tmp_path / "out" / root.name


# --------------------------------------------------------------------------- finite values


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.lr=1e400", "train.lr must be a finite number"),  # YAML reads 1e400 as inf
        ("train.weight_decay=.inf", "train.weight_decay must be a finite number"),
        ("rollout.temperature=.inf", "rollout.temperature must be a finite number"),
        ("rollout.top_p=.nan", "rollout.top_p must be a finite number"),
        ("seed=100000000000000000000000000", "seed is out of range"),
        ("seed=-1", "seed must be in [0, 4294967295]"),
        ("train.steps=99999999999", "train.steps is out of range"),
        ("rollout.gpu_memory_utilization=2", "rollout.gpu_memory_utilization must be in (0, 1]"),
        ("train.max_nonfinite_steps=0", "train.max_nonfinite_steps"),
    ],
)
def test_config_rejects_infinities_and_out_of_range_numbers(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert needle in str(info.value)


# --------------------------------------------------------------------------- bounded inputs


def test_files_are_written_with_the_users_umask(finished):
    _, out, root = finished
    want = file_mode()  # 0o644 under the usual umask 022
    modes = {p.relative_to(out): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
    assert modes and {p: m for p, m in modes.items() if m != want} == {}
    assert want == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_atomic_writes_follow_the_umask(tmp_path):
    atomic_write_json(tmp_path / "a.json", {"x": 1})
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == file_mode() != 0o600
