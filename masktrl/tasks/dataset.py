"""Any dataset as a task: rows read with the ``datasets`` library, a prompt template, a reward.

``task.name: dataset`` reads ``task.source``:

* a local file (``.json``: a JSON list or JSON lines, ``.jsonl``, ``.parquet``, ``.csv``): one
  split, whatever ``task.split`` says;
* a local folder of such files (formats may be mixed): a file belongs to split ``S`` when ``S``
  is a part of its path (``train.jsonl``, ``data/test-00000-of-00001.parquet``,
  ``train/part1.jsonl``); a folder whose files name no split is one ``train`` split;
* a hub id (``org/name``, with ``task.subset`` for its config), read from the local ``datasets``
  cache only: nothing is ever downloaded (``HF_DATASETS_OFFLINE``).

Each row gives an :class:`~masktrl.tasks.base.Example`: the prompt under ``task.prompt_key``
(default ``prompt``; a list of chat messages gives its last user message) and the reference
answer under ``task.answer_key`` (default ``answer``; numbers become text), both dotted paths
into nested fields (``reward_model.ground_truth``). The whole row travels with the example
(``meta["fields"]``): templates and rewards may use any of its fields. The held-out split is
``task.test_split``, or else ``n_test`` rows sampled (seeded) from ``task.split``, the rest
training. ``task.max_prompt_tokens`` drops the examples whose rendered prompt is longer.

The math benchmarks (``dapo-math``, ``math500``, ``gsm8k``, ``aime``, ``aime24``, ``aime25``)
are presets of this task: their hub sources, the math field names (``problem|question|...``,
see :mod:`masktrl.tasks.math_data`), the ``base`` template and the ``math-verify`` reward.
Every option above overrides a preset's.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from masktrl.caches import scratch
from masktrl.errors import ConfigError, DataError
from masktrl.tasks.base import Example, register_task
from masktrl.tasks.fields import fields_hint, get_path, has_path
from masktrl.tasks.rewards import Reward, make_reward
from masktrl.tasks.templates import PromptTemplate

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
SPLIT_NAMES = ("train", "test", "validation", "valid", "dev", "eval")


# --------------------------------------------------------------------------- reading rows
class NotCached(Exception):
    """A hub dataset that is not in the local cache (or `datasets` missing)."""


def import_datasets():
    """The ``datasets`` module in offline mode (never downloads); NotCached if not installed."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # never download; the cache or nothing
    try:
        import datasets
    except ImportError:
        raise NotCached("the `datasets` package is not installed (pip install 'masktrl[data]')") from None
    if hasattr(datasets, "config"):
        datasets.config.HF_DATASETS_OFFLINE = True
        datasets.config.HF_HUB_OFFLINE = True  # what datasets>=3 reads; the env var only counts at import
    for quiet in ("disable_progress_bars", "disable_progress_bar"):
        if callable(getattr(datasets, quiet, None)):
            getattr(datasets, quiet)()
    logging = getattr(getattr(datasets, "utils", None), "logging", None)
    if logging is not None and hasattr(logging, "set_verbosity"):
        # CRITICAL, not ERROR: its readers log "Failed to read ..." before they raise, and the
        # raise becomes masktrl's one line naming the file; the log was a second line
        logging.set_verbosity(getattr(logging, "CRITICAL", 50))
    return datasets


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def looks_local(source: str) -> bool:
    """A path (exists, or is written like one) rather than a hub id."""
    return (
        os.path.exists(source)
        or source.startswith((".", "/", "~"))
        or Path(source).suffix.lower() in BUILDERS
        or source.count("/") > 1
    )


def folder_splits(folder: Path) -> dict[str, list[Path]]:
    """The data files of ``folder`` by split (see the module doc), in path order."""
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix.lower() in BUILDERS
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    if not files:
        raise DataError(f"{folder}: no data files (expected {', '.join(BUILDERS)} files)")
    splits: dict[str, list[Path]] = {}
    for path in files:
        rel = path.relative_to(folder).with_suffix("").as_posix().lower()
        parts = set(re.split(r"[-_./]", rel))
        for name in SPLIT_NAMES:
            if name in parts:
                splits.setdefault(name, []).append(path)
    return splits or {"train": files}


