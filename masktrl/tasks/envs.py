"""Environments of multi-turn, tool-using tasks, named by path as rewards are (docs/TASKS.md,
"Environments").

An environment is a class with this protocol, instantiated with no arguments once per episode::

    class Env:
        def reset(self, example: dict) -> None:
            # the episode's example: its row's fields (prompt, answer and every other field)
        def step(self, call: str) -> tuple[str, bool]:
            # the model's call text -> (the reply text the model reads next, whether the episode ends)

``task.env`` names it as ``path/to/file.py:Class`` (relative to the current directory),
``module:Class``, or a shipped tool (``masktrl.tasks.tools:Calculator``,
``masktrl.tasks.tools:Search``). ``load_env`` imports and checks it before a run writes
anything: a path that does not load, a name that is not a class, or a class without callable
``reset`` and ``step`` (or that cannot be instantiated without arguments) is one ConfigError line.

Failures are handled like reward failures (``Episode``): an exception in ``reset`` or ``step``,
a call that runs past ``timeout_s``, or a reply that is not ``(str, bool)`` ends that episode
(the response keeps what it has), is counted (``EnvStats``: ``env_errors``, ``env_timeouts``)
and never stops the run. A reply longer than the episode's token budget left is cut to it (the
episode then ends, out of tokens) and counted (``env_truncated``). An exception in ``reset``
leaves a single-turn response (sampled, no tool). Python cannot stop a running thread: a step
that hangs is abandoned on a daemon thread (its environment object is never used again) and ends
when it ends.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import threading
from dataclasses import dataclass

from masktrl.errors import ConfigError, shown
from masktrl.io import importing_user_file

PROTOCOL = ("reset", "step")


def load_env(spec: str, key: str = "task.env") -> type:
    """The environment class ``spec`` names, checked against the protocol; ConfigError (one
    line naming ``key``) when it cannot be used."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"{key} must be path/to/file.py:Class or module:Class, got {spec!r}")
    where, _, attr = spec.strip().rpartition(":")
    if not where or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", attr):
        raise ConfigError(f"{key} {spec!r}: expected path/to/file.py:Class or module:Class")
    try:
        if where.endswith(".py") or os.sep in where or "/" in where:
            path = os.path.abspath(where)
            if not os.path.isfile(path):
                raise ConfigError(f"{key} {spec!r}: no such file {where}")
            name = "masktrl_env_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
            mspec = importlib.util.spec_from_file_location(name, path)
            if mspec is None or mspec.loader is None:
                raise ConfigError(f"{key} {spec!r}: cannot load {where} as a Python module")
            module = importlib.util.module_from_spec(mspec)
            sys.path.insert(0, os.path.dirname(path))  # the file's own imports of its neighbours
            try:
                with importing_user_file():
                    mspec.loader.exec_module(module)
            finally:
                sys.path.remove(os.path.dirname(path))
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except BaseException as exc:  # SyntaxError, ImportError, SystemExit from a script...
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise ConfigError(
            f"{key} {spec!r}: cannot import {where} ({type(exc).__name__}: {shown(exc)})".replace("\n", " ")
        ) from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key} {spec!r}: {where} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise ConfigError(
            f"{key} {spec!r}: {attr} is a {type(obj).__name__}, not a class with reset(example) and step(call)"
        )
    missing = [m for m in PROTOCOL if not callable(getattr(obj, m, None))]
    if missing:
        raise ConfigError(
            f"{key} {spec!r}: class {attr} has no {' or '.join(missing)} method (the protocol: "
            "reset(example) -> None, "
            "step(call) -> (reply, done))"
        )
    try:
        obj()
    except Exception as exc:
        raise ConfigError(
            f"{key} {spec!r}: {attr}() failed ({type(exc).__name__}: {exc}); an environment is "
            "built without arguments".replace("\n", " ")
        ) from None
    return obj


