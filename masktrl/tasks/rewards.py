"""Rewards: one float per completion, from a registered name or any importable function.

A reward function has the TRL-style signature::

    def my_reward(prompts, completions, answers, **fields) -> list[float]

* ``prompts``: the prompt texts, exactly as the model saw them (one per completion);
* ``completions``: the decoded completions;
* ``answers``: the reference answers (the values under ``task.answer_key``, as text);
* ``**fields``: every other field of each example's row, one list per field aligned with
  ``completions`` (nested fields as dicts; a row field called ``prompts``, ``completions`` or
  ``answers`` is not passed). A function without ``**kwargs`` gets only the fields it names.
* returns a list (or tuple, or 1-d array) of ``len(completions)`` numbers.

``task.reward`` names it as

* a registered name: the built-ins ``math-verify`` (last ``\\boxed{}`` graded by math-verify),
  ``answer-line`` (the text after the last ``Answer:``, graded by math-verify: DAPO's format),
  ``exact-match`` (the stripped completion equals the answer: arithmetic), ``boxed-match``
  (the last ``\\boxed{}`` content equals the answer), or one added with :func:`register_reward`;
* ``module:function``, an importable module (``my_pkg.rewards:score``);
* ``path/to/file.py:function``, a Python file (relative to the current directory).

Where it runs: a user function runs in worker processes (the grader's :class:`WorkerPool`), one
completion per call, under the same hard wall-clock timeout as math grading
(``task.reward_timeout_s``). An exception, a timeout, a crashed worker, ``None``, a non-finite
value or a wrong number of values scores that completion 0 and is counted (``reward_errors`` in
``metrics.jsonl``). A step where the reward failed on more than 10% of the completions prints a
warning, and one where it failed on more than ``task.max_reward_error_frac`` (default 0.5) stops
the run with one line (``check_reward_errors``). Before a run starts, the function is imported and
called once on the first example (:meth:`PooledReward.check`): an unimportable path, a signature
that cannot take these arguments or a wrong number of values is a ConfigError then. Built-ins
run in the training process (math-verify isolates itself in its own grading pool).

Keep a reward file's top level cheap and side-effect free: each worker imports it (a script's
``if __name__ == "__main__":`` block does not run there).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from masktrl.errors import ConfigError
from masktrl.tasks.grader import Grader, WorkerPool, extract_answer

_WORKER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_reward_worker.py")
RESERVED = ("prompts", "completions", "answers")


@dataclass(frozen=True)
class RewardEntry:
    """A registered reward: the function, whether it runs in worker processes, and the warm-start
    target it rewards (a format string over ``{answer}``)."""

    name: str
    fn: Callable[..., Sequence[float]]
    isolated: bool = True
    target: str = "{answer}"


_REWARDS: dict[str, RewardEntry] = {}


def register_reward(name: str, fn: Callable | None = None, *, isolated: bool = True, target: str = "{answer}"):
    """Register ``fn`` as the reward called ``name`` (``task.reward: name``); a decorator when
    ``fn`` is omitted.

    ``isolated=True`` (default): it runs in worker processes with a timeout, so it must be
    importable by them: defined at the top level of a module or of a script file. ``False``: it
    runs in the training process, without a timeout (for cheap, trusted code). ``target``: the
    completion that earns the reward, as a format string over ``{answer}`` (the warm start of
    the tiny model trains on it).
    """

    def deco(f: Callable) -> Callable:
        if not name or ":" in name or "/" in name:
            raise ValueError(f"reward name {name!r}: use a plain name (no ':' or '/')")
        if name in _REWARDS:
            raise ValueError(f"reward {name!r} registered twice")
        if not callable(f):
            raise TypeError(f"reward {name!r}: {f!r} is not callable")
        _REWARDS[name] = RewardEntry(name, f, isolated, target)
        return f

    return deco if fn is None else deco(fn)


def reward_names() -> list[str]:
    """Registered reward names, sorted."""
    return sorted(_REWARDS)


def make_reward(spec: str, *, timeout_s: float = 5.0, workers: int = 2, require_boxed: bool = True) -> Reward:
    """The reward ``spec`` names (see the module doc), ready to score.

    ``timeout_s`` and ``workers`` size the worker pool (and math-verify's); ``require_boxed``
    is math-verify's. Raises ConfigError for a spec that names nothing usable.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"task.reward must be a reward name or module:function, got {spec!r}")
    if timeout_s <= 0:
        raise ConfigError(f"task.reward_timeout_s must be > 0, got {timeout_s}")
    spec = spec.strip()
    if spec in _REWARDS:
        entry = _REWARDS[spec]
        if not entry.isolated:
            fn = entry.fn
            if hasattr(fn, "configure"):
                fn = fn.configure(timeout_s=timeout_s, workers=workers, require_boxed=require_boxed)
            return InProcessReward(spec, fn, entry.target)
        return PooledReward(spec, _location_of(entry), timeout_s, workers, entry.target)
    if ":" not in spec:
        raise ConfigError(
            f"unknown reward {spec!r}; registered rewards: {', '.join(reward_names())}, "
            "or module:function, or path/to/file.py:function"
        )
    where, _, attr = spec.rpartition(":")
    if not where or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", attr):
        raise ConfigError(f"task.reward {spec!r}: expected module:function or path/to/file.py:function")
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise ConfigError(f"task.reward {spec!r}: no such file {where}")
        location = {"file": path, "attr": attr}
    else:
        location = {"module": where, "attr": attr}
    return PooledReward(spec, location, timeout_s, workers, "{answer}")


def _location_of(entry: RewardEntry) -> dict:
    """How a worker finds a registered function: its module, or the script that defined it."""
    fn = entry.fn
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or not qualname or "<" in qualname:
        raise ConfigError(
            f"reward {entry.name!r} is not defined at the top level of a module or file, so "
            "worker processes "
            "cannot import it; move it there, or register it with isolated=False"
        )
    if module == "__main__":
        path = getattr(sys.modules.get("__main__"), "__file__", None)
        if not path:
            raise ConfigError(
                f"reward {entry.name!r} was defined interactively, so worker processes cannot "
                "import it; "
                "define it in a file, or register it with isolated=False"
            )
        return {"file": os.path.abspath(path), "attr": qualname}
    return {"module": module, "attr": qualname}


# --------------------------------------------------------------------------- failures
REWARD_ERROR_WARN_FRAC = 0.1
"""A step whose reward failed on more than this fraction of its completions prints a warning."""


def check_reward_errors(
    step: int, errors: int, scored: int, max_frac: float, last_error: str | None = None
) -> str | None:
    """The verdict on one step's reward failures (completions scored 0 because the reward raised,
    timed out or returned no finite number): None when at most ``REWARD_ERROR_WARN_FRAC`` of the
    ``scored`` completions failed, a warning line above that, and ConfigError (the run stops)
    when more than ``max_frac`` (``task.max_reward_error_frac``) did."""
    if scored <= 0 or errors <= 0:
        return None
    frac = errors / scored
    last = f"; last: {last_error}" if last_error else ""
    what = f"step {step}: the reward failed on {errors} of {scored} completions ({frac:.0%}{last})"
    if frac > max_frac:
        raise ConfigError(f"{what}; the run stops (task.max_reward_error_frac={max_frac:g}): fix task.reward")
    if frac > REWARD_ERROR_WARN_FRAC:
        return f"{what}; they score 0 (the run stops above task.max_reward_error_frac={max_frac:g})"
    return None


# --------------------------------------------------------------------------- scoring
def _field_lists(fields: list[dict]) -> dict[str, list]:
    keys: dict[str, None] = {}
    for row in fields:
        keys.update(dict.fromkeys(k for k in row if isinstance(k, str) and k not in RESERVED))
    return {k: [row.get(k) for row in fields] for k in keys}


def _as_score(value: Any) -> float | None:
    """A finite float, or None for anything else (counted as an error)."""
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    return None


class Reward:
    """What a task holds: ``score`` gives one float per completion (0 where the reward failed)
    and adds the failures to ``errors``; ``target`` formats the rewarded completion."""

    name: str
    target: str = "{answer}"
    errors: int = 0
    last_error: str | None = None

    def score(self, prompts: list[str], completions: list[str], answers: list[str], fields: list[dict]) -> list[float]:
        raise NotImplementedError

    def check(self, prompt: str, answer: str, fields: dict) -> None:
        """ConfigError now if the reward cannot be used (run before anything is written)."""

    def format_target(self, answer: str) -> str:
        """The rewarded completion: ``target`` with ``{answer}`` replaced (no other braces are special)."""
        return self.target.replace("{answer}", answer)

    def close(self) -> None:
        pass

    def _failed(self, message: str) -> float:
        self.errors += 1
        self.last_error = message
        return 0.0


class InProcessReward(Reward):
    """A trusted function called in this process: the whole batch at once; if that raises, one
    completion at a time, so only the completions it fails on score 0."""

    def __init__(self, name: str, fn: Callable, target: str = "{answer}") -> None:
        self.name, self.fn, self.target = name, fn, target
        self.errors, self.last_error = 0, None

    def score(self, prompts, completions, answers, fields):
        n = len(completions)
        try:
            values = list(self.fn(prompts=prompts, completions=completions, answers=answers, **_field_lists(fields)))
            if len(values) != n:
                raise ValueError(f"returned {len(values)} values for {n} completions")
        except Exception:
            if n == 1:
                return [self._failed(f"{self.name} raised")]
            return [self.score([p], [c], [a], [f])[0] for p, c, a, f in zip(prompts, completions, answers, fields)]
        out = []
        for v in values:
            s = _as_score(v)
            out.append(self._failed(f"{self.name} returned {v!r}") if s is None else s)
        return out

    def close(self) -> None:
        if hasattr(self.fn, "close"):
            self.fn.close()


class PooledReward(Reward):
    """A user function run in worker processes, one completion per call, under a hard timeout."""

    def __init__(
        self, spec: str, location: dict, timeout_s: float = 5.0, workers: int = 2, target: str = "{answer}"
    ) -> None:
        self.name, self.location, self.timeout_s, self.target = spec, location, timeout_s, target
        self.errors, self.last_error = 0, None
        init = {"location": location, "path": [os.path.abspath(p or ".") for p in sys.path]}
        self.pool = WorkerPool(
            lambda: [sys.executable, "-u", "-B", _WORKER_PATH, _json(init)],  # -B: no __pycache__ beside the file
            workers,
            name=f"task.reward {spec!r}",
            kind="reward worker",
            start_error=ConfigError,
            startup_timeout_s=max(60.0, timeout_s),
        )
        self._lock = threading.Lock()

    def check(self, prompt: str, answer: str, fields: dict) -> None:
        """Import the function in a worker and call it once with two completions of the first
        example: ConfigError if it cannot be imported, cannot take the arguments, or returns
        anything but two numbers. (An exception it raises is left to scoring, which counts it.)"""
        kwargs = {
            "prompts": [prompt] * 2,
            "completions": [answer, ""],
            "answers": [answer] * 2,
            **_field_lists([fields, fields]),
        }
        with self._lock:
            answers, _ = self.pool.run({0: {"kwargs": kwargs, "n": 2}}, self.timeout_s)
        bad = answers.get(0, {}).get("bad")
        if bad:
            raise ConfigError(f"task.reward {self.name!r}: {bad}")

    def score(self, prompts, completions, answers, fields):
        requests = {
            i: {"kwargs": {"prompts": [p], "completions": [c], "answers": [a], **_field_lists([f])}, "n": 1}
            for i, (p, c, a, f) in enumerate(zip(prompts, completions, answers, fields, strict=True))
        }
        with self._lock:
            replies, failed = self.pool.run(requests, self.timeout_s)
        out = []
        for i in range(len(completions)):
            reply = replies.get(i)
            if i in failed or reply is None:
                out.append(self._failed(f"{self.name}: timed out after {self.timeout_s:g}s or crashed"))
            elif "scores" in reply:
                s = _as_score(reply["scores"][0]) if len(reply["scores"]) == 1 else None
                out.append(self._failed(f"{self.name} returned {reply['scores']!r}") if s is None else s)
            else:
                out.append(self._failed(f"{self.name}: {reply.get('raised') or reply.get('bad')}"))
        return out

    def close(self) -> None:
        self.pool.close()


def _json(obj: Any) -> str:
    return json.dumps(obj)


# --------------------------------------------------------------------------- built-ins
def exact_match(prompts=None, completions=(), answers=(), **fields) -> list[float]:
    """1.0 where the stripped completion equals the answer (the arithmetic task's plain scorer)."""
    return [float(isinstance(c, str) and c.strip() == a) for c, a in zip(completions, answers, strict=True)]


def boxed_match(prompts=None, completions=(), answers=(), **fields) -> list[float]:
    """1.0 where the last ``\\boxed{}`` content equals the answer exactly (arithmetic, boxed)."""
    return [float(isinstance(c, str) and extract_answer(c) == a) for c, a in zip(completions, answers, strict=True)]


_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)


