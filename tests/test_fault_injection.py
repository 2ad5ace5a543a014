"""Fault injection: a run killed (SIGKILL) at random points, 20 seeded trials, then resumed, ends
exactly where an uninterrupted run ends (weights, metrics, manifest), and no stage is ever
recorded as done without its files."""

import json
import random
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
    f"checkpoint-write:{step}" for step in (2, 4, 5)  # the steps that checkpoint
]
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


def test_random_kills_then_resume_equal_an_uninterrupted_run(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(CONFIG)
    out = tmp_path / "out"
    t0 = time.time()
    r = masktrl("train", "--config", config, "--out", out, "--run", "ref")
    assert r.returncode == 0, r.stderr[-2000:]
    duration = time.time() - t0
    ref = out / "ref"
    rng = random.Random(20240611)
    for trial in range(20):
        name = f"t{trial}"
        root = out / name
        if trial % 2 == 0:  # a chosen point of the step (fault injection)
            spec = rng.choice(CRASH_POINTS)
            r = masktrl("train", "--config", config, "--out", out, "--run", name, env={"MASKTRL_CRASH_AT": spec})
            assert r.returncode == -signal.SIGKILL, (spec, r.stderr[-2000:])
        else:  # any moment: imports, warm start, a manifest write, the final evaluation...
            proc = masktrl("train", "--config", config, "--out", out, "--run", name, wait=False)
            time.sleep(rng.uniform(0.0, duration))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert_nothing_done_without_its_files(root)
        resumable = (root / "manifest.json").is_file()
        args = ["--resume", name] if resumable else ["--config", config, "--run", name]  # else: the same command again
        r = masktrl("train", *args, "--out", out)
        assert r.returncode == 0, (trial, r.stderr[-3000:])
        a = load_file(ref / "checkpoints" / f"{STEPS:06d}" / "model.safetensors")
        b = load_file(root / "checkpoints" / f"{STEPS:06d}" / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), trial
        assert metrics(ref) == metrics(root), trial
        assert stable_manifest(ref) == stable_manifest(root), trial
        assert not list(root.rglob("*.tmp")), trial
        assert_nothing_done_without_its_files(root)
