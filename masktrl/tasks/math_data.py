"""Real math data: local files, cached hub benchmarks, and :class:`MathTask`.

File formats (chosen by suffix):
  ``.jsonl``   one JSON object per line (blank lines ignored)
  ``.json``    a JSON list of objects (a .json file holding JSON lines is read as .jsonl)
  ``.parquet`` one row per problem

Fields of a row (the first present, non-empty one wins):
  problem  ``problem | question | prompt | Problem | input``; a list of chat messages
           (DAPO's ``prompt``) gives its last user message, with DAPO's "Answer:"
           boilerplate removed.
  answer   ``answer | solution | final_answer | Answer | ground_truth | target``, or
           ``reward_model.ground_truth`` (DAPO). A text with ``#### x`` (GSM8K) gives ``x``;
           a text with ``\\boxed{x}`` gives the last box's ``x``; a ``solution`` needs one of
           the two. Numbers are converted to text.
  id       ``id | unique_id | ID | problem_id | idx | index`` (optional; else the row number).

Every malformed row raises DataError naming the file and line (or row) number.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

from masktrl.errors import ConfigError, DataError
from masktrl.tasks.base import Example, register_task
from masktrl.tasks.grader import Grader, last_boxed
from masktrl.tasks.prompts import render_prompt

PROBLEM_FIELDS = ("problem", "question", "prompt", "Problem", "input")
ANSWER_FIELDS = ("answer", "solution", "final_answer", "Answer", "ground_truth", "target")
ID_FIELDS = ("id", "unique_id", "ID", "problem_id", "idx", "index")
SUFFIXES = (".jsonl", ".json", ".parquet")
FIELDS_HINT = (
    f"a {'/'.join(SUFFIXES)} file with the problem under one of {'|'.join(PROBLEM_FIELDS)} "
    f"and the answer under one of {'|'.join(ANSWER_FIELDS)}"
)
_DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
_DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


# --------------------------------------------------------------------------- rows -> examples
def _problem_text(value: Any) -> str | None:
    if isinstance(value, list):  # chat messages
        msgs = [m for m in value if isinstance(m, dict) and isinstance(m.get("content"), str)]
        users = [m for m in msgs if m.get("role") == "user"] or msgs
        if not users:
            return None
        value = users[-1]["content"]
        value = value.removeprefix(_DAPO_PREFIX).removesuffix(_DAPO_SUFFIX)
    if not isinstance(value, str):
        return None
    return value.strip() or None


def _answer_text(name: str, value: Any, where: str) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return str(value)
    if not isinstance(value, str):
        raise DataError(f"{where}: field {name!r} must be text or a number, got {type(value).__name__}")
    text = value.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip() or None
    if "\\boxed" in text or "\\fbox" in text:
        boxed = last_boxed(text, max_chars=len(text))
        if boxed is not None and boxed.strip():
            return boxed.strip()
        raise DataError(f"{where}: field {name!r} has an empty or unbalanced \\boxed{{}}")
    if name == "solution":
        raise DataError(f"{where}: field 'solution' has no \\boxed{{}} or '####' final answer")
    return text or None


def row_to_example(row: Any, where: str, source: str, index: int) -> Example:
    """Map one raw row to an Example whose ``prompt`` is the raw problem text.

    ``where`` ("file.jsonl, line 3") prefixes every error; ``source`` prefixes the id.
    """
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    problem = next((p for f in PROBLEM_FIELDS if (p := _problem_text(row.get(f))) is not None), None)
    if problem is None:
        raise DataError(f"{where}: missing problem (expected a non-empty field {'|'.join(PROBLEM_FIELDS)})")
    candidates = [(f, row.get(f)) for f in ANSWER_FIELDS]
    if isinstance(row.get("reward_model"), dict):
        candidates.append(("reward_model.ground_truth", row["reward_model"].get("ground_truth")))
    answer = next((a for f, v in candidates if (a := _answer_text(f, v, where)) is not None), None)
    if answer is None:
        raise DataError(f"{where}: missing answer (expected a non-empty field {'|'.join(ANSWER_FIELDS)})")
    ident = next((row[f] for f in ID_FIELDS if isinstance(row.get(f), (str, int)) and row[f] != ""), None)
    if ident is None and isinstance(row.get("extra_info"), dict):
        ident = row["extra_info"].get("index")
    return Example(
        id=f"{source}/{ident if ident is not None else index}",
        prompt=problem,
        answer=answer,
        meta={"problem": problem, "source": source, "row": index},
    )


def _finish(examples: list[Example], where: str, source: str) -> list[Example]:
    if not examples:
        raise DataError(f"{where}: empty file (expected {FIELDS_HINT})")
    if len({e.id for e in examples}) < len(examples):  # ids must be unique: fall back to row numbers
        examples = [replace(e, id=f"{source}/{e.meta['row']}") for e in examples]
    return examples


# --------------------------------------------------------------------------- file readers
def _iter_jsonl(path: Path, lines: Iterator[bytes]) -> Iterator[tuple[str, Any]]:
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"{path}, line {lineno}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{where}: not valid UTF-8 (byte {e.start + 1} of the line)") from None
        try:
            yield where, json.loads(text.lstrip("\ufeff"))
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg}, column {e.colno})") from None


def _iter_json(path: Path, data: bytes) -> Iterator[tuple[str, Any]]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}, line {line}: not valid UTF-8") from None
    if not text.strip("\ufeff \t\r\n"):
        return  # empty: reported by the caller
    try:
        rows = json.loads(text.lstrip("\ufeff"))
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON lines in a .json file
            yield from _iter_jsonl(path, iter(data.split(b"\n")))
            return
        raise DataError(f"{path}, line {e.lineno}: invalid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON list of objects, got a JSON {type(rows).__name__}")
    for i, row in enumerate(rows, 1):
        yield f"{path}, row {i}", row


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        wanted = set(PROBLEM_FIELDS + ANSWER_FIELDS + ID_FIELDS + ("reward_model", "extra_info"))
        columns = [c for c in pf.schema_arrow.names if c in wanted]
        table = pf.read(columns=columns)
    except Exception as e:  # ArrowInvalid, OSError...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{path}: not a readable parquet file ({first})") from None
    for batch in table.to_batches(max_chunksize=8192):
        for row in batch.to_pylist():
            yield None, row  # the caller numbers rows


def load_math_file(path: str | os.PathLike, source: str | None = None) -> list[Example]:
    """Load a ``.jsonl`` / ``.json`` / ``.parquet`` math file (see the module doc for fields).

    Examples carry the raw problem as ``prompt``; ids are ``<source>/<id or row>`` with
    ``source`` defaulting to the file's stem.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise DataError(f"{path}: unsupported file type {suffix or '(none)'!r}; use {FIELDS_HINT}")
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    source = source or path.stem
    try:
        if suffix == ".jsonl":
            with open(path, "rb") as f:
                rows = list(_iter_jsonl(path, f))
        elif suffix == ".json":
            rows = list(_iter_json(path, path.read_bytes()))
        else:
            rows = [(where or f"{path}, row {i}", r) for i, (where, r) in enumerate(_iter_parquet(path), 1)]
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    examples = [row_to_example(row, where, source, i) for i, (where, row) in enumerate(rows, 1)]
    return _finish(examples, str(path), source)


