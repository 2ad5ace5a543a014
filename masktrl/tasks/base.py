"""The task contract: examples in, scores out; and the task registry.

A task yields :class:`Example` s (a prompt and its reference answer) and scores a
completion against one. The reward of RL is the task's score, so the scorer used in
training is the scorer used in evaluation.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from masktrl.errors import ConfigError


@dataclass(frozen=True)
class Example:
    """One problem.

    Attributes:
        id: stable identifier, unique within its split (e.g. ``"test/123+456"``, ``"aime24/60"``).
        prompt: the text the model is conditioned on (already templated for real data).
        answer: the reference answer, e.g. ``"579"`` or ``"\\frac{1}{2}"``.
        meta: free-form extras (e.g. ``{"problem": raw problem text, "source": file}``);
            not part of equality or hashing.
    """

    id: str
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)


@runtime_checkable
class Task(Protocol):
    """What training and evaluation need from a task.

    ``train_examples`` gives fresh samples for synthetic tasks and samples of the train set
    for datasets; ``test_examples`` is a fixed held-out split, identical on every call.
    ``score`` is 1.0 for a correct completion and 0.0 otherwise and never raises on
    malformed model output; ``score_many`` is its batched form (use it for rewards).
    ``format_target`` is the supervised target for warm start (the caller appends EOS).
    ``alphabet`` is the character set of prompts and targets for a character-level
    tokenizer, or None when the task needs a real tokenizer. ``close`` releases
    resources (grader processes); tasks are also context managers.
    """

    name: str

    def train_examples(self, n: int, rng: random.Random) -> list[Example]: ...

    def test_examples(self) -> list[Example]: ...

    def score(self, example: Example, completion: str) -> float: ...

    def score_many(self, examples: list[Example], completions: list[str]) -> list[float]: ...

    def format_target(self, example: Example) -> str: ...

    def alphabet(self) -> str | None: ...

    def close(self) -> None: ...


_TASKS: dict[str, Callable[..., Task]] = {}


def register_task(name: str) -> Callable[[Callable[..., Task]], Callable[..., Task]]:
    """Decorator: register a task class or factory under ``name`` for :func:`get_task`."""

    def deco(factory: Callable[..., Task]) -> Callable[..., Task]:
        if name in _TASKS:
            raise ValueError(f"task {name!r} registered twice")
        _TASKS[name] = factory
        return factory

    return deco


def task_names() -> list[str]:
    """Registered task names, sorted."""
    return sorted(_TASKS)


def task_parameters(name: str) -> list[str]:
    """The option names the factory of task ``name`` accepts (ConfigError for an unknown name)."""
    if name not in _TASKS:
        raise ConfigError(f"unknown task {name!r}; valid tasks: {', '.join(task_names())}")
    return [p for p in inspect.signature(_TASKS[name]).parameters if p != "self"]


def get_task(name: str, **kwargs: Any) -> Task:
    """Build the task registered as ``name`` with its config ``kwargs``.

    Raises ConfigError for an unknown name (listing the valid ones) or an unknown option
    (listing the accepted ones).
    """
    if name not in _TASKS:
        raise ConfigError(f"unknown task {name!r}; valid tasks: {', '.join(task_names())}")
    factory = _TASKS[name]
    params = inspect.signature(factory).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            raise ConfigError(
                f"task {name!r}: unknown option(s) {', '.join(unknown)}; "
                f"accepted: {', '.join(p for p in params if p != 'self')}"
            )
    return factory(**kwargs)
