"""Real math data: local files, cached hub benchmarks, and :class:`MathTask`.

The benchmarks are presets of the dataset task (:mod:`masktrl.tasks.dataset`): their hub
sources (``HUB_SOURCES``), the field names below, the ``base`` template and the ``math-verify``
reward; a preset task accepts the dataset task's options (template, reward, source, ...).

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
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from masktrl.errors import ConfigError, DataError
from masktrl.tasks.base import Example, register_task
from masktrl.tasks.dataset import (
    PRESET_OPTIONS,
    DatasetTask,
    NotCached,
    import_datasets,
    load_rows,
    resolve_reward,
    rows_to_examples,
    split_heldout,  # (re-exported: it lived here)
)
from masktrl.tasks.grader import last_boxed
from masktrl.tasks.rewards import Reward
from masktrl.tasks.templates import DAPO_PREFIX, DAPO_SUFFIX, PromptTemplate

PROBLEM_FIELDS = ("problem", "question", "prompt", "Problem", "input")
ANSWER_FIELDS = ("answer", "solution", "final_answer", "Answer", "ground_truth", "target")
ID_FIELDS = ("id", "unique_id", "ID", "problem_id", "idx", "index")
SUFFIXES = (".jsonl", ".json", ".parquet")
FIELDS_HINT = (
    f"a {'/'.join(SUFFIXES)} file with the problem under one of {'|'.join(PROBLEM_FIELDS)} "
    f"and the answer under one of {'|'.join(ANSWER_FIELDS)}"
)
_DAPO_PREFIX, _DAPO_SUFFIX = DAPO_PREFIX, DAPO_SUFFIX  # the template ``dapo`` puts them back


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


def _no_problem(row: dict) -> str:
    """Why ``row`` has no problem text: no problem field, or the first one given not text."""
    given = next((f for f in PROBLEM_FIELDS if row.get(f) is not None), None)
    if given is None:
        return f"missing problem (expected a non-empty field {'|'.join(PROBLEM_FIELDS)})"
    value = row[given]
    if isinstance(value, str):
        return f"field {given!r} is blank (a problem is non-empty text)"
    if isinstance(value, list):
        return f"field {given!r} has no chat message with text content (a problem is text or chat messages)"
    return f"field {given!r} is {type(value).__name__} {str(value)[:40]}, not text (a problem is text or chat messages)"


def _answer_text(name: str, value: Any, where: str) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        # NaN (pandas' missing value in a parquet float column, JSON's NaN) or inf is no answer: the
        # next field is read (it was graded as the text 'nan')
        return str(value) if math.isfinite(value) else None
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
        raise DataError(f"{where}: {_no_problem(row)}")
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
        meta={"problem": problem, "source": source, "row": index, "fields": row},
    )


def _finish(examples: list[Example], where: str, source: str) -> list[Example]:
    if not examples:
        raise DataError(f"{where}: empty file (expected {FIELDS_HINT})")
    if len({e.id for e in examples}) < len(examples):  # ids must be unique: fall back to row numbers
        examples = [replace(e, id=f"{source}/{e.meta['row']}") for e in examples]
    return examples


# --------------------------------------------------------------------------- file readers
class _DuplicateKey(Exception):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict:
    """A JSON object as a dict; ``_DuplicateKey`` for a key given twice (``json`` kept the last one:
    a row with two ``problem`` fields was evaluated on the second without a word)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _twice(where: str, exc: _DuplicateKey) -> DataError:
    return DataError(f"{where}: key {exc.args[0]!r} is given twice in one object; give each key once")


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
            row = json.loads(text.lstrip("\ufeff"), object_pairs_hook=_object)
        except _DuplicateKey as e:
            raise _twice(where, e) from None
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg}, column {e.colno})") from None
        except RecursionError:
            raise DataError(f"{where}: JSON nested too deeply") from None
        yield where, row


