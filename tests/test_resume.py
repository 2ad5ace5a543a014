"""Crash safety: SIGKILL at several points, then --resume reproduces the uninterrupted run
bit for bit; corrupted artifacts are reported by path and never used."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import TIMING, masktrl, masktrl_env, write_tiny_config

RESUME = {"seed": 3, "method": {"name": "sis"}, "train": {"steps": 6, "checkpoint_every": 2, "minibatches": 2}}


def metrics(root):
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def weights(root, step=6):
    return load_file(root / "checkpoints" / f"{step:06d}" / "model.safetensors")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    cfg = write_tiny_config(base / "c.yaml", RESUME)
    r = masktrl("train", "--config", str(cfg), "--out", str(base / "out"), "--run", "ref")
    assert r.returncode == 0, r.stderr
    return base, cfg, base / "out" / "ref"


@pytest.mark.parametrize(
    "point",
    [  # two of the four windows run in the slow suite only, to keep the fast suite under ~15 minutes
        pytest.param("rollout-write:3", marks=pytest.mark.slow),
        "update:4",
        pytest.param("checkpoint-write:4", marks=pytest.mark.slow),
        "rollout-write:1",
    ],
)
def test_sigkill_then_resume_is_bit_identical(reference, point):
    base, cfg, ref = reference
    name = "crash-" + point.replace(":", "-")
    r = masktrl(
        "train", "--config", str(cfg), "--out", str(base / "out"), "--run", name, env={"MASKTRL_CRASH_AT": point}
    )
    assert r.returncode == -9, (r.returncode, r.stderr[-2000:])
    root = base / "out" / name
    assert not (root / "summary.json").exists()
    r = masktrl("train", "--resume", name, "--out", str(base / "out"))
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = weights(ref), weights(root)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert metrics(ref) == metrics(root)
    assert not list(root.rglob("*.tmp"))  # no half-written checkpoint left behind
    summary = json.loads((root / "summary.json").read_text())
    assert summary["eval_after"] == json.loads((ref / "summary.json").read_text())["eval_after"]


def test_resume_refuses_a_changed_config_naming_the_keys(reference):
    base, cfg, ref = reference
    r = masktrl("train", "--resume", "ref", "--out", str(base / "out"), "--set", "train.lr=0.5", "--set", "seed=4")
    assert r.returncode == 2 and "train.lr" in r.stderr and "seed" in r.stderr and "--force" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.fixture
def crashed_copy(reference, tmp_path):
    """A run killed after step 3's rollout, copied so each corruption test has its own."""
    base, cfg, _ = reference
    out = tmp_path / "out"
    shutil.copytree(base / "out" / ".cache", out / ".cache")
    r = masktrl("train", "--config", str(cfg), "--out", str(out), "--run", "c", env={"MASKTRL_CRASH_AT": "update:4"})
    assert r.returncode == -9
    return out, out / "c"


def _files(root):
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _resume_fails_naming(out, needle, *args):
    before = _files(out / "c")
    r = masktrl("train", "--resume", "c", "--out", str(out), *args)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr
    assert _files(out / "c") == before  # checked before anything is written: not even the manifest's status changed


def test_truncated_rollout_parquet_is_reported(crashed_copy):
    out, root = crashed_copy
    p = root / "steps" / "000004" / "rollouts.parquet"
    p.write_bytes(p.read_bytes()[:100])
    _resume_fails_naming(out, "steps/000004/rollouts.parquet")


def test_flipped_byte_in_checkpoint_is_reported(crashed_copy):
    out, root = crashed_copy
    p = root / "checkpoints" / "000002" / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    _resume_fails_naming(out, "checkpoints/000002/model.safetensors")
    # --force with a changed config records the new config only once the run is found sound
    _resume_fails_naming(out, "checkpoints/000002/model.safetensors", "--force", "--set", "train.lr=0.002")


def test_deleted_manifest_is_reported(crashed_copy):
    out, root = crashed_copy
    (root / "manifest.json").unlink()
    _resume_fails_naming(out, "manifest.json")


def test_edited_run_yaml_is_reported(crashed_copy):
    out, root = crashed_copy
    p = root / "run.yaml"
    p.write_text(p.read_text().replace("lr: 0.001", "lr: 0.002"))
    _resume_fails_naming(out, "run.yaml")


def test_ctrl_c_finishes_the_step_checkpoints_and_resumes_exactly(reference):
    import signal
    import time

    base, cfg, ref = reference
    env = masktrl_env()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "masktrl.cli",
            "train",
            "--config",
            str(cfg),
            "--out",
            str(base / "out"),
            "--run",
            "ctrlc",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    manifest = base / "out" / "ctrlc" / "manifest.json"
    deadline = time.time() + 240
    while time.time() < deadline and not (manifest.exists() and "step/000001/train" in manifest.read_text()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err[-2000:]
    root = base / "out" / "ctrlc"
    m = json.loads(manifest.read_text())
    assert m["status"] == "interrupted"
    done = [k for k in m["stages"] if k.startswith("checkpoint/")]
    assert done, "the interrupted step was checkpointed"
    last = max(int(k.split("/")[1]) for k in done)
    assert last < 6 and len(metrics(root)) == last  # stopped right after the checkpointed step
    r = masktrl("train", "--resume", "ctrlc", "--out", str(base / "out"))
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = weights(ref), weights(root)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert metrics(ref) == metrics(root)


@pytest.mark.slow
def test_a_fused_adamw_run_killed_in_an_update_resumes_bit_identically(tmp_path):
    """train.adamw=fused: the optimizer rebuilt from run.yaml with the checkpoint's state continues
    as the uninterrupted run, bit for bit."""
    cfg = write_tiny_config(tmp_path / "c.yaml", {**RESUME, "train": {**RESUME["train"], "adamw": "fused"}})
    out = tmp_path / "out"
    assert masktrl("train", "--config", str(cfg), "--out", str(out), "--run", "ref").returncode == 0
    r = masktrl(
        "train", "--config", str(cfg), "--out", str(out), "--run", "crash", env={"MASKTRL_CRASH_AT": "update:4"}
    )
    assert r.returncode == -9, (r.returncode, r.stderr[-2000:])
    r = masktrl("train", "--resume", "crash", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = weights(out / "ref"), weights(out / "crash")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert metrics(out / "ref") == metrics(out / "crash")
