"""Low-precision rollouts and the mismatch metrics in training runs; the bad input they can cause."""

import json

import pytest

from tests.conftest import masktrl, write_tiny_config


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--set", "rollout.dtype=float8"], "rollout.dtype"),
        (["--set", "rollout.quantization=int4"], "rollout.quantization"),  # the hf engine fakes fp8 only
        (["--set", "rollout.engine=vllm", "--set", "rollout.quantization=fp8-act"], "hf engine only"),
        (
            ["--set", "rollout.top_p=0.9", "--set", "rollout.logprobs_k=5"],
            "rollout.top_k <=",
        ),  # a kept set larger than K
    ],
)
def test_bad_precision_settings_exit_2_with_one_line(tmp_path, args, needle):
    r = masktrl("train", *args, "--out", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert not any(tmp_path.glob("*/run.yaml"))  # nothing written


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_mismatch_is_measured_every_step(tmp_path, warm_out):
    cfg = write_tiny_config(tmp_path / "c.yaml", {"rollout": {"staleness": 1}, "train": {"steps": 3}})
    for name, extra in (
        ("f32", []),
        ("bf16", ["--set", "rollout.dtype=bfloat16"]),
        ("fp8", ["--set", "rollout.quantization=fp8"]),
    ):
        r = masktrl("train", "--config", cfg, "--out", warm_out, "--run", f"mm-{name}", *extra, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    f32, bf16, fp8 = (_rows(warm_out / f"mm-{n}") for n in ("f32", "bf16", "fp8"))
    for rows in (f32, bf16, fp8):
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert all(r["mismatch/tokens"] == r["tokens"] for r in rows)
    assert max(r["mismatch/logp_abs_mean"] for r in f32) < 1e-4  # KV-cache generation vs the training forward
    assert all(r["mismatch/logp_abs_mean"] > 1e-3 and r["mismatch/kl_k3"] > 0 for r in bf16 + fp8)
    assert all(r["mismatch/logp_abs_p99"] >= r["mismatch/logp_abs_mean"] for r in bf16 + fp8)
