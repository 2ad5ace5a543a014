"""Every ``model.architecture`` through the commands: a 2-step ``train`` with LoRA, gradient
checkpointing, the chunked top-K log-probabilities and (where the cache allows it) the
shared-prompt forward, then ``rollout`` and ``eval`` of the run (about 4 s per architecture).

Gradients and log-probabilities of each architecture against references are in
tests/test_models_architectures.py and tests/test_models_lora.py; this is the commands' matrix."""

import json

import pytest
from safetensors.torch import load_file

from masktrl.models.architectures import ARCHITECTURES
from masktrl.rollout.storage import read_rollouts
from tests.conftest import cli, write_tiny_config

pytest.importorskip("peft")

SLIDING = {"mistral", "gemma2", "gemma3"}


def test_config_names_every_architecture():
    from masktrl.config import TINY_ARCHITECTURES

    assert TINY_ARCHITECTURES == tuple(ARCHITECTURES)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_train_rollout_eval(arch, tmp_path):
    cfg = write_tiny_config(
        tmp_path / "c.yaml",
        {
            "model": {"architecture": arch, "lora": {"rank": 4, "alpha": 8}},
            "train": {"gradient_checkpointing": True, "lr": 3.0e-3},
        },
    )
    out = tmp_path / "out"
    r = cli("train", "--config", cfg, "--out", out, "--run", "r")
    fallback = [line for line in r.output.splitlines() if "shared-prompt" in line and "sliding" in line]
    assert len(fallback) == (1 if arch in SLIDING else 0), r.output
    root = out / "r"
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["grad_norm"] >= 0 and row["skipped_updates"] == 0 for row in rows)
    assert all((row["shared_prompt_frac"] == 0) == (arch in SLIDING) for row in rows)
    ckpt = root / "checkpoints" / "000002"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    adapters = load_file(ckpt / "adapter_model.safetensors")
    moved = any(v.abs().sum() > 0 for k, v in adapters.items() if ".lora_B." in k)
    assert moved == any(row["grad_norm"] > 0 for row in rows)  # B leaves zero exactly when a gradient reached it
    assert json.loads((root / "summary.json").read_text())["steps"] == 2

    batch = tmp_path / "r.parquet"
    cli(
        "rollout",
        "--model",
        root,
        "--data",
        "synthetic",
        "--n",
        2,
        "--prompts",
        3,
        "--logprobs-k",
        3,
        "--output",
        batch,
    )
    samples, meta = read_rollouts(batch)
    assert len(samples) == 6 and meta["model"].endswith("000002")

    cli("eval", "synthetic", "--model", root, "--k", 2, "--n-problems", 4)
    reports = list((root / "eval").glob("*.json"))
    assert len(reports) == 1 and json.loads(reports[0].read_text())["n_problems"] == 4
