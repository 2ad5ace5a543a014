"""Fault injection: a run killed (SIGKILL) at random points, 36 seeded trials, then continued by
the documented command, ends exactly where an uninterrupted run ends (weights, metrics,
manifest), and no stage is ever recorded as done without its files. The points: a step's
(rollout-write, update, checkpoint-write), any moment of the wall time, and inside every
run-store write (``runs/faults.py``) of a new run, a resume, a restart in place with a fixed
config and a ``--resume --force``. tests/test_kill_windows.py covers each store point once in
the fast suite."""

import json
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from masktrl.runs.store import RunStore
from tests.conftest import TIMING, masktrl_env

pytestmark = pytest.mark.slow

CONFIG = """\
seed: 3
method: {name: sis}
model: {hidden_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 1, intermediate_size: 64}
task: {name: arithmetic, digits: 1, n_test: 16}
warmstart: {steps: 20, batch_size: 16}
rollout: {prompts_per_step: 6, n: 4, max_new_tokens: 4, logprobs_k: 5}
train: {steps: 5, checkpoint_every: 2, lr: 1.0e-3, minibatches: 2}
"""
STEPS = 5
CRASH_POINTS = [f"{point}:{step}" for point in ("rollout-write", "update") for step in range(1, STEPS + 1)] + [
    f"checkpoint-write:{step}"
    for step in (2, 4, 5)  # the steps that checkpoint
]
STORE_POINTS = [f"manifest-write:{n}" for n in range(1, 31)] + ["config-write:1", "summary-write:1"]
RESTART_POINTS = ["config-write:1", "restart-delete:1", "manifest-write:1", "manifest-write:2", "config-rename:1"]
FORCE_POINTS = ["config-write:1", "manifest-write:1", "manifest-write:2", "config-rename:1", "summary-write:1"]
FIX = ("--set", "train.lr=2e-3")  # the restart's fixed config
MORE = ("--force", "--set", "train.steps=7")  # --resume --force extends the run
UNSTABLE_FILES = ("rng_state.pt", "summary.json")  # the global RNG state and the wall time differ run to run


def masktrl(*args, env=None, wait=True):
    e = masktrl_env(env)
    cmd = [sys.executable, "-m", "masktrl.cli", *map(str, args)]
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=300)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=e)


def metrics(root):
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def stable_manifest(root):
    """Every stage with its files' hashes and its measured values, without times and pids."""
    m = json.loads((root / "manifest.json").read_text())
    out = {}
    for name, entry in m["stages"].items():
        files = {f: h for f, h in entry.get("files", {}).items() if not f.endswith(UNSTABLE_FILES)}
        out[name] = (entry["status"], files, entry.get("accuracy"), entry.get("step"))
    return m["status"], out


def assert_nothing_done_without_its_files(root):
    """What the manifest records as done is there and intact."""
    if not (root / "manifest.json").is_file():
        return
    store = RunStore(root, writable=False)
    for name, entry in store.manifest["stages"].items():
        if entry["status"] == "done" and entry.get("files"):
            store.verify(name)
        if name.startswith("checkpoint/"):
            assert (root / "checkpoints" / name.split("/")[1] / "model.safetensors").is_file(), name


def killed(out, args, spec):
    r = masktrl("train", *args, "--out", out, env={"MASKTRL_CRASH_AT": spec})
    assert r.returncode in (-signal.SIGKILL, 0), (spec, r.stderr[-2000:])  # 0: the point comes later than this run goes


def same_as(ref, root, steps, trial):
    a = load_file(ref / "checkpoints" / f"{steps:06d}" / "model.safetensors")
    b = load_file(root / "checkpoints" / f"{steps:06d}" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), trial
    assert metrics(ref) == metrics(root), trial
    assert stable_manifest(ref) == stable_manifest(root), trial
    assert not list(root.rglob("*.tmp")) and not (root / "run.yaml.new").exists(), trial
    assert_nothing_done_without_its_files(root)


def test_random_kills_then_resume_equal_an_uninterrupted_run(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG)
    out = tmp_path / "out"
    t0 = time.time()
    r = masktrl("train", "--config", config, "--out", out, "--run", "ref")
    assert r.returncode == 0, r.stderr[-2000:]
    duration = time.time() - t0
    ref = out / "ref"
    assert masktrl("train", "--config", config, "--out", out, "--run", "ref-fixed", *FIX).returncode == 0
    shutil.copytree(ref, out / "ref-more")
    assert masktrl("train", "--resume", "ref-more", "--out", out, *MORE).returncode == 0
    rng = random.Random(20240611)
    for trial in range(36):
        name = f"t{trial}"
        root = out / name
        command = ["--config", config, "--run", name]
        kind = trial % 6
        if kind in (0, 1):  # a chosen point of the step (fault injection)
            spec = rng.choice(CRASH_POINTS)
            r = masktrl("train", *command, "--out", out, env={"MASKTRL_CRASH_AT": spec})
            assert r.returncode == -signal.SIGKILL, (spec, r.stderr[-2000:])
        elif kind == 2:  # any moment: imports, warm start, a manifest write, the final evaluation...
            proc = masktrl("train", *command, "--out", out, wait=False)
            time.sleep(rng.uniform(0.0, duration))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        elif kind == 3:  # inside a store write of a new run
            killed(out, command, rng.choice(STORE_POINTS))
        elif kind == 4:  # inside a restart in place with a fixed config (the first attempt killed before a checkpoint)
            killed(out, command, rng.choice(["rollout-write:1", "update:1", "rollout-write:2", "update:2"]))
            command = [*command, *FIX]
            killed(out, command, rng.choice(RESTART_POINTS))
        else:  # inside --resume --force of a complete run, or inside the rewind of a resume
            if rng.random() < 0.5:
                shutil.copytree(ref, root)
                command = ["--resume", name, *MORE]
                killed(out, command, rng.choice(FORCE_POINTS))
            else:
                killed(out, command, "update:4")  # a resume from checkpoint 2 rewinds step 3
                command = ["--resume", name]
                killed(out, command, "rewind-metrics:1")
        assert_nothing_done_without_its_files(root)
        if command[0] == "--resume" or kind == 4:
            args = command  # the documented command: the same command again
        else:
            resumable = (root / "manifest.json").is_file()
            args = ["--resume", name] if resumable else command  # else: the same command again
        r = masktrl("train", *args, "--out", out)
        assert r.returncode == 0, (trial, r.stderr[-3000:])
        if "--force" in command:
            same_as(out / "ref-more", root, 7, trial)
        elif kind == 4:
            same_as(out / "ref-fixed", root, STEPS, trial)
        else:
            same_as(ref, root, STEPS, trial)
        print(f"trial {trial} ({kind=}): resumed bit-identically", flush=True)
