"""Storage budgets: keep_checkpoints / keep_steps / rollout.store retention on a run folder, and
the projected disk use of a run."""

import json

import pytest
import torch
from safetensors.torch import save_file

from masktrl.config import load_config
from masktrl.runs import retention as sb
from masktrl.runs.store import RunStore


def test_retention_policy():
    assert sb.checkpoints_to_prune([2, 4, 6, 8], None) == []
    assert sb.checkpoints_to_prune([2, 4, 6, 8], 2) == [2, 4]
    assert sb.checkpoints_to_prune([2, 4, 6, 8], 1, keep_steps=(4,)) == [2, 6]
    assert sb.checkpoints_to_prune([2], 3) == []
    assert sb.rollouts_to_prune([1, 2, 3, 4, 5], 4, "all") == []
    assert sb.rollouts_to_prune([1, 2, 3, 4, 5], 4, "resume") == [1, 2, 3, 4]


def _fake_run(root, steps, every):
    """A run folder whose manifest records a rollout batch per step and a checkpoint every ``every``."""
    store = RunStore(root)
    for step in range(1, steps + 1):
        f = store.step_dir(step) / "rollouts.parquet"
        f.parent.mkdir(parents=True)
        f.write_bytes(b"x" * step)
        store.mark_done(f"step/{step:06d}/rollout", [f])
        if step % every == 0:
            d = store.checkpoint_dir(step)
            d.mkdir(parents=True)
            (d / "model.safetensors").write_bytes(b"w")
            store.mark_done(f"checkpoint/{step:06d}", [d])
    return store


def test_prune_keeps_newest_and_pinned_checkpoints_and_resume_rollouts(tmp_path):
    store = _fake_run(tmp_path / "run", steps=7, every=2)  # checkpoints 2, 4, 6
    out = sb.prune(store, keep=1, keep_steps=(2,), rollout_store="resume")
    assert out == {"checkpoints": [4], "rollouts": [1, 2, 3, 4, 5, 6]}
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["000002", "000006"]
    assert sorted(p.name for p in (tmp_path / "run" / "steps").iterdir()) == ["000007"]  # what --resume reuses
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())["stages"]
    assert manifest["checkpoint/000004"]["status"] == "pruned" and manifest["checkpoint/000006"]["status"] == "done"
    assert manifest["step/000003/rollout"]["status"] == "pruned" and manifest["step/000007/rollout"]["status"] == "done"
    fresh = RunStore(tmp_path / "run")
    assert fresh.checkpoints() == [2, 6]
    fresh.verify("checkpoint/000006"), fresh.verify("step/000007/rollout")  # what stays is intact


def test_prune_keeps_a_stage_another_process_recorded_meanwhile(tmp_path):
    """An eval of the running run records its stage between the trainer's manifest writes."""
    store = _fake_run(tmp_path / "run", steps=4, every=2)
    RunStore(tmp_path / "run").mark_done("eval/gsm8k/000004", [], accuracy=0.5)  # another process's view
    sb.prune(store, keep=1, keep_steps=(), rollout_store="resume")
    stages = json.loads((tmp_path / "run" / "manifest.json").read_text())["stages"]
    assert stages["eval/gsm8k/000004"]["accuracy"] == 0.5 and stages["checkpoint/000002"]["status"] == "pruned"


def test_prune_defaults_keep_everything(tmp_path):
    store = _fake_run(tmp_path / "run", steps=4, every=2)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert sb.prune(store, keep=None, keep_steps=(), rollout_store="all") == {"checkpoints": [], "rollouts": []}
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_prune_finishes_a_deletion_a_crash_interrupted(tmp_path):
    """Manifest already says pruned, the folder is still there (killed between the two)."""
    store = _fake_run(tmp_path / "run", steps=4, every=2)
    store.manifest["stages"]["checkpoint/000002"]["status"] = "pruned"
    store.write_manifest()
    assert (tmp_path / "run" / "checkpoints" / "000002").is_dir()
    sb.prune(RunStore(tmp_path / "run"), keep=None, keep_steps=(), rollout_store="all")
    assert not (tmp_path / "run" / "checkpoints" / "000002").exists()
    assert (tmp_path / "run" / "checkpoints" / "000004").is_dir()


def test_read_only_view_prunes_nothing(tmp_path):
    store = _fake_run(tmp_path / "run", steps=4, every=2)
    assert sb.prune(store.read_only(), keep=1, keep_steps=(), rollout_store="resume") == {
        "checkpoints": [],
        "rollouts": [],
    }
    assert (tmp_path / "run" / "checkpoints" / "000002").is_dir()


def test_projection_of_a_recipe():
    cfg = load_config(
        ["configs/qwen3-4b.yaml", "configs/methods/grpo.yaml"],
        ["train.keep_checkpoints=2", "train.keep_steps=[100]", "rollout.store=resume"],
    )
    p = sb.project(cfg, n_params=4_000_000_000, deepspeed_stage=2, bytes_per_token=40.0)
    assert p.tokens_per_step == 64 * 16 * 8192
    assert p.rollout_step == 64 * 16 * 8192 * 40 and p.rollouts_kept == 20  # checkpoint_every
    assert p.checkpoint == {"weights": 8e9, "optimizer": 12 * 4e9 + 8e9}
    assert p.checkpoints_kept == 3  # newest 2 + step 100
    assert p.per_run == p.rollout_step * 20 + 3 * (8e9 + 56e9)
    assert "projected disk" in p.summary() and "run total <=" in p.summary()
    everything = sb.project(
        load_config(["configs/qwen3-4b.yaml", "configs/methods/grpo.yaml"]), 4_000_000_000, deepspeed_stage=3
    )
    assert everything.rollouts_kept == 300 and everything.checkpoints_kept == 15  # 20, 40, ..., 300
    assert everything.checkpoint["optimizer"] == 12 * 4e9  # ZeRO-3 writes no second copy of the module


def test_checkpoint_bytes_without_deepspeed():
    assert sb.checkpoint_bytes(10, "float32") == {"weights": 40, "optimizer": 80}
    assert sb.checkpoint_steps(7, 3) == [3, 6, 7]


def test_parameters_counted_from_safetensors_headers(tmp_path):
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(tmp_path / "model-00001.safetensors"))
    save_file({"c": torch.zeros(2, 2, 2)}, str(tmp_path / "model-00002.safetensors"))
    assert sb.count_parameters_in_folder(tmp_path) == 12 + 5 + 8
    lin = torch.nn.Linear(4, 3)
    tied = torch.nn.ModuleDict({"x": lin, "y": lin})
    assert sb.count_parameters(tied) == 15
    with pytest.raises(FileNotFoundError):
        sb.count_parameters_in_folder(tmp_path / "nothing")
    assert sb.human(999) == "999 B" and sb.human(1.5e9) == "1.5 GB" and sb.human(2e15) == "2000.0 TB"