def _read_files(datasets, files: list[Path], where: str) -> list[dict]:
    rows: list[dict] = []
    for builder in dict.fromkeys(BUILDERS[p.suffix.lower()] for p in files):  # one load per format
        group = [str(p) for p in files if BUILDERS[p.suffix.lower()] == builder]
        if builder in ("json", "csv"):
            for path in group:
                _check_text(Path(path), builder)
        # The arrow cache of a local file is built in a temporary folder that is gone once the rows
        # are read: nothing is written in $HOME (the library's default) nor left anywhere.
        with scratch("masktrl-datasets-") as cache:  # under <out>/.cache with --out: nothing in /tmp
            try:
                ds = datasets.load_dataset(
                    builder, data_files={"train": group}, split="train", cache_dir=cache, keep_in_memory=True
                )
            except Exception as e:
                # datasets wraps a reader's error ("An error occurred while generating the
                # dataset"): name the reader's own, which says what is wrong with the file
                cause = e.__cause__ if type(e).__name__ == "DatasetGenerationError" and e.__cause__ else e
                raise DataError(
                    f"{where}: cannot read {', '.join(Path(g).name for g in group)} ({_first_line(cause)})"
                ) from None
            try:
                rows.extend(ds.to_list() if hasattr(ds, "to_list") else [dict(r) for r in ds])
            except UnicodeDecodeError as e:  # a parquet string column holding bytes that are not UTF-8
                raise DataError(
                    f"{where}: a text field is not UTF-8 (byte 0x{e.object[e.start]:02x}: {e.reason})"
                ) from None
    return rows


def _check_text(path: Path, builder: str) -> None:
    """DataError, naming the file (and the line), for a JSON or CSV file that is not UTF-8 text,
    holds no rows, or (JSON) nests deeper than Python's parser goes (about 1,000 levels): the
    ``datasets`` readers stop with ``StopIteration``, a decoding traceback or (deep JSON) a
    crash of the process on such input."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}, line {line}: not UTF-8 text (byte 0x{data[e.start]:02x})") from None
    if not text.strip() or (builder == "csv" and len(text.strip().splitlines()) < 2):
        raise DataError(f"{path}: empty file (no rows)" if not text.strip() else f"{path}: a header and no rows")
    if builder == "json":
        _check_nesting(path, data)


def _check_nesting(path: Path, data: bytes) -> None:
    """DataError for JSON nested deeper than Python's parser goes (about 1,000 levels): the
    ``datasets`` JSON reader crashes the process on such input instead of raising."""
    pieces = [data]
    try:
        json.loads(data)
    except RecursionError:
        raise DataError(f"{path}: JSON nested too deeply") from None
    except ValueError:
        pieces = data.split(b"\n")  # JSON lines (or broken JSON: the reader below names the problem)
    for number, line in enumerate(pieces if len(pieces) > 1 else [], 1):
        try:
            json.loads(line)
        except RecursionError:
            raise DataError(f"{path}, line {number}: JSON nested too deeply") from None
        except ValueError:
            pass


def load_rows(source: str, split: str = "train", subset: str | None = None) -> list[dict]:
    """The rows of split ``split`` of ``source`` (a local file or folder, or a cached hub id).

    Raises DataError (one line) for a missing path, an unreadable file, a split the source does
    not have (listing those it has) or a hub id that is not in the local cache.
    """
    if not isinstance(source, str) or not source.strip():
        raise ConfigError("task.source must be a hub id, or a local file or folder")
    path = Path(os.path.expanduser(source))
    if looks_local(source):
        if not path.exists():
            raise DataError(f"task.source {source}: no such file or folder")
        try:
            datasets = import_datasets()
        except NotCached as e:
            raise DataError(f"task.source {source}: {e}") from None
        if path.is_file():
            if path.suffix.lower() not in BUILDERS:
                raise DataError(
                    f"task.source {source}: unsupported file type {path.suffix or '(none)'!r}; use "
                    f"{', '.join(BUILDERS)}"
                )
            return _read_files(datasets, [path], str(path))
        splits = folder_splits(path)
        if split not in splits:
            raise DataError(f"task.source {source}: no {split!r} split; splits: {', '.join(splits)}")
        return _read_files(datasets, splits[split], str(path))
    try:
        datasets = import_datasets()
    except NotCached as e:
        raise DataError(f"task.source {source!r}: {e}") from None
    try:
        ds = datasets.load_dataset(source, subset, split=split)
    except Exception as e:
        msg = _first_line(e)
        if "split" in msg.lower() and "should be one of" in msg.lower():
            raise DataError(f"task.source {source!r}: {msg}") from None
        cache = getattr(getattr(datasets, "config", None), "HF_DATASETS_CACHE", "the datasets cache")
        if not path.exists():  # `data/dapo` reads as a hub id `org/name` as well as a relative folder
            raise DataError(
                f"task.source {source!r}: no such file or folder, and as a dataset id it is not in "
                "the local datasets "
                f"cache ({cache}); nothing is downloaded: pass a local file or "
                f"folder (./{source} for a "
                "relative path), or load the dataset once where there is network"
            ) from None
        raise DataError(
            f"task.source {source!r}{f' (subset {subset})' if subset else ''} is not in the "
            f"local datasets cache ({cache}; "
            f"{msg}); nothing is downloaded: load it once where there is network, or pass a "
            "local file or folder"
        ) from None
    return ds.to_list() if hasattr(ds, "to_list") else [dict(r) for r in ds]


def source_name(source: str) -> str:
    """A short name for ids: a file's stem, a folder's name, a hub id's last part."""
    path = Path(source.rstrip("/"))
    return path.stem if path.suffix.lower() in BUILDERS else path.name or source