def _iter_json(path: Path, data: bytes) -> Iterator[tuple[str, Any]]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}, line {line}: not valid UTF-8") from None
    if not text.strip("\ufeff \t\r\n"):
        return  # empty: reported by the caller
    try:
        rows = json.loads(text.lstrip("\ufeff"), object_pairs_hook=_object)
    except _DuplicateKey as e:
        raise _twice(str(path), e) from None
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON lines in a .json file
            yield from _iter_jsonl(path, iter(data.split(b"\n")))
            return
        raise DataError(f"{path}, line {e.lineno}: invalid JSON ({e.msg}, column {e.colno})") from None
    except RecursionError:
        raise DataError(f"{path}: JSON nested too deeply") from None
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
    if path.is_dir():
        raise DataError(f"{path} is a folder: give a .jsonl/.json/.parquet file")
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
        [
            HubSource("opencompass/AIME2025", "AIME2025-I", "test"),
            HubSource("opencompass/AIME2025", "AIME2025-II", "test"),
        ],
    ],
    "math500": [[HubSource("HuggingFaceH4/MATH-500", None, "test")]],
    "gsm8k": [[HubSource("openai/gsm8k", "main", "test")]],
    "dapo-math": [[HubSource("BytedTsinghua-SIA/DAPO-Math-17k", None, "train")]],
}
COMPOSITES = {"aime": ("aime24", "aime25")}
BENCHMARKS = tuple(sorted([*HUB_SOURCES, *COMPOSITES]))
TRAIN_SETS = ("dapo-math",)  # deduplicated on load (the hub file repeats each problem)


_Unavailable = NotCached
_import_datasets = import_datasets


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
    if name in TRAIN_SETS:
        return _dedupe(examples)
    _warn_repeats(examples, str(data_file) if data_file is not None else name)
    return examples


def _warn_repeats(examples: list[Example], where: str) -> None:
    """One warning line when problems repeat (the same text and answer): each copy is evaluated
    and counted as a problem of its own, so a file that holds a benchmark twice narrows every
    interval with no new evidence."""
    repeats = len(examples) - len({(e.prompt, e.answer) for e in examples})
    if repeats:
        print(
            f"warning: {where}: {repeats} of {len(examples)} problems repeat an earlier one (the same text and "
            "answer); each copy is a problem of its own",
            file=sys.stderr,
            flush=True,
        )


# --------------------------------------------------------------------------- the task
class MathTask(DatasetTask):
    """Math problems graded by math-verify (see :mod:`masktrl.tasks.grader`): a
    :class:`~masktrl.tasks.dataset.DatasetTask` with the math template and reward by default.

    Args:
        test: held-out examples (raw problem text as ``prompt``, as loaders return them).
        train: training examples, or None for an evaluation-only task.
        template: prompt template name (``base``, ``chat``, ``instruct``, ``raw``, ``dapo``; see
            prompts.py and templates.py), a format string, or a :class:`PromptTemplate`.
        tokenizer: needed by the ``chat`` template.
        timeout_s: hard grading timeout per answer.
        require_boxed: a completion without ``\\boxed{}`` scores 0 (default True).
        grader_workers: grading processes (started on first use).
        name: the task's name in logs and artifacts.
        no_train_hint: appended to the error raised when training without a train set.
        reward: a reward name / spec or :class:`Reward` (default: the template's, else math-verify).
        **kwargs: DatasetTask's ``max_prompt_tokens`` and ``count_tokens``.
    """

    def __init__(
        self,
        test: list[Example],
        train: list[Example] | None = None,
        template: str | PromptTemplate = "base",
        tokenizer: Any = None,
        timeout_s: float = 5.0,
        require_boxed: bool = True,
        grader_workers: int = 2,
        name: str = "math",
        no_train_hint: str = "set train= or train_file=",
        reward: str | Reward | None = None,
        **kwargs: Any,
    ) -> None:
        tmpl = template if isinstance(template, PromptTemplate) else PromptTemplate.resolve(template)
        tmpl.check(tokenizer)  # before any grading process exists
        self.timeout_s = timeout_s
        rew = resolve_reward(
            reward, tmpl, "math-verify", timeout_s=timeout_s, workers=grader_workers, require_boxed=require_boxed
        )
        super().__init__(
            test,
            train,
            template=tmpl,
            reward=rew,
            tokenizer=tokenizer,
            name=name,
            no_train_hint=no_train_hint,
            **kwargs,
        )

    def alphabet(self) -> None:
        return None


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


