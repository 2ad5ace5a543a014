"""`masktrl train --set rollout.engine=vllm` end to end on CPU (run in the vLLM venv:
scripts/test_vllm.sh). The trainer updates a transformers model and pushes its weights into
vLLM after every step; the rollouts of step 2 must come from the weights after step 1."""

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from masktrl.rollout.storage import read_rollouts
from tests.conftest import write_tiny_config

pytestmark = pytest.mark.vllm

VLLM = {
    "method": {"name": "dppo"},
    "model": {"hidden_size": 64, "intermediate_size": 128},
    "rollout": {"engine": "vllm", "enforce_eager": True},
    "train": {"lr": 3.0e-3},
}
CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCH_COMPILE_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def test_two_steps_with_vllm_rollouts_and_weight_sync(tmp_path):
    pytest.importorskip("vllm")
    cfg = write_tiny_config(tmp_path / "c.yaml", VLLM)
    env = {**os.environ, **CPU_ENV}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "masktrl.cli",
            "train",
            "--config",
            str(cfg),
            "--out",
            str(tmp_path / "out"),
            "--run",
            "v",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    root = tmp_path / "out" / "v"
    samples, meta = read_rollouts(root / "steps" / "000002" / "rollouts.parquet")
    assert meta["engine"] == "vllm" and len(samples) == 24
    # step 2 was sampled by vLLM after the sync of step 1's update: recompute with that checkpoint
    model = AutoModelForCausalLM.from_pretrained(root / "checkpoints" / "000001").float().eval()
    worst = 0.0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.gen.response_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0, len(s.prompt_ids) - 1 : -1].double(), -1)
        want = lp.gather(1, torch.tensor(s.gen.response_ids)[:, None]).squeeze(1)
        worst = max(worst, (want - torch.tensor(s.gen.logp, dtype=torch.float64)).abs().max().item())
    assert worst < 1e-4, worst


def test_sleep_mode_from_the_config_on_cpu_is_one_line(tmp_path):
    """rollout.sleep_mode reaches the engine; the CPU build has no sleep mode: one line, exit 2."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if current_platform.is_sleep_mode_available():
        pytest.skip("this platform supports sleep mode")
    cfg = write_tiny_config(tmp_path / "c.yaml", VLLM)
    env = {**os.environ, **CPU_ENV}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "masktrl.cli",
            "train",
            "--config",
            str(cfg),
            "--out",
            str(tmp_path / "out"),
            "--run",
            "s",
            "--set",
            "rollout.sleep_mode=true",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and "sleep mode is not available" in lines[0], r.stderr[-3000:]