# --------------------------------------------------------------------------- rows -> examples
def prompt_text(value: Any) -> str | None:
    """A prompt field as text: a string, or a list of chat messages (its last user message)."""
    if isinstance(value, list):
        msgs = [m for m in value if isinstance(m, dict) and isinstance(m.get("content"), str)]
        users = [m for m in msgs if m.get("role") == "user"] or msgs
        value = users[-1]["content"] if users else None
    return value if isinstance(value, str) and value.strip() else None


def answer_text(value: Any) -> str | None:
    """An answer field as text: a string as it is, a number as text, anything else as JSON."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return str(value)
    return json.dumps(value, sort_keys=True, default=str)


def rows_to_examples(rows: list[dict], prompt_key: str, answer_key: str, name: str, where: str) -> list[Example]:
    """Examples from rows by dotted keys. A key missing from the first row is a ConfigError
    listing that row's fields; a later row without a value is a DataError naming the row."""
    if not rows:
        raise DataError(f"{where}: no rows")
    first = rows[0]
    for option, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
        if not isinstance(first, dict) or not has_path(first, key):
            raise ConfigError(f"task.{option} {key!r} is not a field of {where}; {fields_hint(first)}")
    examples = []
    for i, row in enumerate(rows, 1):
        prompt = prompt_text(get_path(row, prompt_key, None))
        if prompt is None:
            raise DataError(f"{where}, row {i}: no prompt text under {prompt_key!r}")
        answer = answer_text(get_path(row, answer_key, None))
        if answer is None:
            raise DataError(f"{where}, row {i}: no answer under {answer_key!r}")
        examples.append(
            Example(f"{name}/{i}", prompt, answer, meta={"problem": prompt, "source": name, "row": i, "fields": row})
        )
    return examples


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


