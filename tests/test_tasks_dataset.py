"""The dataset task: any local file/folder or cached hub dataset, dotted keys, templates, presets."""

import json
import random

import pytest

from masktrl.errors import ConfigError, DataError
from masktrl.tasks import get_task
from masktrl.tasks.dataset import DatasetTask, folder_splits, load_rows
from masktrl.tasks.math_data import MathTask
from tests.datasets_helpers import FIXTURES, cache_hub_dataset, datasets_cache, write_jsonl, write_parquet  # noqa: F401

pytest.importorskip("datasets")


def nested(i, split="train"):
    return {
        "question": {"text": f"{i}+{i}=", "level": i % 3},
        "label": {"value": str(2 * i)},
        "split": split,
        "tags": ["a", "b"],
    }


@pytest.fixture
def folder(tmp_path, datasets_cache):
    root = tmp_path / "mydata"
    write_parquet(root / "train.parquet", [nested(i) for i in range(6)])
    write_jsonl(root / "test.jsonl", [nested(i, "test") for i in range(10, 13)])
    return root


def test_folder_of_parquet_and_jsonl_with_nested_keys(folder):
    assert {k: [p.name for p in v] for k, v in folder_splits(folder).items()} == {
        "train": ["train.parquet"],
        "test": ["test.jsonl"],
    }
    with get_task(
        "dataset",
        source=str(folder),
        prompt_key="question.text",
        answer_key="label.value",
        test_split="test",
        template="Q{question.level}: {prompt}",
        reward="exact-match",
    ) as task:
        assert isinstance(task, DatasetTask) and task.name == "mydata"
        test = task.test_examples()
        assert [(e.id, e.prompt, e.answer) for e in test] == [
            ("mydata/test/1", "Q1: 10+10=", "20"),
            ("mydata/test/2", "Q2: 11+11=", "22"),
            ("mydata/test/3", "Q0: 12+12=", "24"),
        ]
        assert test[0].meta["fields"]["split"] == "test" and test[0].meta["fields"]["tags"] == ["a", "b"]
        train = task.train_examples(6, random.Random(0))
        assert sorted(e.answer for e in train) == ["0", "10", "2", "4", "6", "8"]
        assert task.score_many(test, [" 20 ", "21", "24"]) == [1.0, 0.0, 1.0] and task.reward_errors == 0
        assert task.format_target(test[0]) == "20"
        assert task.alphabet() == " +01234568:=Q"


def test_mixed_formats_in_one_split_and_single_files(tmp_path, datasets_cache):
    root = tmp_path / "mixed"
    write_parquet(root / "data" / "train-00000-of-00002.parquet", [nested(1)])
    write_jsonl(root / "data" / "train-00001-of-00002.jsonl", [nested(2)])
    assert [r["label"]["value"] for r in load_rows(str(root), "train")] == ["2", "4"]
    flat = tmp_path / "flat"
    write_jsonl(flat / "part1.jsonl", [{"prompt": "p", "answer": 1}])
    assert load_rows(str(flat), "train") == [{"prompt": "p", "answer": 1}]  # no split names: all is train
    (tmp_path / "d.csv").write_text("prompt,answer\n1+1=,2\n2+2=,4\n")
    (tmp_path / "d.json").write_text(json.dumps([{"prompt": "x", "answer": "y"}]))
    assert load_rows(str(tmp_path / "d.csv"), "anything") == [
        {"prompt": "1+1=", "answer": 2},
        {"prompt": "2+2=", "answer": 4},
    ]
    assert load_rows(str(tmp_path / "d.json")) == [{"prompt": "x", "answer": "y"}]
    with get_task("dataset", source=str(tmp_path / "d.csv"), n_test=1, reward="exact-match") as task:
        assert [e.answer for e in task.test_examples() + task.train_examples(1, random.Random(0))] in (
            ["2", "4"],
            ["4", "2"],
        )