# --------------------------------------------------------------------------- benchmarks
@dataclass(frozen=True)
class HubSource:
    """One split of one hub dataset, read from the local ``datasets`` cache only."""

    repo: str
    config: str | None
    split: str


# name -> alternatives (tried in order); an alternative is a list of splits to concatenate
HUB_SOURCES: dict[str, list[list[HubSource]]] = {
    "aime24": [[HubSource("HuggingFaceH4/aime_2024", None, "train")]],
    "aime25": [
        [HubSource("yentinglin/aime_2025", None, "train")],
        [HubSource("opencompass/AIME2025", "AIME2025-I", "test"), HubSource("opencompass/AIME2025", "AIME2025-II", "test")],
    ],
    "math500": [[HubSource("HuggingFaceH4/MATH-500", None, "test")]],
    "gsm8k": [[HubSource("openai/gsm8k", "main", "test")]],
    "dapo-math": [[HubSource("BytedTsinghua-SIA/DAPO-Math-17k", None, "train")]],
}
COMPOSITES = {"aime": ("aime24", "aime25")}
BENCHMARKS = tuple(sorted([*HUB_SOURCES, *COMPOSITES]))
TRAIN_SETS = ("dapo-math",)  # deduplicated on load (the hub file repeats each problem)


class _Unavailable(Exception):
    pass