# --------------------------------------------------------------------------- the task
class DatasetTask:
    """Examples of a dataset, rendered with a template, scored by a reward.

    Args:
        test: held-out examples (raw prompt as ``prompt`` / ``meta["problem"]``, the row as
            ``meta["fields"]``), rendered here.
        train: training examples, or None for an evaluation-only task.
        template: the :class:`PromptTemplate`.
        reward: the :class:`~masktrl.tasks.rewards.Reward` (closed with the task).
        tokenizer: the policy's tokenizer (needed by a chat template).
        name: the task's name in logs and artifacts.
        no_train_hint: appended to the error raised when training without a train set.
        max_prompt_tokens: drop examples whose rendered prompt has more tokens.
        count_tokens: tokens of a prompt text (default: ``tokenizer``'s count).

    ``Example.prompt`` is the exact text the model sees (``renders_prompts``): the chat template,
    when used, is already applied, so encoding only tokenizes it.
    """

    renders_prompts = True

    def __init__(
        self,
        test: list[Example],
        train: list[Example] | None = None,
        *,
        template: PromptTemplate,
        reward: Reward,
        tokenizer: Any = None,
        name: str = "dataset",
        no_train_hint: str = "set task.test_split, or lower task.n_test",
        max_prompt_tokens: int | None = None,
        count_tokens: Callable[[str], int] | None = None,
    ) -> None:
        self.name, self._no_train_hint = name, no_train_hint
        self.template, self.tokenizer, self.reward = template, tokenizer, reward
        try:
            template.check(tokenizer)
            first = (test or train or [None])[0]
            if first is not None:
                self._render(first, first=True)  # a template naming a missing field: ConfigError now
            self._test = [self._render(e) for e in test]
            self._train = [self._render(e) for e in train] if train else None
            if max_prompt_tokens is not None:
                self._filter(max_prompt_tokens, count_tokens)
            if first is not None:
                reward.check(first.prompt, first.answer, first.meta.get("fields", {}))
        except BaseException:
            reward.close()
            raise

    # ----------------------------------------------------------------- building
    def _render(self, e: Example, first: bool = False) -> Example:
        problem = e.meta.get("problem", e.prompt)
        fields = e.meta.get("fields") or {}
        try:
            prompt = self.template.render(problem, fields, self.tokenizer)
        except KeyError as missing:
            key = missing.args[0] if missing.args else "?"
            if first:
                names = (
                    fields if "prompt" in fields else {**fields, "prompt": ""}
                )  # {prompt}: the task.prompt_key value
                raise ConfigError(
                    f"task.template names field {key!r}, which the examples lack; {fields_hint(names)}"
                ) from None
            raise DataError(
                f"{e.meta.get('source', self.name)}, row {e.meta.get('row', '?')}: no field {key!r} for task.template"
            ) from None
        return replace(e, prompt=prompt, meta={**e.meta, "problem": problem})

    def _filter(self, max_tokens: int, count_tokens: Callable[[str], int] | None) -> None:
        if count_tokens is None:
            if self.tokenizer is None:
                raise ConfigError("task.max_prompt_tokens needs the policy's tokenizer")
            tok = self.tokenizer
            count_tokens = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
        before = len(self._test) + len(self._train or [])
        shortest = min((count_tokens(e.prompt) for e in self._test + (self._train or [])), default=0)
        self._test = [e for e in self._test if count_tokens(e.prompt) <= max_tokens]
        if self._train:
            self._train = [e for e in self._train if count_tokens(e.prompt) <= max_tokens] or None
        if not self._test and not self._train:
            raise ConfigError(
                f"task.max_prompt_tokens={max_tokens} drops all {before} prompts (the shortest has {shortest} tokens)"
            )
        if not self._test:
            raise ConfigError(f"task.max_prompt_tokens={max_tokens} drops every held-out prompt")

    # ----------------------------------------------------------------- Task protocol
    def train_examples(self, n: int, rng: random.Random) -> list[Example]:
        """``n`` examples of the train set: without replacement when ``n`` fits, else with."""
        if not self._train:
            raise ConfigError(f"task {self.name!r}: no training set ({self._no_train_hint})")
        return rng.sample(self._train, n) if n <= len(self._train) else rng.choices(self._train, k=n)

    def test_examples(self) -> list[Example]:
        return list(self._test)

    def score(self, example: Example, completion: str) -> float:
        return self.score_many([example], [completion])[0]

    def score_many(self, examples: list[Example], completions: list[str]) -> list[float]:
        if len(examples) != len(completions):
            raise ValueError(f"{len(examples)} examples but {len(completions)} completions")
        return self.reward.score(
            [e.prompt for e in examples],
            list(completions),
            [e.answer for e in examples],
            [e.meta.get("fields") or {} for e in examples],
        )

    @property
    def reward_errors(self) -> int:
        """Completions scored 0 because the reward failed on them, so far (see rewards.py)."""
        return self.reward.errors

    def format_target(self, example: Example) -> str:
        return self.reward.format_target(example.answer)

    def alphabet(self) -> str | None:
        """Every character of the rendered prompts and warm-start targets (for a character tokenizer)."""
        chars: set[str] = set()
        for e in self._test + (self._train or []):
            chars.update(e.prompt)
            chars.update(self.format_target(e))
        return "".join(sorted(chars))

    def close(self) -> None:
        self.reward.close()

    def __enter__(self) -> DatasetTask:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def resolve_reward(
    reward: str | Reward | None,
    template: PromptTemplate,
    default: str | None,
    *,
    timeout_s: float = 5.0,
    workers: int = 2,
    require_boxed: bool = True,
) -> Reward:
    """The task's reward: ``reward`` if given, else the one the template asks for, else ``default``."""
    if isinstance(reward, Reward):
        return reward
    spec = reward or template.reward or default
    if spec is None:
        raise ConfigError(
            f"task.reward is required with task.template={template.name or 'a custom string'} (it "
            "asks for no answer format, so it "
            "names no reward): a registered reward (e.g. exact-match, "
            "math-verify), module:function or "
            "path/to/file.py:function"
        )
    return make_reward(spec, timeout_s=timeout_s, workers=workers, require_boxed=require_boxed)


