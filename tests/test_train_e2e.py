"""A 2-step run end to end: parameters change and every artifact exists and is recorded.
Every method off-policy through the trainer: tests/test_train_methods.py."""

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from masktrl.cli import app
from masktrl.rollout.storage import read_rollouts
from masktrl.runs.store import RunStore

runner = CliRunner()


def _train(tmp_path, config, *args):
    result = runner.invoke(app, ["train", "--config", str(config), "--out", str(tmp_path / "out"), *args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def test_two_step_run_writes_every_artifact_and_changes_weights(tmp_path, tiny_config):
    _train(tmp_path, tiny_config, "--run", "r")
    root = tmp_path / "out" / "r"
    for rel in [
        "run.yaml",
        "manifest.json",
        "metrics.jsonl",
        "summary.json",
        "steps/000001/rollouts.parquet",
        "steps/000002/rollouts.parquet",
        "checkpoints/000001/model.safetensors",
        "checkpoints/000002/model.safetensors",
        "checkpoints/000002/trainer_state.pt",
        "checkpoints/000002/tokenizer.json",
    ]:
        assert (root / rel).is_file(), rel
    assert yaml.safe_load((root / "run.yaml").read_text())["method"]["name"] == "grpo"

    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ["reward_mean", "response_len_mean", "mask_frac", "ppo_kl", "entropy"]:
        assert all(isinstance(r[key], float) for r in rows), key
    assert all(0.0 <= r["mask_frac"] <= 1.0 and "clip_frac" not in r and r["entropy"] > 0 for r in rows)
    for r in rows:  # the timings describe the same step: rollout within it, tokens per second of it
        assert r["rollout_time_s"] < r["step_time_s"]
        assert r["tokens"] / r["tokens_per_s"] == pytest.approx(r["step_time_s"], rel=0.01)
        assert r["tokens"] == pytest.approx(r["response_len_mean"] * r["groups_generated"] * 4)

    summary = json.loads((root / "summary.json").read_text())
    assert summary["method"] == "grpo" and summary["steps"] == 2
    assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0
    assert summary["wall_time_s"] > sum(r["step_time_s"] for r in rows)  # the run's time holds its steps'
    assert summary["warmstart"]["time_s"] < summary["wall_time_s"]

    start = load_file(
        root.parent
        / ".cache"
        / "warmstart"
        / next(p.name for p in (root.parent / ".cache" / "warmstart").iterdir())
        / "model.safetensors"
    )
    end = load_file(root / "checkpoints" / "000002" / "model.safetensors")
    assert any(s.advantage != 0 for s in read_rollouts(root / "steps" / "000001" / "rollouts.parquet")[0])
    changed = [k for k in start if not torch.equal(start[k], end[k])]
    assert len(changed) == len(start)  # every tensor moved

    store = RunStore(root)
    for stage in ["warmstart", "step/000001/rollout", "step/000002/train", "checkpoint/000002", "summary"]:
        assert store.is_done(stage), stage
    store.verify("step/000001/rollout")
    store.verify("checkpoint/000002")

    samples, meta = read_rollouts(root / "steps" / "000001" / "rollouts.parquet")
    assert len(samples) == 24 and meta["logprobs_k"] == 5
    for s in samples:
        assert len(s.gen.logp) == len(s.gen.response_ids) == len(s.gen.topk_ids)
    groups = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s.advantage)
    for advs in groups.values():
        assert abs(sum(advs)) < 1e-6  # group-normalised


def test_warm_start_is_cached_and_reused(tmp_path, tiny_config):
    _train(tmp_path, tiny_config, "--run", "a")
    _train(tmp_path, tiny_config, "--run", "b", "--method", "dppo")
    a = json.loads((tmp_path / "out" / "a" / "summary.json").read_text())
    b = json.loads((tmp_path / "out" / "b" / "summary.json").read_text())
    assert a["warmstart"]["cached"] is False and b["warmstart"]["cached"] is True
    assert a["eval_before"] == b["eval_before"]  # identical starting model
    assert len(list((tmp_path / "out" / ".cache" / "warmstart").iterdir())) == 1
