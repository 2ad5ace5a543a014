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


def step2_error(root, samples) -> float:
    """The largest |recorded log mu - checkpoint 1's float64 log-probability| over the policy
    tokens of step 2's samples (an environment token must record -inf)."""
    model = AutoModelForCausalLM.from_pretrained(root / "checkpoints" / "000001").float().eval()
    worst = 0.0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.gen.response_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0, len(s.prompt_ids) - 1 : -1].double(), -1)
        want = lp.gather(1, torch.tensor(s.gen.response_ids)[:, None]).squeeze(1)
        got = torch.tensor(s.gen.logp, dtype=torch.float64)
        policy = torch.tensor(s.gen.source or [0] * len(got)) == 0
        assert torch.isneginf(got[~policy]).all()
        worst = max(worst, (want[policy] - got[policy]).abs().max().item())
    return worst


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
    assert step2_error(root, samples) < 1e-4


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


AGENTIC = (  # the agentic lab, 2 steps, with 2 heads of 32 (the CPU kernels' smallest head size)
    "rollout.engine=vllm",
    "rollout.enforce_eager=true",
    "model.num_heads=2",
    "train.steps=2",
    "rollout.prompts_per_step=4",
    "rollout.n=4",
    "warmstart.steps=40",
    "task.n_test=8",
    "train.eval_every=0",
    "train.checkpoint_every=1",
)


def test_multi_turn_agentic_run_with_vllm(tmp_path):
    """`masktrl train --config agentic --set rollout.engine=vllm`: episodes call the search tool
    through vLLM; step 2's policy tokens carry checkpoint 1's log-probabilities at the episode's
    exact token prefix, the tool's tokens none."""
    pytest.importorskip("vllm")
    args = [sys.executable, "-m", "masktrl.cli", "train", "--config", "agentic", "--out", str(tmp_path / "out")]
    args += ["--run", "a"] + [x for s in AGENTIC for x in ("--set", s)]
    r = subprocess.run(args, capture_output=True, text=True, env={**os.environ, **CPU_ENV}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    root = tmp_path / "out" / "a"
    samples, meta = read_rollouts(root / "steps" / "000002" / "rollouts.parquet")
    assert meta["engine"] == "vllm" and len(samples) == 16
    assert sum(1 in s.gen.source for s in samples) >= 4  # episodes with a tool reply
    assert step2_error(root, samples) < 1e-4


def test_head_size_the_cpu_build_cannot_run_is_one_line(tmp_path):
    """The agentic preset's 4 heads of 16: vLLM's CPU attention has no kernel for 16; one line,
    exit 2, before the warm start."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the check concerns the CPU build")
    args = [sys.executable, "-m", "masktrl.cli", "train", "--config", "agentic", "--out", str(tmp_path / "out")]
    args += ["--set", "rollout.engine=vllm"]
    r = subprocess.run(args, capture_output=True, text=True, env={**os.environ, **CPU_ENV}, timeout=600)
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and "head sizes" in lines[0], r.stderr[-3000:]
    assert not (tmp_path / "out").exists()  # nothing written, not even the cache folder vLLM's import made
