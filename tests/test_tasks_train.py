"""Training on any dataset with any reward: a local folder (parquet + jsonl, nested fields) and a
reward from a file path train for 2 steps; the reward's failures are counted, never fatal; bad
input stops `masktrl train` with one line and exit code 2 before the run folder exists."""

import json
import textwrap

import pytest
from typer.testing import CliRunner

from masktrl.cli import app
from tests.datasets_helpers import datasets_cache, write_jsonl, write_parquet  # noqa: F401
from tests.test_cli_errors import masktrl

pytest.importorskip("datasets")
runner = CliRunner()

TINY = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=64",
    "warmstart.steps=20",
    "warmstart.batch_size=8",
    "rollout.prompts_per_step=6",
    "rollout.n=4",
    "rollout.max_new_tokens=4",
    "train.steps=2",
    "train.checkpoint_every=2",
]

REWARD = textwrap.dedent(
    '''
    import math

    def score(prompts, completions, answers, mode, **fields):
        """mode "raise": raises; "nan": NaN; else 1 for the answer, 0.25 for its first character."""
        out = []
        for c, a, m in zip(completions, answers, mode):
            if m == "raise":
                raise RuntimeError("this reward fails on purpose")
            out.append(math.nan if m == "nan" else 1.0 if c.strip() == a else 0.25 if c[:1] == a[:1] else 0.0)
        return out

    def wrong_count(prompts, completions, answers, **fields):
        return [1.0]
    '''
)


def row(i, mode="ok"):
    word = "abcdef"[i % 6] + "abcdef"[(i * 5 + 1) % 6]
    return {"item": {"word": word, "meta": {"mode": mode}}, "solution": {"text": word[::-1]}, "mode": mode}


@pytest.fixture
def data(tmp_path, datasets_cache):
    root = tmp_path / "words"
    modes = ["raise", "nan", "ok", "ok", "raise", "nan"]
    write_parquet(root / "train.parquet", [row(i, m) for i, m in enumerate(modes)])
    write_jsonl(root / "test.jsonl", [row(i) for i in range(6, 9)])
    (tmp_path / "my_reward.py").write_text(REWARD)
    return root


def train(tmp_path, *sets, run="r"):
    args = ["train", "--out", str(tmp_path / "out"), "--run", run]
    for s in [*TINY, *sets]:
        args += ["--set", s]
    return runner.invoke(app, args)


DATASET = [
    "task.name=dataset",
    "task.prompt_key=item.word",
    "task.answer_key=solution.text",
    "task.test_split=test",
    "task.template={prompt}>",
]


