import json
import random
import sys
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from masktrl.errors import ConfigError, DataError
from masktrl.tasks import get_task
from masktrl.tasks.math_data import MathTask, load_benchmark, load_math_file


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


ROWS = [
    {"problem": "What is 1+1?", "answer": "2", "id": "p1"},
    {"question": "Half of one?", "solution": "It is $\\boxed{\\frac{1}{2}}$."},
    {"Problem": "GSM style", "answer": "Work: 6*7 = 42\n#### 42"},
    {"input": "Integer answer", "ground_truth": 7},
    {"prompt": "Final answer field", "final_answer": " 3/4 ", "unique_id": "x/3"},
    {"problem": "Target alias", "target": "\\pi"},
    {"problem": "Capital Answer", "Answer": "10"},
]


def test_jsonl_aliases(tmp_path):
    exs = load_math_file(write_jsonl(tmp_path / "d.jsonl", ROWS))
    assert [e.answer for e in exs] == ["2", "\\frac{1}{2}", "42", "7", "3/4", "\\pi", "10"]
    assert exs[0].prompt == "What is 1+1?" and exs[1].prompt == "Half of one?"
    assert exs[0].id == "d/p1" and exs[1].id == "d/2" and exs[4].id == "d/x/3"
    assert exs[0].meta["problem"] == "What is 1+1?"


def test_json_list_and_parquet_and_blank_lines(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps(ROWS), encoding="utf-8")
    pq.write_table(
        pa.Table.from_pylist([{"problem": r.get("problem", "p"), "answer": str(i)} for i, r in enumerate(ROWS)]),
        tmp_path / "d.parquet",
    )
    (tmp_path / "blank.jsonl").write_text("\n" + json.dumps(ROWS[0]) + "\n\n  \n", encoding="utf-8")
    assert [e.answer for e in load_math_file(tmp_path / "d.json")] == [
        e.answer for e in load_math_file(write_jsonl(tmp_path / "e.jsonl", ROWS))
    ]
    assert [e.answer for e in load_math_file(tmp_path / "d.parquet")] == [str(i) for i in range(len(ROWS))]
    assert len(load_math_file(tmp_path / "blank.jsonl")) == 1
    (tmp_path / "lines.json").write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[3]) + "\n")
    assert [e.answer for e in load_math_file(tmp_path / "lines.json")] == ["2", "7"]


def test_dapo_schema_parquet(tmp_path):
    content = (
        "Solve the following math problem step by step. The last line of your response should be of "
        "the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the "
        "problem.\n\nFind x if 2x=68.\n\n"
        'Remember to put your answer on its own line after "Answer:".'
    )
    row = {
        "data_source": "math_dapo",
        "prompt": [{"content": content, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "34", "style": "rule-lean"},
        "extra_info": {"index": "abc"},
    }
    pq.write_table(
        pa.Table.from_pylist(
            [row, row, {**row, "extra_info": {"index": "def"}, "reward_model": {"ground_truth": "35", "style": "r"}}]
        ),
        tmp_path / "dapo.parquet",
    )
    exs = load_benchmark("dapo-math", str(tmp_path / "dapo.parquet"))
    assert [(e.prompt, e.answer) for e in exs] == [("Find x if 2x=68.", "34"), ("Find x if 2x=68.", "35")]
    assert [e.id for e in exs] == ["dapo-math/1", "dapo-math/3"]  # duplicate ids "abc": row numbers


@pytest.mark.parametrize(
    "content, where, what",
    [
        (b'{"problem": "a", "answer": "1"}\n{"problem": "b"}\n', "line 2", "missing answer"),
        (b'{"problem": "a", "answer": "1"}\n{"answer": "2"}\n', "line 2", "missing problem"),
        (b'{"problem": 5, "answer": "1"}\n', "line 1", "field 'problem' is int 5, not text"),
        (b'{"problem": "  ", "answer": "1"}\n', "line 1", "field 'problem' is blank"),
        (b'{"prompt": [{"role": "user"}], "answer": "1"}\n', "line 1", "field 'prompt' has no chat message"),
        (b'{"problem": "a", "answer": ""}\n', "line 1", "missing answer"),
        (b'{"problem": "a", "answer": "1"}\n\n{"problem": "b", "answer": "2"\n', "line 3", "invalid JSON"),
        (b'{"problem": "a", "answer": "1"}\n{"problem": "caf\xe9", "answer": "2"}\n', "line 2", "UTF-8"),
        (b"", "", "empty file"),
        (b"\n\n   \n", "", "empty file"),
        (b"[1, 2]\n", "line 1", "expected a JSON object"),
        (b'{"problem": "a", "solution": "no final answer here"}\n', "line 1", "solution"),
        (b'{"problem": "a", "answer": "\\\\boxed{1"}\n', "line 1", "boxed"),
        (b'{"problem": "a", "answer": ["1"]}\n', "line 1", "text or a number"),
    ],
)
def test_malformed_jsonl_rows_name_file_and_line(tmp_path, content, where, what):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError) as info:
        load_math_file(path)
    msg = str(info.value)
    assert str(path) in msg and where in msg and what in msg and "\n" not in msg