def test_bad_sources_keys_and_templates_are_one_line_errors(folder, tmp_path):
    def error(exc, **kw):
        with pytest.raises(exc) as info:
            get_task("dataset", **{"source": str(folder), "reward": "exact-match", **kw}).close()
        assert "\n" not in str(info.value)
        return str(info.value)

    msg = error(ConfigError, prompt_key="question.txt", answer_key="label.value")
    assert "task.prompt_key 'question.txt'" in msg
    assert (
        "available fields of the first row: question, question.text, question.level, label, label.value, "
        "split, tags" in msg
    )
    msg = error(ConfigError, prompt_key="question.text", answer_key="answer")
    assert "task.answer_key 'answer'" in msg and "label.value" in msg
    msg = error(ConfigError, prompt_key="question.text", answer_key="label.value", template="{prompt} {difficulty}")
    assert "task.template names field 'difficulty'" in msg and "question.level" in msg
    assert "no 'validation' split; splits: test, train" in error(DataError, split="validation")
    assert "no such file or folder" in error(DataError, source=str(tmp_path / "absent.jsonl"))
    (tmp_path / "x.txt").write_text("hi")
    assert "unsupported file type '.txt'" in error(DataError, source=str(tmp_path / "x.txt"))
    msg = error(ConfigError, prompt_key="question.text", answer_key="label.value", template="{prompt} {")
    assert "not a valid format string" in msg
    assert "task.reward is required" in error(
        ConfigError, prompt_key="question.text", answer_key="label.value", reward=None
    )
    with pytest.raises(ConfigError, match="needs task.source"):
        get_task("dataset")


def test_hub_id_from_the_local_cache_only(tmp_path, datasets_cache):
    cache_hub_dataset(datasets_cache, "acme/toy-math", {"train": [nested(1), nested(2)], "test": [nested(3)]}, tmp_path)
    assert [r["label"]["value"] for r in load_rows("acme/toy-math", "test")] == ["6"]
    with get_task(
        "dataset",
        source="acme/toy-math",
        prompt_key="question.text",
        answer_key="label.value",
        test_split="test",
        reward="exact-match",
    ) as task:
        assert [e.prompt for e in task.test_examples()] == ["3+3="] and task.name == "toy-math"
    with pytest.raises(DataError) as info:
        load_rows("acme/not-cached", "train")
    msg = str(info.value)
    assert "'acme/not-cached': no such file or folder, and as a dataset id it is not in the local datasets cache" in msg
    assert "nothing is downloaded" in msg
    assert str(datasets_cache) in msg and "\n" not in msg


def test_max_prompt_tokens_drops_long_prompts(tmp_path, datasets_cache):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x" * n, "answer": str(n)} for n in range(1, 11)])
    with get_task(
        "dataset",
        source=str(tmp_path / "d.jsonl"),
        n_test=2,
        reward="exact-match",
        max_prompt_tokens=5,
        count_tokens=len,
    ) as task:
        kept = task.test_examples() + task.train_examples(3, random.Random(0))
        assert all(len(e.prompt) <= 5 for e in kept)
    with pytest.raises(ConfigError, match="drops all 10 prompts"):
        get_task(
            "dataset", source=str(tmp_path / "d.jsonl"), reward="exact-match", max_prompt_tokens=0, count_tokens=len
        )


def test_presets_are_dataset_tasks_with_math_defaults(tmp_path, datasets_cache):
    rows = [{"question": f"q{i}", "answer": f"work\n#### {i}", "meta": {"difficulty": i}} for i in range(8)]
    write_jsonl(tmp_path / "gsm" / "train.jsonl", rows)
    write_jsonl(tmp_path / "gsm" / "test.jsonl", rows[:2])
    with get_task("gsm8k", source=str(tmp_path / "gsm"), test_split="test") as task:
        assert isinstance(task, MathTask) and isinstance(task, DatasetTask) and task.name == "gsm8k"
        exs = task.test_examples()
        assert (
            [e.answer for e in exs] == ["0", "1"]
            and exs[0].prompt.startswith("Problem: q0")
            and "\\boxed{}" in exs[0].prompt
        )
        assert task.score_many(exs, ["\\boxed{0}", "\\boxed{7}"]) == [1.0, 0.0]
        assert exs[0].meta["fields"]["meta"] == {"difficulty": 0}
    with get_task(
        "gsm8k",
        source=str(tmp_path / "gsm"),
        test_split="test",
        template="{prompt} (level {meta.difficulty})",
        reward="exact-match",
        prompt_key="question",
        answer_key="meta.difficulty",
    ) as task:
        assert [e.prompt for e in task.test_examples()] == ["q0 (level 0)", "q1 (level 1)"]
        assert task.score(task.test_examples()[1], "1") == 1.0


