"""Long-run settings end to end on the tiny model: live tracking (TensorBoard events read
back), storage budgets (keep_checkpoints, keep_steps, rollout.store=resume) with a SIGKILL and
--resume, gradient checkpointing and the learning-rate schedule, and their bad inputs."""

import importlib.util
import json
import math
import shutil

import pytest
import torch

from masktrl.errors import ConfigError
from masktrl.runs.store import RunStore
from tests.conftest import masktrl, write_tiny_config
from tests.test_resume import RESUME, metrics, weights

# the resume tests' tiny SIS run: 4 steps, a checkpoint after each, a cosine schedule
OVERLAY = {
    **RESUME,
    "train": {
        **RESUME["train"],
        "steps": 4,
        "checkpoint_every": 1,
        "lr_schedule": "cosine",
        "warmup_steps": 1,
        "min_lr_ratio": 0.1,
    },
}
BUDGET = ["--set", "train.keep_checkpoints=1", "--set", "train.keep_steps=[2]", "--set", "rollout.store=resume"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A plain cosine-schedule run, and the same run with tracking, checkpointing and budgets."""
    base = tmp_path_factory.mktemp("scale")
    cfg = write_tiny_config(base / "c.yaml", OVERLAY)
    out = base / "out"
    r = masktrl("train", "--config", str(cfg), "--out", str(out), "--run", "plain")
    assert r.returncode == 0, r.stderr[-3000:]
    extra = ["--set", "train.report_to=tensorboard", "--set", "train.gradient_checkpointing=true", *BUDGET]
    r = masktrl("train", "--config", str(cfg), "--out", str(out), "--run", "all", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return base, cfg, out, r.stdout


def test_tracking_checkpointing_and_budgets_leave_the_numbers_alone(runs):
    _, _, out, stdout = runs
    a, b = weights(out / "plain", 4), weights(out / "all", 4)
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit-identical: none of these changes the maths
    plain, other = metrics(out / "plain"), metrics(out / "all")
    assert [{k: v for k, v in r.items() if k != "shared_prompt_frac"} for r in other] == plain
    assert all(r["shared_prompt_frac"] > 0 for r in other)  # checkpointed, and prompts still shared
    assert "projected disk:" in stdout


def test_lr_schedule_warms_up_then_decays_by_cosine(runs):
    _, _, out, _ = runs
    lrs = [r["lr"] for r in metrics(out / "plain")]  # lr after each step's 2 updates; 8 updates, 2 of warm-up
    factor = lambda u: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (u - 2) / 6))  # noqa: E731
    assert lrs == pytest.approx([1e-3 * factor(2 * s) for s in (1, 2, 3, 4)])


def test_tensorboard_events_hold_every_metrics_row(runs):
    pytest.importorskip("tensorboard")
    from tests.test_tracking import read_scalars

    _, _, out, _ = runs
    root = out / "all"
    scalars = read_scalars(root / "tensorboard")
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        for key, value in row.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            logged = dict(scalars[key])
            assert logged[row["step"]] == pytest.approx(value, rel=1e-6, nan_ok=True), key  # float32 in the event file
    summary = json.loads((root / "summary.json").read_text())
    assert dict(scalars["eval/heldout/accuracy"]) == pytest.approx(
        {0: summary["eval_before"], 4: summary["eval_after"]}
    )


def test_budgets_keep_the_newest_checkpoint_the_pinned_one_and_what_resume_needs(runs):
    _, _, out, _ = runs
    root = out / "all"
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["000002", "000004"]
    assert not (root / "steps").exists() or not any(
        (root / "steps").rglob("*.parquet")
    )  # all before the last checkpoint
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["stages"]["checkpoint/000003"]["status"] == "pruned"
    assert manifest["disk_projection"]["per_run"] > 0
    store = RunStore(root)
    assert store.checkpoints() == [2, 4] and store.policy_steps() == [0, 2, 4]  # what eval and the analyses can load
    with pytest.raises(ConfigError, match=r"has no checkpoint 3 .*available steps: 0 \(starting policy\), 2, 4"):
        store.policy_path(3)


def test_budgeted_run_killed_then_resumed_is_bit_identical(runs):
    base, cfg, out, _ = runs
    r = masktrl(
        "train",
        "--config",
        str(cfg),
        "--out",
        str(out),
        "--run",
        "crash",
        *BUDGET,
        env={"MASKTRL_CRASH_AT": "update:4"},
    )
    assert r.returncode == -9, r.stderr[-2000:]
    root = out / "crash"
    assert sorted(p.name for p in (root / "steps").iterdir()) == ["000004"]  # the batch resume reuses
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["000002", "000003"]
    r = masktrl("train", "--resume", "crash", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = weights(out / "plain", 4), weights(root, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert metrics(out / "plain") == metrics(root)


def test_rollouts_from_a_run_that_kept_only_resume_batches_is_refused(runs, tmp_path):
    from masktrl.errors import MasktrlError
    from masktrl.rl.rollout_source import RolloutSource

    _, _, out, _ = runs
    partial = tmp_path / "partial"  # what a rollout.store=resume run killed after checkpoint 3 keeps: step 4's batch
    shutil.copytree(out / "all", partial)
    manifest = json.loads((partial / "manifest.json").read_text())
    manifest["stages"]["step/000004/rollout"]["status"] = "done"
    (partial / "manifest.json").write_text(json.dumps(manifest))
    for root, needle in (
        (out / "all", "no stored rollouts"),
        (partial, "1 steps between 4 and 4, not every step from 1"),
    ):
        with pytest.raises(MasktrlError, match=needle) as exc:
            RolloutSource(str(root), 6, tokenizer=None)
        assert "rollout.store" in str(exc.value)


@pytest.mark.parametrize(
    "args, needle",
    [  # every new key's message: tests/test_config.py; here the CLI's handling
        (["--set", "train.keep_checkpoints=0"], "train.keep_checkpoints must be >= 1"),
        (["--set", "rollout.sleep_mode=true"], "rollout.sleep_mode needs rollout.engine=vllm"),
    ],
)
def test_bad_settings_exit_2_with_one_line_and_no_folder(tmp_path, cli_error, args, needle):
    line = cli_error("train", *args, "--out", tmp_path, "--run", "x")
    assert needle in line and not (tmp_path / "x").exists()


@pytest.mark.parametrize("tracker", ["wandb"])
def test_a_tracker_whose_package_is_missing_exits_2_before_the_run_folder_exists(tmp_path, cli_error, tracker):
    if importlib.util.find_spec(tracker) is not None:
        pytest.skip(f"{tracker} is installed here")
    line = cli_error("train", "--set", f"train.report_to=tensorboard,{tracker}", "--out", tmp_path, "--run", "x")
    assert f"train.report_to={tracker}: the {tracker} package is not installed (pip install {tracker}" in line
    assert not (tmp_path / "x").exists()