@pytest.mark.parametrize(
    "content, where",
    [
        (b'[{"problem": "a", "answer": "1"},\n {"problem": "b"}]', "row 2"),
        (b'[{"problem": "a",\n "answer": "1"},\n {"problem": }]', "line 3"),
        (b'[{"problem": "a",\n "answer": "\xff"}]', "line 2"),
        (b'{"problem": "a", "answer": "1"}', "JSON list"),
        (b"[]", "empty file"),
        (b"", "empty file"),
        (b"\n  \n", "empty file"),
    ],
)
def test_malformed_json_names_file_and_position(tmp_path, content, where):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(DataError, match=where) as info:
        load_math_file(path)
    assert str(path) in str(info.value)


def test_bad_parquet_missing_file_and_suffix(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="bad.parquet.*parquet"):
        load_math_file(tmp_path / "bad.parquet")
    pq.write_table(
        pa.Table.from_pylist([{"problem": "a", "answer": "1"}, {"problem": "b", "answer": None}]),
        tmp_path / "holes.parquet",
    )
    with pytest.raises(DataError, match="holes.parquet, row 2: missing answer"):
        load_math_file(tmp_path / "holes.parquet")
    with pytest.raises(DataError, match="no such file"):
        load_math_file(tmp_path / "absent.jsonl")
    (tmp_path / "d.csv").write_text("problem,answer\n")
    with pytest.raises(DataError, match="unsupported file type"):
        load_math_file(tmp_path / "d.csv")


def test_benchmark_without_file_or_cache_gives_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(DataError) as info:
        load_benchmark("aime24")
    msg = str(info.value)
    assert "--data FILE" in msg and "HuggingFaceH4/aime_2024" in msg and "problem|question" in msg
    with pytest.raises(ConfigError, match="valid benchmarks: aime, aime24"):
        load_benchmark("aime23")


def fake_datasets(tables):
    """A stand-in `datasets` module serving rows from `tables` keyed by (repo, config, split)."""
    mod = types.ModuleType("datasets")
    mod.config = types.SimpleNamespace(HF_DATASETS_OFFLINE=False)
    calls = []

    def load_dataset(repo, config=None, split=None):
        calls.append((repo, config, split))
        if (repo, config, split) not in tables:
            raise FileNotFoundError(f"Couldn't find '{repo}' on the Hub or in the cache\n(second line)")
        return tables[(repo, config, split)]

    mod.load_dataset = load_dataset
    mod.calls = calls
    return mod


def test_benchmarks_from_cached_hub_schemas(monkeypatch):
    tables = {
        ("HuggingFaceH4/aime_2024", None, "train"): [{"id": 60, "problem": "p24", "solution": "s", "answer": "204"}],
        ("opencompass/AIME2025", "AIME2025-I", "test"): [{"question": "q1", "answer": "70"}],
        ("opencompass/AIME2025", "AIME2025-II", "test"): [{"question": "q2", "answer": "169"}],
        ("openai/gsm8k", "main", "test"): [{"question": "g", "answer": "a\n#### 1,000"}],
        ("HuggingFaceH4/MATH-500", None, "test"): [
            {"problem": "m", "solution": "\\boxed{5}", "answer": "\\frac{1}{2}", "unique_id": "test/x.json"}
        ],
    }
    mod = fake_datasets(tables)
    monkeypatch.setitem(sys.modules, "datasets", mod)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    aime = load_benchmark("aime")
    assert [(e.id, e.answer) for e in aime] == [
        ("aime24/60", "204"),
        ("aime25/AIME2025-I/1", "70"),
        ("aime25/AIME2025-II/1", "169"),
    ]
    assert mod.calls[1][0] == "yentinglin/aime_2025"  # tried first, then the opencompass copy
    assert [e.answer for e in load_benchmark("gsm8k")] == ["1,000"]
    assert [e.answer for e in load_benchmark("math500")] == ["\\frac{1}{2}"]
    import os

    assert os.environ["HF_DATASETS_OFFLINE"] == "1" and mod.config.HF_DATASETS_OFFLINE is True
    with pytest.raises(DataError, match="dapo-math.*BytedTsinghua-SIA/DAPO-Math-17k.*--data FILE") as info:
        load_benchmark("dapo-math")
    assert "\n" not in str(info.value)