def dapo_row():
    return json.loads((FIXTURES / "dapo_math_17k_row.json").read_text())


def test_dapo_template_reproduces_the_datasets_own_prompt(tmp_path, datasets_cache):
    row = dapo_row()
    own_text = row["prompt"][0]["content"]
    path = write_parquet(
        tmp_path / "dapo" / "train-00000-of-00001.parquet", [row, {**row, "extra_info": {"index": "b"}}]
    )
    # the preset (DAPO's instruction stripped on load, as before) with the dapo template puts it back exactly
    with get_task("dapo-math", data_file=str(path), n_test=1, template="dapo") as task:
        (ex,) = task.test_examples()
        assert ex.prompt == own_text and ex.answer == "34"
        assert task.reward.name == "answer-line"  # the reward the template's instruction asks for
        assert task.score_many([ex, ex, ex], ["...\nAnswer: 34", "Answer: $34$.", "\\boxed{34}"]) == [1.0, 1.0, 0.0]
        assert task.format_target(ex) == "Answer: 34"
    # the default stays the boxed template
    with get_task("dapo-math", data_file=str(path), n_test=1) as task:
        assert task.test_examples()[0].prompt.startswith("Problem: In triangle") and task.reward.name == "math-verify"
    # the dataset task on the same folder: the prompt field as it is, the nested ground truth
    with get_task(
        "dataset", source=str(tmp_path / "dapo"), answer_key="reward_model.ground_truth", n_test=1, reward="answer-line"
    ) as task:
        assert task.test_examples()[0].prompt == own_text and task.test_examples()[0].answer == "34"


def test_task_config_keys():
    from masktrl.config import load_config

    cfg = load_config(
        None,
        [
            "task.name=dataset",
            "task.source=d.jsonl",
            "task.template={prompt}",
            "task.system_prompt=yes",
            "task.chat_template_kwargs={enable_thinking: false}",
            "task.answer_key=reward_model.ground_truth",
        ],
    )
    t = cfg.task
    assert (t.template, t.system_prompt, t.chat_template_kwargs) == ("{prompt}", "yes", {"enable_thinking": False})
    assert t.answer_key == "reward_model.ground_truth" and t.split == "train" and t.reward is None
    with pytest.raises(ConfigError, match="task.name=dataset needs task.source"):
        load_config(None, ["task.name=dataset"])
    with pytest.raises(ConfigError, match="task.reward is an option of dataset tasks; task.name is arithmetic"):
        load_config(None, ["task.name=arithmetic", "task.reward=exact-match"])
    with pytest.raises(ConfigError, match="task.max_prompt_tokens must be > 0"):
        load_config(None, ["task.name=gsm8k", "task.max_prompt_tokens=0"])


def test_messages_a_new_user_meets(tmp_path, datasets_cache, monkeypatch):
    """The raw template names no reward, and says so; a template field missing from rows whose prompt
    is under `prompt` lists that name once; `data/x` that exists neither as a folder nor in the cache
    says "no such file or folder"."""
    write_jsonl(tmp_path / "my.jsonl", [{"prompt": f"{i}+{i}", "answer": str(2 * i)} for i in range(4)])
    with pytest.raises(ConfigError) as info:
        get_task("dataset", source=str(tmp_path / "my.jsonl")).close()
    assert "task.reward is required with task.template=raw" in str(info.value)
    with pytest.raises(ConfigError) as info:
        get_task(
            "dataset", source=str(tmp_path / "my.jsonl"), reward="exact-match", template="{prompt} {level}"
        ).close()
    assert str(info.value).endswith("available fields of the first row: prompt, answer")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as info:
        load_rows("data/dapo")
    assert (
        "task.source 'data/dapo': no such file or folder, and as a dataset id it is not in the local "
        "datasets cache" in str(info.value)
    )