def answer_line(completion: str, max_chars: int = 4096) -> str | None:
    """The text after the last ``Answer:`` in the last ``max_chars`` characters (DAPO's format),
    without surrounding ``$`` or a final period; None when there is none."""
    if not isinstance(completion, str):
        return None
    found = _ANSWER_LINE.findall(completion[-max_chars:])
    if not found:
        return None
    text = found[-1].strip()
    while text != (text := text.rstrip(".").strip("$").strip()):
        pass
    return text or None


class MathVerify:
    """Math grading with math-verify in its own pool of killable worker processes (the
    :class:`~masktrl.tasks.grader.Grader`): 1.0 for a completion whose answer (the last
    ``\\boxed{}``, or the last ``Answer:`` line) equals the reference mathematically.

    Registered twice, as ``math-verify`` and ``answer-line``; a task gets a configured copy
    (``configure``) whose grading processes it stops on close.
    """

    def __init__(
        self, extract: str = "boxed", timeout_s: float = 5.0, workers: int = 2, require_boxed: bool = True
    ) -> None:
        self.extract, self.timeout_s, self.workers, self.require_boxed = extract, timeout_s, workers, require_boxed
        self._grader: Grader | None = None

    def configure(self, timeout_s: float = 5.0, workers: int = 2, require_boxed: bool = True) -> MathVerify:
        return MathVerify(self.extract, timeout_s, workers, require_boxed)

    @property
    def grader(self) -> Grader:
        if self._grader is None:
            extract = answer_line if self.extract == "answer-line" else None
            self._grader = Grader(workers=self.workers, require_boxed=self.require_boxed, extract=extract)
        return self._grader

    def __call__(self, prompts=None, completions=(), answers=(), **fields) -> list[float]:
        pairs = list(zip(completions, answers, strict=True))
        return [float(ok) for ok in self.grader.grade_many(pairs, timeout_s=self.timeout_s)]

    def close(self) -> None:
        if self._grader is not None:
            self._grader.close()


register_reward("exact-match", exact_match, isolated=False)
register_reward("boxed-match", boxed_match, isolated=False, target="\\boxed{{answer}}")
register_reward("math-verify", MathVerify("boxed"), isolated=False, target="The final answer is \\boxed{{answer}}.")
register_reward("answer-line", MathVerify("answer-line"), isolated=False, target="Answer: {answer}")
