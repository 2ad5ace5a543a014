"""The GPU check's driver (benchmarks/gpu_check.py) on CPU: the tiny shape, the transformers
engine, float32 or bf16. The GPU-only parts (vLLM, its sleep mode, CUDA) are the engine
choice and the shape; everything else is the code the GPU runs."""

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DS_CPU = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config: {zero_stage: 2, offload_optimizer_device: none, offload_param_device: none, zero3_init_flag: false}
num_machines: 1
machine_rank: 0
num_processes: 1
mixed_precision: 'no'
rdzv_backend: static
same_network: true
use_cpu: false
"""


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    sys.modules.pop("gpu_check", None)
    return importlib.import_module("gpu_check")


def test_position_buckets(gpu_check):
    assert [gpu_check._bucket(t) for t in (0, 1, 2, 3, 4, 7, 8, 15, 16)] == [
        "0",
        "1",
        "2-3",
        "2-3",
        "4-7",
        "4-7",
        "8-15",
        "8-15",
        "16-31",
    ]


def test_qwen3_shape_is_the_0_6b_config(gpu_check):
    s = gpu_check.SHAPES["qwen3-0.6b"]
    assert (
        s["hidden_size"],
        s["num_hidden_layers"],
        s["num_attention_heads"],
        s["num_key_value_heads"],
        s["head_dim"],
        s["intermediate_size"],
        s["numbers"] + 4,
    ) == (1024, 28, 16, 8, 128, 3072, 151_936)


def test_one_method_with_the_weight_sync_check(gpu_check, tmp_path):
    out = tmp_path / "r.json"
    rc = gpu_check.main(
        [
            "--shape",
            "tiny",
            "--engine",
            "hf",
            "--steps",
            "2",
            "--methods",
            "grpo",
            "--no-zero2",
            "--work",
            str(tmp_path / "w"),
            "--json",
            str(out),
        ]
    )
    r = json.loads(out.read_text())
    assert rc == 0 and r["ok"] and r["complete"], r
    assert "projected disk" in (tmp_path / "r-grpo.log").read_text()  # the run's output, kept beside the JSON
    run = r["runs"]["grpo"]
    assert run["ok"] and run["steps"] == 2 and run["generation_tokens_per_s"] > 0
    sync = run["weight_sync"]
    assert sync["rollout_step"] == 2 and sync["sync_ok"]
    synced = sync["at_synced_weights"]
    # the transformers engine samples with the trained model itself: in bf16 the trainer's
    # recomputation differs only by batch-shape rounding
    assert 0 < synced["tokens"] <= 4 * 4 * 8  # prompts x samples x max_new_tokens
    assert 0 <= synced["mean_abs_dlogp"] < 5e-3 and set(synced["mean_abs_dlogp_by_position"]) <= {
        "0",
        "1",
        "2-3",
        "4-7",
    }
    assert sync["at_starting_weights"]["mean_abs_dlogp"] > synced["mean_abs_dlogp"]
    assert r["model"]["vocab_size"] == 2004 and r["versions"]["torch"]


def test_the_script_refuses_without_a_gpu(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU machine")
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path / "r.json")], capture_output=True, text=True
    )
    assert (
        r.returncode == 2 and r.stderr.strip().startswith("error: no NVIDIA GPU") and not (tmp_path / "r.json").exists()
    )


def test_the_script_stops_at_a_torch_without_cuda(tmp_path):
    """With a stand-in nvidia-smi, on this CPU-only torch: one line, exit 2, nothing written."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable}
    for args in ([], ["--engine", "hf", "--no-zero2"]):
        cmd = ["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path / "r.json"), *args]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        assert r.returncode == 2 and r.stderr == "error: torch sees no CUDA device (install the CUDA build of torch)\n"
    assert not (tmp_path / "r.json").exists()


def test_the_driver_needs_vllm_only_for_the_vllm_engine(gpu_check, tmp_path, monkeypatch, capsys):
    """The default check asks for vLLM (and DeepSpeed unless --no-zero2), in one line with exit 2,
    before it writes anything; ``--engine hf`` (or ``--engine=hf``) does not ask for vLLM."""
    absent = {"vllm", "deepspeed"}
    real = gpu_check.importlib.util.find_spec
    monkeypatch.setattr(
        gpu_check.importlib.util, "find_spec", lambda name, *rest: None if name in absent else real(name, *rest)
    )
    where = ["--work", str(tmp_path / "w"), "--json", str(tmp_path / "r.json")]
    assert gpu_check.main(where) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: missing packages: vllm deepspeed (") and err.count("\n") == 1
    assert not (tmp_path / "w").exists() and not (tmp_path / "r.json").exists()
    assert gpu_check.missing_packages(gpu_check.parse(["--engine", "hf", *where])) == ["deepspeed"]
    assert gpu_check.missing_packages(gpu_check.parse(["--engine=hf", "--no-zero2", *where])) == []
    assert gpu_check.missing_packages(gpu_check.parse(["--no-zero2", *where])) == ["vllm"]


@pytest.mark.slow
def test_the_whole_check_on_cpu_with_zero2_kill_and_resume(gpu_check, tmp_path):
    """Three methods and the ZeRO-2 kill-and-resume (DeepSpeed on one CPU process, float32)."""
    pytest.importorskip("deepspeed")
    acc = tmp_path / "zero2_cpu.yaml"
    acc.write_text(DS_CPU)
    out = tmp_path / "r.json"
    rc = gpu_check.main(
        [
            "--shape",
            "tiny",
            "--engine",
            "hf",
            "--steps",
            "2",
            "--dtype",
            "float32",
            "--accelerate-config",
            str(acc),
            "--work",
            str(tmp_path / "w"),
            "--json",
            str(out),
        ]
    )
    r = json.loads(out.read_text())
    assert rc == 0 and r["ok"], json.dumps(r)[-3000:]
    assert set(r["runs"]) == {"grpo", "pdm", "sis"} and all(run["weight_sync"]["sync_ok"] for run in r["runs"].values())
    z = r["zero2_resume"]
    assert (
        z["complete"]
        and z["killed"]
        and z["bit_identical_weights"]
        and z["metrics_identical"]
        and z["deepspeed_optimizer_shards"] == 1
    )
