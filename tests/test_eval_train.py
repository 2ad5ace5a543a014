"""Benchmark evals during training (train.eval_benchmarks): metrics keys, files, manifest, and
the config checks."""

import json

import pytest
from typer.testing import CliRunner

from masktrl.cli import app
from masktrl.config import load_config
from masktrl.errors import ConfigError, DataError
from masktrl.runs.store import RunStore
from tests.conftest import write_tiny_config

runner = CliRunner()

SMALL = {  # smaller still: evaluation, not training, is under test
    "task": {"n_test": 8},
    "warmstart": {"steps": 5, "batch_size": 8},
    "rollout": {"prompts_per_step": 3, "n": 2, "logprobs_k": 3},
    "train": {"checkpoint_every": 2},
    "eval": {"k": 2},
}


@pytest.fixture
def setup(tmp_path):
    write_tiny_config(tmp_path / "tiny.yaml", SMALL)
    data = tmp_path / "mini.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": "4"}\n')
    return tmp_path, data


def train(tmp_path, *sets):
    args = ["train", "--config", str(tmp_path / "tiny.yaml"), "--out", str(tmp_path / "out"), "--run", "r"]
    return runner.invoke(app, args + [x for s in sets for x in ("--set", s)])


def test_eval_every_writes_metrics_files_and_manifest(setup):
    tmp_path, data = setup
    result = train(tmp_path, "train.eval_every=1", "train.eval_benchmarks=synthetic,gsm8k", f"eval.data.gsm8k={data}")
    assert result.exit_code == 0, (result.output, result.exception)
    root = tmp_path / "out" / "r"
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        for bench in ("synthetic", "gsm8k"):
            assert 0.0 <= row[f"eval/{bench}/avg_at_k"] <= row[f"eval/{bench}/pass_at_k"] <= 1.0
    assert "eval/heldout/accuracy" in rows[0]  # the held-out accuracy is still logged
    store = RunStore(root)
    for step in (1, 2):
        for bench, n in (("synthetic", 8), ("gsm8k", 2)):
            report = json.loads((root / "eval" / f"{bench}-step{step}.json").read_text())
            assert report["k"] == 2 and report["n_problems"] == n and report["step"] == step
            assert report["avg_at_k"] == rows[step - 1][f"eval/{bench}/avg_at_k"]
            store.verify(f"eval/{bench}/{step:06d}")


def test_without_eval_every_benchmarks_run_at_the_end_only(setup):
    tmp_path, _ = setup
    result = train(tmp_path, "train.eval_benchmarks=synthetic", "eval.n_problems=3")
    assert result.exit_code == 0, (result.output, result.exception)
    rows = [json.loads(line) for line in (tmp_path / "out" / "r" / "metrics.jsonl").read_text().splitlines()]
    assert "eval/synthetic/avg_at_k" not in rows[0] and "eval/synthetic/avg_at_k" in rows[1]
    assert json.loads((tmp_path / "out" / "r" / "eval" / "synthetic-step2.json").read_text())["n_problems"] == 3


def test_missing_benchmark_data_fails_at_the_first_step(setup):
    tmp_path, _ = setup
    result = train(tmp_path, "train.eval_every=2", "train.eval_benchmarks=aime24")
    assert isinstance(result.exception, DataError) and "pass --data" in str(result.exception)
    assert not (tmp_path / "out" / "r" / "metrics.jsonl").exists()  # stopped before step 1 was logged


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["train.eval_benchmarks=synthetic,nosuch"], "train.eval_benchmarks"),
        (["eval.k=0"], "eval.k"),
        (["eval.data.nosuch=x.jsonl"], "eval.data"),
        (["train.eval_benchmarks=synthetic", "task.name=gsm8k"], "synthetic"),
    ],
)
def test_eval_config_is_validated_at_load(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)


def test_benchmark_evals_do_not_change_the_training(setup):
    from safetensors.torch import load_file

    tmp_path, data = setup
    args = ["train", "--config", str(tmp_path / "tiny.yaml"), "--out", str(tmp_path / "out")]
    plain = runner.invoke(app, [*args, "--run", "plain"])
    evald = runner.invoke(
        app, [*args, "--run", "evald", "--set", "train.eval_every=1", "--set", "train.eval_benchmarks=synthetic"]
    )
    assert plain.exit_code == 0 and evald.exit_code == 0, (plain.output, evald.output)
    a = load_file(tmp_path / "out" / "plain" / "checkpoints" / "000002" / "model.safetensors")
    b = load_file(tmp_path / "out" / "evald" / "checkpoints" / "000002" / "model.safetensors")
    assert all((a[k] == b[k]).all() for k in a)