def _preset_rows(
    bench: str, source: str, split: str, subset: str | None, prompt_key: str | None, answer_key: str | None
) -> list[Example]:
    """A preset's examples from another source: by the given keys, else by the math field names."""
    rows = load_rows(source, split, subset)
    where = f"{source} ({split})"
    if prompt_key or answer_key:
        return rows_to_examples(rows, prompt_key or "problem", answer_key or "answer", bench, where)
    examples = [row_to_example(r, f"{where}, row {i}", bench, i) for i, r in enumerate(rows, 1)]
    return _finish(examples, where, bench)


def _benchmark_factory(bench: str):
    def make_benchmark_task(
        data_file: str | None = None,
        n_test: int | None = None,
        seed: int = 0,
        test: str | None = None,
        test_file: str | None = None,
        template: str | None = None,
        tokenizer: Any = None,
        timeout_s: float = 5.0,
        require_boxed: bool = True,
        grader_workers: int = 2,
        **options: Any,
    ) -> MathTask:
        unknown = sorted(set(options) - set(PRESET_OPTIONS))
        if unknown:
            raise ConfigError(
                f"task {bench!r}: unknown option(s) {', '.join(unknown)}; accepted: data_file, "
                "n_test, seed, "
                "test, test_file, template, tokenizer, timeout_s, require_boxed, "
                f"grader_workers, {', '.join(PRESET_OPTIONS)}"
            )
        o = {**dict.fromkeys(PRESET_OPTIONS), "split": "train", "chat": False, **options}
        source, split, test_split, subset = o["source"], o["split"], o["test_split"], o["subset"]
        prompt_key, answer_key = o["prompt_key"], o["answer_key"]
        if source is not None and data_file is not None:
            raise ConfigError(f"task {bench!r}: set task.source or task.data, not both")
        tmpl = PromptTemplate.resolve(
            template,
            system_prompt=o["system_prompt"],
            chat=o["chat"],
            chat_kwargs=o["chat_template_kwargs"],
            default="instruct" if o["chat"] else "base",
        )
        if source is not None:
            examples = _preset_rows(bench, source, split, subset, prompt_key, answer_key)
            examples = _dedupe(examples) if bench in TRAIN_SETS else examples
        else:
            examples = load_benchmark(bench, data_file)
        if test_split is not None:
            if source is None:
                raise ConfigError(f"task {bench!r}: task.test_split needs task.source")
            held, rest = _preset_rows(bench, source, test_split, subset, prompt_key, answer_key), examples
        elif test is not None or test_file is not None:
            held, rest = _load(test, test_file), examples
        else:
            held, rest = split_heldout(examples, n_test, seed)
        return MathTask(
            held,
            train=rest or None,
            template=tmpl,
            tokenizer=tokenizer,
            timeout_s=timeout_s,
            require_boxed=require_boxed,
            grader_workers=grader_workers,
            name=bench,
            no_train_hint=f"all {len(examples)} problems are held out; lower n_test or pass test=/test_file=",
            reward=o["reward"],
            max_prompt_tokens=o["max_prompt_tokens"],
            count_tokens=o["count_tokens"],
        )

    make_benchmark_task.__doc__ = f"""Task over benchmark {bench!r} (see load_benchmark): a preset of the dataset task.

    ``n_test`` problems (a seeded sample; all when None or too many) form the test split
    and the rest the train set, unless ``test``/``test_file`` (or ``test_split`` of ``source``)
    name a separate test set, in which case all of {bench!r} is the train set. ``source``
    reads the problems from another file, folder or cached hub id (by ``prompt_key`` /
    ``answer_key``, else by the math field names); ``template`` (default ``base``, ``instruct``
    with a chat template), ``reward`` (default: the template's, else ``math-verify``) and the
    other ``options`` (``PRESET_OPTIONS``) are the dataset task's.
    """
    return make_benchmark_task


for _bench in BENCHMARKS:
    register_task(_bench)(_benchmark_factory(_bench))