def test_math_task_protocol(tmp_path):
    test = write_jsonl(
        tmp_path / "t.jsonl",
        [{"problem": "1/2 as a fraction?", "answer": "\\frac{1}{2}"}, {"problem": "2+2?", "answer": "4"}],
    )
    train = write_jsonl(tmp_path / "tr.jsonl", [{"problem": f"{i}+0?", "answer": str(i)} for i in range(5)])
    with get_task("math", test=None, test_file=str(test), train=None, train_file=str(train), timeout_s=5.0) as task:
        assert isinstance(task, MathTask) and task.alphabet() is None
        exs = task.test_examples()
        assert exs[0].prompt.startswith("Problem: 1/2 as a fraction?") and "\\boxed{}" in exs[0].prompt
        assert exs[0].prompt.endswith("Solution:") and exs[0].meta["problem"] == "1/2 as a fraction?"
        assert task.score(exs[1], "so \\boxed{4}") == 1.0 and task.score(exs[1], "4") == 0.0
        assert task.score_many(exs, ["\\boxed{0.5}", "\\boxed{5}"]) == [1.0, 0.0]
        assert task.score(exs[0], "\\boxed{" + "{" * 5000) == 0.0
        batch = task.train_examples(3, random.Random(0))
        assert len({e.id for e in batch}) == 3 and all("Problem:" in e.prompt for e in batch)
        assert len(task.train_examples(12, random.Random(0))) == 12
        assert task.format_target(exs[1]).endswith("\\boxed{4}.")
    with MathTask(load_math_file(test)) as eval_only, pytest.raises(ConfigError, match="no training set"):
        eval_only.train_examples(1, random.Random(0))
    with pytest.raises(ConfigError, match="chat"):
        MathTask(load_math_file(test), template="chat")
    with pytest.raises(ConfigError, match="valid templates"):
        MathTask(load_math_file(test), template="fancy")


def test_benchmark_named_tasks_split_heldout(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"a\n#### {i}"} for i in range(20)]
    data = str(write_jsonl(tmp_path / "gsm.jsonl", rows))
    with get_task("gsm8k", data_file=data, n_test=5, seed=1) as task:
        assert task.name == "gsm8k"
        test_ids = [e.id for e in task.test_examples()]
        assert len(test_ids) == 5 and test_ids == sorted(test_ids, key=lambda s: int(s.split("/")[1]))
        train = task.train_examples(15, random.Random(0))
        assert not {e.id for e in train} & set(test_ids) and len({e.id for e in train}) == 15
    with get_task("gsm8k", data_file=data, n_test=5, seed=1) as again:
        assert [e.id for e in again.test_examples()] == test_ids
    with get_task("gsm8k", data_file=data, n_test=500) as evaluation_only:
        assert len(evaluation_only.test_examples()) == 20
        with pytest.raises(ConfigError, match="all 20 problems are held out"):
            evaluation_only.train_examples(1, random.Random(0))
    other = str(write_jsonl(tmp_path / "other.jsonl", [{"problem": "z", "answer": "1"}]))
    with get_task("dapo-math", data_file=data, test_file=other) as task:
        assert [e.answer for e in task.test_examples()] == ["1"]
        assert len(task.train_examples(20, random.Random(0))) == 20
    with pytest.raises(ConfigError, match="n_test"):
        get_task("gsm8k", data_file=data, n_test=0)


def test_repeated_problems_are_kept_and_named_in_one_warning(tmp_path, capsys):
    """A file holding a problem twice was evaluated and counted twice without a word (hostile pass 4):
    each copy is still a problem of its own, and one warning line says how many repeat."""
    rows = ['{"problem": "1+1", "answer": "2"}', '{"problem": "2+2", "answer": "4"}'] * 2
    path = tmp_path / "twice.jsonl"
    path.write_text("\n".join(rows + ['{"problem": "3+3", "answer": "6"}']) + "\n")
    assert len(load_benchmark("gsm8k", path)) == 5
    err = capsys.readouterr().err
    says = "2 of 5 problems repeat an earlier one (the same text and answer); each copy is a problem of its own"
    assert err == f"warning: {path}: {says}\n"
    path.write_text("\n".join(rows[:2]) + "\n")
    assert len(load_benchmark("gsm8k", path)) == 2 and capsys.readouterr().err == ""
