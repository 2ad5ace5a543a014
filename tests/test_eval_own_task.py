"""``masktrl eval task`` (alias ``synthetic``): the run's own held-out split for every synthetic
task, avg@k and pass@k with their standard errors over problems; a sweep folder evaluated in
one command; ``analyze compare --eval task`` on those reports."""

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest

from masktrl.config import SYNTHETIC_TASKS, from_dict
from masktrl.rl.evaluation import Graded, build_task, describe_data, summarize
from masktrl.runs.store import RunStore
from tests.conftest import cli, write_tiny_config

RESIDUES = {
    "model": {"tokenizer": "numbers"},
    "task": {"name": "residues", "n_test": 12, "options": {"answers": 2}},
    "rollout": {"max_new_tokens": 3},
}
ARITH = {"task": {"n_test": 12}, "warmstart": {"steps": 20}}
LEGACY_KEYS = [
    "schema",
    "benchmark",
    "k",
    "n_problems",
    "avg_at_k",
    "ci95",
    "pass_at_k",
    "pass_at",
    "maj_at_k",
    "response_len_mean",
    "truncated_frac",
    "problems",
    "model",
    "weights",
    "run",
    "step",
    "data",
    "time_s",
    "reward",
    "generation",
    "prompts_too_long",
    "created",
]


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    """grpo seeds 0, 1 and sis seed 0 on a tiny residues task, and an arithmetic run elsewhere."""
    root = tmp_path_factory.mktemp("owntask")
    write_tiny_config(root / "r.yaml", RESIDUES)
    write_tiny_config(root / "a.yaml", ARITH)
    for method, seed in (("grpo", 0), ("grpo", 1), ("sis", 0)):
        cli(
            "train",
            "--config",
            root / "r.yaml",
            "--out",
            root / "sw",
            "--run",
            f"{method}-seed{seed}",
            "--method",
            method,
            "--seed",
            seed,
        )
    cli("train", "--config", root / "a.yaml", "--out", root / "other", "--run", "a")
    return root


def test_every_synthetic_task_is_its_own_benchmark():
    kb = {"model": {"tokenizer": "words"}, "task": {"env": "masktrl.tasks.kb:KBSearch"}}
    for name, extra in (
        ("arithmetic", {}),
        ("residues", {"model": {"tokenizer": "numbers"}}),
        ("longtail", {}),
        ("kb", kb),
    ):
        cfg = from_dict({**extra, "task": {"name": name, "n_test": 5, **extra.get("task", {})}})
        task = build_task("task", cfg)
        assert len(task.test_examples()) == 5 and build_task("synthetic", cfg).test_examples() == task.test_examples()
        assert describe_data("task", cfg).startswith(f"{name} held-out split")
    assert set(SYNTHETIC_TASKS) == {"arithmetic", "residues", "longtail", "kb"}


def test_standard_errors_over_problems_by_hand():
    rows = [[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0]]
    graded = Graded(scores=rows, answers=[["x"] * 4] * 3, lengths=[[2] * 4] * 3, finished=[[True] * 4] * 3)
    examples = [type("E", (), {"id": str(i), "answer": "x"})() for i in range(3)]
    r = summarize("task", examples, graded, task="residues")
    per = np.array([0.5, 1.0, 0.0])
    assert r["avg_at_k"] == pytest.approx(0.5) and r["avg_at_k_se"] == pytest.approx(per.std(ddof=1) / np.sqrt(3))
    assert r["pass_at_k"] == pytest.approx(2 / 3) and r["pass_at_k_se"] == pytest.approx(
        np.array([1, 1, 0]).std(ddof=1) / np.sqrt(3)
    )
    assert r["task"] == "residues"
    one = summarize("task", examples[:1], Graded(rows[:1], [["x"] * 4], [[2] * 4], [[True] * 4]))
    assert one["avg_at_k_se"] is None and one["pass_at_k_se"] is None
    assert "avg_at_k_se" not in summarize("synthetic", examples, graded)  # the older name keeps its report


def test_task_on_a_residues_run_is_hashed_in_the_run(sweep_dir):
    run = sweep_dir / "sw" / "grpo-seed0"
    out = cli("eval", "task", "--model", run, "--k", 3).output
    assert "avg@3" in out
    r = json.loads((run / "eval" / "task-step2.json").read_text())
    assert r["benchmark"] == "task" and r["task"] == "residues" and r["k"] == 3 and r["n_problems"] == 12
    per = np.array([p["correct"] / 3 for p in r["problems"]])
    assert r["avg_at_k"] == pytest.approx(per.mean()) and r["avg_at_k_se"] == pytest.approx(
        per.std(ddof=1) / np.sqrt(12)
    )
    assert r["data"].startswith("residues held-out split") and r["generation"]["max_new_tokens"] == 3
    RunStore(run).verify("eval/task/000002")