def _import_datasets():
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # never download; the cache or nothing
    try:
        import datasets
    except ImportError:
        raise _Unavailable("the `datasets` package is not installed") from None
    if hasattr(datasets, "config"):
        datasets.config.HF_DATASETS_OFFLINE = True
    return datasets


def _load_hub(name: str, alternatives: list[list[HubSource]]) -> list[Example]:
    reasons = []
    for alternative in alternatives:
        try:
            datasets = _import_datasets()
            examples: list[Example] = []
            for src in alternative:
                try:
                    ds = datasets.load_dataset(src.repo, src.config, split=src.split)
                except Exception as e:
                    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                    raise _Unavailable(f"{src.repo}: {first}") from None
                tag = f"{src.repo}" + (f" ({src.config})" if src.config else "")
                prefix = name if len(alternative) == 1 else f"{name}/{src.config or src.split}"
                for i, row in enumerate(ds, 1):
                    examples.append(row_to_example(dict(row), f"{tag}, row {i}", prefix, i))
            return _finish(examples, name, name)
        except _Unavailable as e:
            reasons.append(str(e))
            if "not installed" in str(e):
                break
    tried = ", ".join(s.repo for alt in alternatives for s in alt[:1])
    raise DataError(
        f"benchmark {name!r} is not available offline (tried {tried}: {'; '.join(reasons)}); "
        f"pass --data FILE: {FIELDS_HINT}"
    )


def _dedupe(examples: list[Example]) -> list[Example]:
    seen: set[tuple[str, str]] = set()
    out = []
    for e in examples:
        key = (e.prompt, e.answer)
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


def load_benchmark(name: str, data_file: str | os.PathLike | None = None) -> list[Example]:
    """Problems of benchmark ``name`` (raw problem text as ``prompt``).

    Names: aime24, aime25, aime (both), math500, gsm8k (test split), dapo-math (train set,
    deduplicated). With ``data_file`` the problems come from that file; without it from the
    local ``datasets`` cache (offline), else a DataError says which file to pass.
    """
    if name not in BENCHMARKS:
        raise ConfigError(f"unknown benchmark {name!r}; valid benchmarks: {', '.join(BENCHMARKS)}")
    if data_file is not None:
        examples = load_math_file(data_file, source=name)
    elif name in COMPOSITES:
        examples = [e for part in COMPOSITES[name] for e in load_benchmark(part)]
    else:
        examples = _load_hub(name, HUB_SOURCES[name])
    return _dedupe(examples) if name in TRAIN_SETS else examples


# --------------------------------------------------------------------------- the task
class MathTask:
    """Math problems graded by math-verify (see :mod:`masktrl.tasks.grader`).

    Args:
        test: held-out examples (raw problem text as ``prompt``, as loaders return them).
        train: training examples, or None for an evaluation-only task.
        template: prompt template name (``base``, ``chat``, ``raw``; see prompts.py).
        tokenizer: needed by the ``chat`` template.
        timeout_s: hard grading timeout per answer.
        require_boxed: a completion without ``\\boxed{}`` scores 0 (default True).
        grader_workers: grading processes (started on first use).
        name: the task's name in logs and artifacts.
        no_train_hint: appended to the error raised when training without a train set.
    """

    def __init__(
        self,
        test: list[Example],
        train: list[Example] | None = None,
        template: str = "base",
        tokenizer: Any = None,
        timeout_s: float = 5.0,
        require_boxed: bool = True,
        grader_workers: int = 2,
        name: str = "math",
        no_train_hint: str = "set train= or train_file=",
    ) -> None:
        self.name, self._no_train_hint = name, no_train_hint
        self.template, self.tokenizer, self.timeout_s = template, tokenizer, timeout_s
        render_prompt("1+1", template, tokenizer)  # fail now (ConfigError) on a bad template
        self._train = list(train) if train is not None else None
        self._test = [self._render(e) for e in test]
        self._grader = Grader(workers=grader_workers, require_boxed=require_boxed)

    def _render(self, e: Example) -> Example:
        problem = e.meta.get("problem", e.prompt)
        return replace(e, prompt=render_prompt(problem, self.template, self.tokenizer), meta={**e.meta, "problem": problem})

    def train_examples(self, n: int, rng: random.Random) -> list[Example]:
        """``n`` examples of the train set: without replacement when ``n`` fits, else with."""
        if not self._train:
            raise ConfigError(f"task {self.name!r}: no training set ({self._no_train_hint})")
        picks = rng.sample(self._train, n) if n <= len(self._train) else rng.choices(self._train, k=n)
        return [self._render(e) for e in picks]

    def test_examples(self) -> list[Example]:
        return list(self._test)

    def score(self, example: Example, completion: str) -> float:
        return float(self._grader.grade(completion, example.answer, timeout_s=self.timeout_s))

    def score_many(self, examples: list[Example], completions: list[str]) -> list[float]:
        pairs = [(c, e.answer) for e, c in zip(examples, completions, strict=True)]
        return [float(ok) for ok in self._grader.grade_many(pairs, timeout_s=self.timeout_s)]

    def format_target(self, example: Example) -> str:
        return f"The final answer is \\boxed{{{example.answer}}}."

    def alphabet(self) -> None:
        return None

    def close(self) -> None:
        self._grader.close()

    def __enter__(self) -> MathTask:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _load(name: str | None, data_file: str | None) -> list[Example] | None:
    if name is None and data_file is None:
        return None
    if name is None:
        return load_math_file(data_file)
    return load_benchmark(name, data_file)