def test_folder_with_nested_fields_trains_with_a_file_reward_that_fails_on_some_completions(
    tmp_path, data, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # the reward path is relative to the current directory
    result = train(
        tmp_path, *DATASET, f"task.source={data}", "task.reward=my_reward.py:score", "task.max_reward_error_frac=0.8"
    )
    assert result.exit_code == 0, (result.output, result.exception)
    assert "warning: step 1: the reward failed on 16 of 24 completions (67%; last: my_reward.py:score" in " ".join(
        result.output.split()
    )
    root = tmp_path / "out" / "r"
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # every step draws the 6 training rows (without replacement): 4 fail, n = 4 completions each
    assert [r["reward_errors"] for r in rows] == [16, 16]
    assert all(0.0 <= r["reward_mean"] <= 1.0 / 3 for r in rows)  # failures score 0
    assert (root / "checkpoints" / "000002" / "model.safetensors").is_file()
    summary = json.loads((root / "summary.json").read_text())
    assert summary["eval_split"] == "words held-out, n=3" and 0.0 <= summary["eval_after"] <= 1.0
    samples_meta = (root / "run.yaml").read_text()
    assert "my_reward.py:score" in samples_meta and "solution.text" in samples_meta

    # masktrl eval / rollout take the same keys: the run's own dataset, template and reward by default
    result = runner.invoke(app, ["eval", "dataset", "--model", str(root), "--k", "2"])
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((root / "eval" / "dataset-step2.json").read_text())
    assert report["n_problems"] == 3 and report["reward"] == "my_reward.py:score"
    assert report["generation"]["template"] == "custom" and report["data"] == f"{data} (test)"
    assert [p["id"] for p in report["problems"]] == ["words/test/1", "words/test/2", "words/test/3"]
    result = runner.invoke(
        app,
        [
            "eval",
            "dataset",
            "--model",
            str(root),
            "--k",
            "2",
            "--force",
            "--set",
            "task.reward=exact-match",
            "--set",
            "task.template=raw",
        ],
    )
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((root / "eval" / "dataset-step2.json").read_text())
    assert report["reward"] == "exact-match" and report["generation"]["template"] == "raw"
    out = tmp_path / "rollouts.parquet"
    result = runner.invoke(
        app,
        [
            "rollout",
            "--model",
            str(root),
            "--data",
            "dataset",
            "--output",
            str(out),
            "--n",
            "2",
            "--set",
            "task.split=test",
            "--set",
            "task.reward=exact-match",
        ],
    )
    assert result.exit_code == 0, (result.output, result.exception)
    from masktrl.rollout.storage import read_rollouts

    samples, _ = read_rollouts(out)
    assert len(samples) == 6 and {s.prompt for s in samples} == {"ab>", "ba>", "cf>"}


@pytest.mark.parametrize(
    "sets, message",
    [
        (["task.answer_key=solution.txt"], "task.answer_key 'solution.txt' is not a field of"),
        (["task.reward=my_reward.py:nope"], "cannot import 'nope'"),
        (["task.reward=no_such_pkg.rewards:score"], "No module named 'no_such_pkg'"),
        (["task.reward=my_reward.py:wrong_count"], "returned 1 values for 2 completions"),
        (["task.template={prompt} {difficulty}"], "task.template names field 'difficulty'"),
        (
            ["task.source=acme/not-cached-anywhere"],
            "'acme/not-cached-anywhere': no such file or folder, and as a dataset id it is "
            "not in the local datasets cache",
        ),
    ],
)
def test_bad_input_is_one_line_before_the_run_folder(tmp_path, data, monkeypatch, sets, message):
    from masktrl.errors import MasktrlError

    monkeypatch.chdir(tmp_path)  # the reward path is relative to cwd
    result = train(tmp_path, *DATASET, f"task.source={data}", "task.reward=my_reward.py:score", *sets, run="bad")
    assert isinstance(result.exception, MasktrlError), (result.output, result.exception)  # cli.main: one line, exit 2
    msg = str(result.exception)
    assert message in msg and "\n" not in msg
    assert not (tmp_path / "out" / "bad").exists()
    if "available fields" in msg:
        assert "item, item.word, item.meta, item.meta.mode, solution, solution.text, mode" in msg


def test_bad_input_exits_2_with_one_line_on_stderr(tmp_path, data):
    args = ["train", "--out", str(tmp_path / "out"), "--run", "bad"]
    for s in [*TINY, *DATASET, f"task.source={data}", "task.reward=my_reward.py:score", "task.answer_key=answer"]:
        args += ["--set", s]
    r = masktrl(*args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "task.answer_key 'answer' is not a field of" in lines[0] and "Traceback" not in r.stdout
    assert not (tmp_path / "out" / "bad").exists()


def test_eval_and_rollout_task_keys():
    from masktrl.config import Config, from_dict
    from masktrl.errors import ConfigError
    from masktrl.rl.evaluation import bench_task_config

    t = bench_task_config(
        "aime24", Config(), template="dapo", overrides=("task.reward=exact-match", "model.chat_template=false")
    )
    assert (t.name, t.template, t.reward, t.data) == ("aime24", "dapo", "exact-match", None)
    run = from_dict(
        {
            "task": {
                "name": "dataset",
                "source": "d.jsonl",
                "template": "instruct",
                "system_prompt": "Be brief.",
                "reward": "r.py:f",
            },
            "model": {"chat_template": True},
        }
    )
    own = bench_task_config("dataset", run)
    assert (own.source, own.template, own.reward, own.system_prompt) == ("d.jsonl", "instruct", "r.py:f", "Be brief.")
    other = bench_task_config("gsm8k", run, data="g.jsonl")  # a preset: the run's prompt, its own data and reward
    assert (other.data, other.template, other.system_prompt, other.reward) == ("g.jsonl", "instruct", "Be brief.", None)
    with pytest.raises(ConfigError, match="take task.. keys and model.chat_template, not train.lr"):
        bench_task_config("aime24", Config(), overrides=("train.lr=1",))
    with pytest.raises(ConfigError, match="needs task.source"):
        bench_task_config("dataset", Config())
