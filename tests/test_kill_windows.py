"""A SIGKILL inside every run-store write leaves a state that the documented command (the same
command again) continues exactly: each crash point of ``runs/faults.py`` once, on a new run, a
resume, a restart in place with a fixed config, and ``--resume --force``
(docs/RELIABILITY.md, *Fault injection*; the seeded many-trial version is
tests/test_fault_injection.py)."""

import json
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

from masktrl.runs.faults import STORE_POINTS
from tests.conftest import cli, masktrl, write_tiny_config
from tests.test_fault_injection import assert_nothing_done_without_its_files, metrics, stable_manifest

LR = ("--set", "train.lr=2e-3")  # the restart's fixed config
MORE = ("--force", "--set", "train.steps=3")  # --resume --force extends the run


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """Uninterrupted runs: ``a`` (the tiny config), ``b`` (with LR), ``f`` (``a`` extended by
    ``--resume --force``), all under one outputs folder whose warm-start cache the trials copy."""
    base = tmp_path_factory.mktemp("kill")
    config = write_tiny_config(base / "tiny.yaml")
    out = base / "out"
    cli("train", "--config", config, "--out", out, "--run", "a")
    cli("train", "--config", config, "--out", out, "--run", "b", *LR)
    shutil.copytree(out / "a", out / "f")
    (out / "f" / ".manifest.lock").unlink(missing_ok=True)
    cli("train", "--resume", "f", "--out", out, *MORE)
    return config, out


def trial_out(refs, tmp_path):
    config, out = refs
    shutil.copytree(out / ".cache", tmp_path / "out" / ".cache")
    return config, tmp_path / "out"


def killed(*args, at: str):
    r = masktrl("train", *args, env={"MASKTRL_CRASH_AT": at})
    assert r.returncode == -signal.SIGKILL, (at, r.returncode, r.stderr[-2000:])


def assert_same(ref, root, steps):
    a = load_file(ref / "checkpoints" / f"{steps:06d}" / "model.safetensors")
    b = load_file(root / "checkpoints" / f"{steps:06d}" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert metrics(ref) == metrics(root)
    assert stable_manifest(ref) == stable_manifest(root)
    assert not list(root.rglob("*.tmp")) and not (root / "run.yaml.new").exists()
    assert_nothing_done_without_its_files(root)


def test_every_store_point_is_exercised_below():
    covered = {"manifest-write", "config-write", "config-rename", "restart-delete", "summary-write", "rewind-metrics"}
    assert covered == set(STORE_POINTS)


SLOW = pytest.mark.slow  # each point once stays in the fast suite; the others run in the slow stage


def interrupted(root, *, keep: int):
    """The copied complete run as a run SIGKILLed after its checkpoint ``keep`` (0: before its
    first one): the later checkpoints, the summary and eval/after gone, status running."""
    m = json.loads((root / "manifest.json").read_text())
    for key in list(m["stages"]):
        if (key.startswith("checkpoint/") and int(key.split("/")[1]) > keep) or key in ("summary", "eval/after"):
            del m["stages"][key]
    for ckpt in (root / "checkpoints").iterdir():
        if int(ckpt.name) > keep:
            shutil.rmtree(ckpt)
    (root / "summary.json").unlink()
    (root / "manifest.json").write_text(json.dumps({**m, "status": "running", "pid": 2**22 + 12345}))


def copied(refs, out, name="a"):
    shutil.copytree(refs[1] / name, out / "t")
    return out / "t"


@pytest.mark.parametrize(
    "at",
    [
        pytest.param("manifest-write:1", marks=SLOW),
        pytest.param("config-write:1", marks=SLOW),
        "manifest-write:2",
        pytest.param("manifest-write:6", marks=SLOW),
        "summary-write:1",
    ],
)
def test_a_new_run_killed_inside_a_store_write_continues_with_the_same_command(refs, tmp_path, at):
    config, out = trial_out(refs, tmp_path)
    command = ("--config", config, "--out", out, "--run", "t")
    killed(*command, at=at)
    assert_nothing_done_without_its_files(out / "t")
    cli("train", *command)
    assert_same(refs[1] / "a", out / "t", 2)


def test_a_resume_killed_between_its_rewind_writes_continues(refs, tmp_path):
    config, out = trial_out(refs, tmp_path)
    interrupted(copied(refs, out), keep=1)
    killed("--resume", "t", "--out", out, at="rewind-metrics:1")
    cli("train", "--config", config, "--out", out, "--run", "t")
    assert_same(refs[1] / "a", out / "t", 2)


@pytest.mark.parametrize(
    "at",
    [
        "config-write:1",
        "restart-delete:1",
        pytest.param("manifest-write:1", marks=SLOW),
        pytest.param("config-rename:1", marks=SLOW),
    ],
)
def test_a_restart_in_place_killed_inside_its_writes_continues_with_the_same_command(refs, tmp_path, at):
    config, out = trial_out(refs, tmp_path)
    interrupted(copied(refs, out), keep=0)  # killed before its first checkpoint
    fixed = ("--config", config, "--out", out, "--run", "t", *LR)
    killed(*fixed, at=at)
    assert_nothing_done_without_its_files(out / "t")
    cli("train", *fixed)
    assert_same(refs[1] / "b", out / "t", 2)
    assert json.loads((out / "t" / "manifest.json").read_text())["attempts"]  # the first attempt is remembered


@pytest.mark.parametrize(
    "at", [pytest.param("config-write:1", marks=SLOW), pytest.param("manifest-write:1", marks=SLOW), "config-rename:1"]
)
def test_resume_force_killed_inside_its_config_record_continues_with_the_same_command(refs, tmp_path, at):
    config, out = trial_out(refs, tmp_path)
    copied(refs, out)
    killed("--resume", "t", "--out", out, *MORE, at=at)
    run_yaml = (out / "t" / "run.yaml").read_text()
    assert "steps: 2" in run_yaml or "steps: 3" in run_yaml  # one of the two configs, whole
    cli("train", "--resume", "t", "--out", out, *MORE)
    assert_same(refs[1] / "f", out / "t", 3)