@register_task("math")
def make_math_task(
    test: str | None = "math500",
    test_file: str | None = None,
    train: str | None = None,
    train_file: str | None = None,
    template: str = "base",
    tokenizer: Any = None,
    timeout_s: float = 5.0,
    require_boxed: bool = True,
    grader_workers: int = 2,
) -> MathTask:
    """A MathTask from benchmark names and/or files.

    ``test``/``train`` name a benchmark (see :func:`load_benchmark`); ``*_file`` overrides
    where its problems come from (or, with the name set to None, is any math file).
    """
    test_examples = _load(test, test_file)
    if test_examples is None:
        raise ConfigError("math task: set test= (a benchmark name) or test_file=")
    return MathTask(
        test_examples,
        train=_load(train, train_file),
        template=template,
        tokenizer=tokenizer,
        timeout_s=timeout_s,
        require_boxed=require_boxed,
        grader_workers=grader_workers,
    )


def split_heldout(examples: list[Example], n_test: int | None, seed: int = 0) -> tuple[list[Example], list[Example]]:
    """``(held_out, rest)``: a seeded sample of ``n_test`` examples (in file order) and the others.

    ``n_test`` None or >= the number of examples holds out everything.
    """
    if n_test is not None and (isinstance(n_test, bool) or not isinstance(n_test, int) or n_test < 1):
        raise ConfigError(f"n_test must be a positive integer, got {n_test!r}")
    if n_test is None or n_test >= len(examples):
        return list(examples), []
    picked = set(random.Random(f"masktrl.heldout:{seed}").sample(range(len(examples)), n_test))
    held = [e for i, e in enumerate(examples) if i in picked]
    rest = [e for i, e in enumerate(examples) if i not in picked]
    return held, rest


def _benchmark_factory(bench: str):
    def make_benchmark_task(
        data_file: str | None = None,
        n_test: int | None = None,
        seed: int = 0,
        test: str | None = None,
        test_file: str | None = None,
        template: str = "base",
        tokenizer: Any = None,
        timeout_s: float = 5.0,
        require_boxed: bool = True,
        grader_workers: int = 2,
    ) -> MathTask:
        examples = load_benchmark(bench, data_file)
        if test is not None or test_file is not None:
            held, rest = _load(test, test_file), examples
        else:
            held, rest = split_heldout(examples, n_test, seed)
        return MathTask(
            held,
            train=rest or None,
            template=template,
            tokenizer=tokenizer,
            timeout_s=timeout_s,
            require_boxed=require_boxed,
            grader_workers=grader_workers,
            name=bench,
            no_train_hint=f"all {len(examples)} problems are held out; lower n_test or pass test=/test_file=",
        )

    make_benchmark_task.__doc__ = f"""Task over benchmark {bench!r} (see load_benchmark).

    ``n_test`` problems (a seeded sample; all when None or too many) form the test split
    and the rest the train set, unless ``test``/``test_file`` name a separate test set, in
    which case all of {bench!r} is the train set.
    """
    return make_benchmark_task


for _bench in BENCHMARKS:
    register_task(_bench)(_benchmark_factory(_bench))