def test_task_and_synthetic_draw_the_same_samples_and_synthetic_keeps_its_report(sweep_dir):
    run = sweep_dir / "other" / "a"
    cli("eval", "synthetic", "--model", run, "--k", 4)
    cli("eval", "task", "--model", run, "--k", 4)
    old = json.loads((run / "eval" / "synthetic-step2.json").read_text())
    new = json.loads((run / "eval" / "task-step2.json").read_text())
    assert sorted(old) == sorted(LEGACY_KEYS)  # the arithmetic report of synthetic: the keys it always had
    assert [p["scores"] for p in old["problems"]] == [p["scores"] for p in new["problems"]]
    assert [p["answers"] for p in old["problems"]] == [p["answers"] for p in new["problems"]]
    assert old["data"] == new["data"] == "arithmetic held-out split (ops=+, digits=1, answer_format=plain, n_test=12)"


def test_output_with_a_folder_of_runs_is_one_line_and_writes_nothing(sweep_dir, tmp_path, cli_error):
    """Each run keeps its own evals, so ``--output`` (one report) with a folder of runs is refused
    before any run is evaluated."""
    before = sorted(p.relative_to(sweep_dir) for p in (sweep_dir / "sw").rglob("*"))
    line = cli_error("eval", "task", "--model", sweep_dir / "sw", "--output", tmp_path / "r.json")
    assert "--output: each run's evals are stored in the run" in line
    assert not (tmp_path / "r.json").exists()
    assert sorted(p.relative_to(sweep_dir) for p in (sweep_dir / "sw").rglob("*")) == before


def test_a_sweep_folder_in_one_command_then_compare(sweep_dir, cli_error):
    sw = sweep_dir / "copy"
    shutil.copytree(sweep_dir / "sw", sw)
    for r in sw.iterdir():
        shutil.rmtree(r / "eval", ignore_errors=True)
        if (r / "manifest.json").is_file():
            m = json.loads((r / "manifest.json").read_text())
            m["stages"] = {k: v for k, v in m["stages"].items() if not k.startswith("eval/")}
            (r / "manifest.json").write_text(json.dumps(m))
    line = cli_error("analyze", "compare", sw, "--eval", "task")
    assert (
        "3 of 3 runs have no eval report at their final checkpoint" in line
        and f"masktrl eval task --model {sw}" in line
    )
    out = cli("eval", "task", "--model", sw, "--k", 2).output
    assert all(f"{n}: avg@2" in out for n in ("grpo-seed0", "grpo-seed1", "sis-seed0"))
    again = cli("eval", "task", "--model", sw, "--k", 2).output
    assert again.count("skipped:") == 3 and "exists" in again
    cli("analyze", "compare", sw, "--eval", "task", "--baseline", "grpo")
    table = json.loads((sw / "analysis" / "compare.json").read_text())
    reports = {
        str(r): json.loads((r / "eval" / "task-step2.json").read_text())["avg_at_k"]
        for r in sw.iterdir()
        if (r / "run.yaml").is_file()
    }
    for row in table["methods"]:
        assert row["final"]["values"] == [reports[r] for r in row["runs"]]
        assert row["collapse"]["too_short"] == len(row["runs"])  # 2-step runs cannot be judged
    assert (
        table["eval"] == "task"
        and table["eval_settings"]["k"] == 2
        and "k = 2 samples per prompt" in table["metric_kind"]
    )
    cli("eval", "task", "--model", sw / "sis-seed0", "--k", 3, "--force")
    assert "differ in k (2 vs 3 in sis-seed0)" in cli_error("analyze", "compare", sw, "--eval", "task")
    assert "--output" in cli_error("eval", "task", "--model", sw, "--output", sweep_dir / "x.json")


def test_a_run_that_is_not_complete_is_skipped(sweep_dir):
    sw = sweep_dir / "incomplete"
    shutil.copytree(sweep_dir / "sw" / "grpo-seed1", sw / "grpo-seed1")
    m = json.loads((sw / "grpo-seed1" / "manifest.json").read_text())
    m["status"] = "failed"
    (sw / "grpo-seed1" / "manifest.json").write_text(json.dumps(m))
    out = cli("eval", "task", "--model", sw, "--k", 2).output
    assert (
        "grpo-seed1: skipped: failed, not complete" in out
        and not (sw / "grpo-seed1" / "eval" / "task-step2.json").exists()
    )


def test_a_dataset_run_has_no_own_synthetic_task(cli_error, tmp_path):
    cfg = write_tiny_config(tmp_path / "c.yaml", {"train": {"eval_benchmarks": ["task"]}, "task": {"name": "gsm8k"}})
    assert "task is the run's own synthetic task (arithmetic, residues, longtail, kb)" in cli_error(
        "train", "--config", cfg, "--out", tmp_path / "o"
    )
    assert not (tmp_path / "o").exists()