def env_stop(env_cls: type, call_stop: str | None, spec: str | None) -> str:
    """The text that ends a tool call: ``task.call_stop``, else the class's ``stop`` attribute;
    ConfigError (one line) when neither gives a non-empty string."""
    if call_stop:
        return call_stop
    stop = getattr(env_cls, "stop", None)
    if stop is None:
        raise ConfigError(
            f"task.env {spec!r}: set task.call_stop (the text that ends a tool call); the class has no stop attribute"
        )
    if not isinstance(stop, str) or not stop:
        raise ConfigError(
            f"task.env {spec!r}: the class's stop attribute must be a non-empty string (the text that ends a tool "
            f"call), got {stop!r}; fix it or set task.call_stop"
        )
    return stop


@dataclass
class EnvStats:
    """Counts over the episodes run since the last ``take``."""

    episodes: int = 0
    calls: int = 0  # step calls that returned a reply
    errors: int = 0  # an exception, or a reply that is not (str, bool)
    timeouts: int = 0
    truncated: int = 0  # replies cut to the episode's token budget (task.max_total_tokens)
    last_error: str | None = None

    def take(self) -> dict:
        """The counts as metrics (``env_calls``, ``env_errors``, ``env_timeouts``,
        ``env_truncated``), then zero."""
        row = {
            "env_calls": self.calls,
            "env_errors": self.errors,
            "env_timeouts": self.timeouts,
            "env_truncated": self.truncated,
        }
        self.episodes = self.calls = self.errors = self.timeouts = self.truncated = 0
        return row


_FAILED = object()


class Episode:
    """One episode of an environment class, with every failure isolated and counted.

    ``reset(example)`` and ``step(call)`` return False / ``(reply, done)``; after any failure
    the episode is over (``done`` True, reply ""): the response keeps what it has."""

    def __init__(self, env_cls: type, stats: EnvStats, timeout_s: float = 10.0):
        self.env_cls, self.stats, self.timeout_s = env_cls, stats, timeout_s
        self.env = None
        self.over = False

    def _call(self, fn, *args):
        box: list = [_FAILED]
        err: list = [None]

        def run():
            try:
                box[0] = fn(*args)
            except BaseException as exc:
                err[0] = f"{type(exc).__name__}: {shown(exc)}"[:300]

        thread = threading.Thread(target=run, daemon=True, name="masktrl-env")
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            self._fail(f"timed out after {self.timeout_s:g} s", timeout=True)
            return _FAILED
        if err[0] is not None:
            self._fail(err[0])
            return _FAILED
        return box[0]

    def _fail(self, message: str, timeout: bool = False) -> None:
        if timeout:
            self.stats.timeouts += 1
        else:
            self.stats.errors += 1
        self.stats.last_error = message
        self.over = True
        self.env = None  # never used again (a hung call may still hold it)

    def cut(self) -> None:
        """The last reply was cut to the episode's token budget."""
        self.stats.truncated += 1

    def reset(self, example: dict) -> bool:
        self.stats.episodes += 1
        self.over = False
        env = self._call(self.env_cls)
        if env is _FAILED:
            return False
        self.env = env
        return self._call(env.reset, dict(example)) is not _FAILED

    def step(self, call: str) -> tuple[str, bool]:
        if self.over or self.env is None:
            return "", True
        out = self._call(self.env.step, call)
        if out is _FAILED:
            return "", True
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], str) and isinstance(out[1], bool)):
            self._fail(f"step returned {type(out).__name__} {shown(out)[:80]!r}, expected (reply: str, done: bool)")
            return "", True
        reply = text_of(out[0])
        if reply is None:
            self._fail("step returned a reply that is not valid text (a lone surrogate, or a str subclass that raised)")
            return "", True
        self.stats.calls += 1
        if out[1]:
            self.over = True
        return reply, out[1]


def text_of(value: str) -> str | None:
    """``value`` as a plain ``str`` that the tokenizer can read (UTF-8 encodable), or None: a reply
    holding a lone surrogate (``"\\ud800"``) made the tokenizer raise a TypeError that stopped the
    run, and a ``str`` subclass's own methods ran inside the tokenizer."""
    try:
        text = str.__getitem__(value, slice(None))  # a plain str, whatever the subclass overrides
        text.encode("utf-8")
    except Exception:
        return None
    return text