@register_task("dataset")
def make_dataset_task(
    source: str | None = None,
    split: str = "train",
    test_split: str | None = None,
    subset: str | None = None,
    prompt_key: str | None = None,
    answer_key: str | None = None,
    n_test: int | None = 500,
    seed: int = 0,
    template: str | None = None,
    system_prompt: str | None = None,
    chat: bool = False,
    chat_template_kwargs: dict | None = None,
    reward: str | Reward | None = None,
    reward_timeout_s: float = 5.0,
    reward_workers: int = 2,
    max_prompt_tokens: int | None = None,
    tokenizer: Any = None,
    count_tokens: Callable[[str], int] | None = None,
) -> DatasetTask:
    """A :class:`DatasetTask` over ``source`` (see the module doc for every option)."""
    if source is None:
        raise ConfigError("task.name=dataset needs task.source: a hub id (local cache) or a local file or folder")
    tmpl = PromptTemplate.resolve(template, system_prompt=system_prompt, chat=chat, chat_kwargs=chat_template_kwargs)
    name = source_name(source)
    pk, ak = prompt_key or "prompt", answer_key or "answer"
    rows = load_rows(source, split, subset)
    examples = rows_to_examples(rows, pk, ak, name, f"{source} ({split})")
    if test_split is not None:
        test = rows_to_examples(
            load_rows(source, test_split, subset), pk, ak, f"{name}/{test_split}", f"{source} ({test_split})"
        )
        train: list[Example] | None = examples
    else:
        test, train = split_heldout(examples, n_test, seed)
    rew = resolve_reward(reward, tmpl, None, timeout_s=reward_timeout_s, workers=reward_workers)
    return DatasetTask(
        test,
        train or None,
        template=tmpl,
        reward=rew,
        tokenizer=tokenizer,
        name=name,
        no_train_hint=f"all {len(examples)} examples are held out; lower task.n_test or set task.test_split",
        max_prompt_tokens=max_prompt_tokens,
        count_tokens=count_tokens,
    )


PRESET_OPTIONS = (
    "source",
    "split",
    "test_split",
    "subset",
    "prompt_key",
    "answer_key",
    "system_prompt",
    "chat",
    "chat_template_kwargs",
    "reward",
    "max_prompt_tokens",
    "count_tokens",
)
"""Options of :func:`make_dataset_task` that the math presets take too (as keyword arguments)."""


def task_options(
    task_cfg, *, chat: bool = False, tokenizer: Any = None, count_tokens: Callable[[str], int] | None = None
) -> dict:
    """``get_task`` keyword arguments of a dataset task or math preset from the config's task
    section (``masktrl.config.TaskConfig``); ``chat`` is ``model.chat_template``."""
    t = task_cfg
    common = dict(
        source=t.source,
        subset=t.subset,
        split=t.split,
        test_split=t.test_split,
        prompt_key=t.prompt_key,
        answer_key=t.answer_key,
        n_test=t.n_test,
        template=t.template,
        system_prompt=t.system_prompt,
        chat=chat,
        chat_template_kwargs=dict(t.chat_template_kwargs) or None,
        reward=t.reward,
        max_prompt_tokens=t.max_prompt_tokens,
        tokenizer=tokenizer,
        count_tokens=count_tokens,
    )
    if t.name == "dataset":
        return {**common, "reward_timeout_s": t.reward_timeout_s, "reward_workers": t.reward_workers}
    return {**common, "data_file": t.data, "timeout_s": t.reward_timeout_s, "grader_workers": t.reward_workers}