def test_partial_credit_reports_the_mean_score():
    """A task graded with partial credit: avg@k is the mean score, pass@k and maj@k count fully
    correct samples, and the report says so; a binary task's report is unchanged."""
    rows = [[1.0, 0.5, 0.25, 1.0], [0.0, 0.0, 0.5, 0.5]]
    graded = Graded(
        scores=rows, answers=[["a", "b", "c", "a"], ["x"] * 4], lengths=[[2] * 4] * 2, finished=[[True] * 4] * 2
    )
    examples = [type("E", (), {"id": str(i), "answer": "a"})() for i in range(2)]
    r = summarize("task", examples, graded, task="residues", partial=True)
    assert r["credit"] == "partial" and r["avg_at_k"] == pytest.approx((0.6875 + 0.25) / 2)
    assert r["avg_at_k_se"] == pytest.approx(np.array([0.6875, 0.25]).std(ddof=1) / np.sqrt(2))
    assert r["pass_at_k"] == pytest.approx(0.5) and r["pass_at"]["1"] == pytest.approx((2 / 4 + 0) / 2)
    assert [p["correct"] for p in r["problems"]] == [2, 0] and r["problems"][0]["scores"] == [1.0, 0.5, 0.25, 1.0]
    binary = summarize(
        "task", examples, Graded([[1, 0, 0, 1], [0, 0, 1, 1]], graded.answers, graded.lengths, graded.finished)
    )
    assert "credit" not in binary and binary["problems"][0]["scores"] == [1, 0, 0, 1]


def test_heldout_accuracy_is_the_mean_credit(monkeypatch):
    from masktrl.rl import evaluation
    from masktrl.tasks.residues import ResidueTask

    task = ResidueTask(answers=4, credit="partial", n_test=3)
    examples = task.test_examples()
    texts = []
    for ex, good in zip(examples, (4, 2, 1)):
        lo, hi, m, r = (int(w) for w in ex.prompt.split()[:4])
        x = lo + (r - lo) % m
        texts.append([" ".join([str(x)] * good + [str(hi)] * (4 - good))])
    monkeypatch.setattr(evaluation, "sample", lambda *a, **k: (None, None, texts))
    settings = type("S", (), {})()
    monkeypatch.setattr(evaluation, "replace", lambda s, **k: s)
    assert evaluation.heldout_accuracy(None, None, task, examples, settings, greedy=False) == pytest.approx(7 / 12)
    binary = ResidueTask(answers=4, n_test=3)
    assert evaluation.heldout_accuracy(None, None, binary, examples, settings, greedy=False) == pytest.approx(1 / 3)


def test_a_partial_credit_run_trains_and_evaluates_its_mean_credit(tmp_path):
    """configs/lab-credit.yaml's task on the tiny model: the rewards and the held-out accuracy are
    mean credits (not only 0 and 1), and ``eval task`` reports avg@k as the mean score."""
    overlay = {
        "model": {"tokenizer": "numbers"},
        "task": {"name": "residues", "n_test": 12, "options": {"answers": 6, "credit": "partial"}},
        "rollout": {"max_new_tokens": 7},
    }
    write_tiny_config(tmp_path / "c.yaml", overlay)
    cli("train", "--config", tmp_path / "c.yaml", "--out", tmp_path / "o", "--run", "credit")
    run = tmp_path / "o" / "credit"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    assert 0 <= summary["eval_before"] <= 1
    table = pq.read_table(run / "steps" / "000001" / "rollouts.parquet").to_pydict()
    fractions = {k / n for n in (6, 7) for k in range(n + 1)}  # 7 words without EOS: the 7th counts as wrong
    assert all(min(abs(r - f) for f in fractions) < 1e-9 for r in table["reward"])
    assert rows[0]["reward_mean"] == pytest.approx(np.mean(table["reward"]), rel=1e-5)  # stored as float32
    cli("eval", "task", "--model", run, "--k", 2)
    r = json.loads((run / "eval" / "task-step2.json").read_text())
    assert r["credit"] == "partial"
    assert r["avg_at_k"] == pytest.approx(np.mean([np.mean(p["scores"]) for p in r["problems"]]), abs=1e-6)  # 6 digits
    assert all(p["correct"] == sum(s == 1 for s in p["scores"]) for p in r["problems"])


@pytest.mark.parametrize(
    "options, message",
    [
        ({"credit": "some"}, "residues: credit must be one of all, partial, got 'some'"),
        ({"credit": "partial", "distinct": True}, "credit=partial grades each number on its own"),
    ],
)
def test_a_bad_credit_is_one_line_and_writes_nothing(tmp_path, cli_error, options, message):
    overlay = {**RESIDUES, "task": {**RESIDUES["task"], "options": {"answers": 2, **options}}}
    write_tiny_config(tmp_path / "c.yaml", overlay)
    assert message in cli_error("train", "--config", tmp_path / "c.yaml", "--out", tmp_path / "o")
    assert not (tmp_path / "o").exists()
