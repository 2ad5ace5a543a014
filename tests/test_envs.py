"""Environments by path (masktrl/tasks/envs.py) and the shipped tools (masktrl/tasks/tools.py)."""

from __future__ import annotations

import pytest

from masktrl.errors import ConfigError
from masktrl.tasks.envs import EnvStats, Episode, load_env
from masktrl.tasks.tools import CalcError, Calculator, Search, calculate, call_content


def _write(tmp_path, body: str, name: str = "envs.py"):
    path = tmp_path / name
    path.write_text(body)
    return path


def test_an_env_loads_by_path_and_by_module(tmp_path, monkeypatch):
    path = _write(
        tmp_path,
        "class Echo:\n    def reset(self, example):\n        self.n = 0\n"
        "    def step(self, call):\n        return call.upper(), call == 'bye'\n",
    )
    monkeypatch.chdir(tmp_path)
    cls = load_env("envs.py:Echo")
    assert cls.__name__ == "Echo"
    assert load_env("masktrl.tasks.tools:Calculator") is Calculator
    stats = EnvStats()
    ep = Episode(cls, stats)
    assert ep.reset({"prompt": "p"})
    assert ep.step("hi") == ("HI", False)
    assert ep.step("bye") == ("BYE", True)
    assert ep.step("more") == ("", True)  # the episode is over
    assert stats.take() == {"env_calls": 2, "env_errors": 0, "env_timeouts": 0, "env_truncated": 0}
    assert path.exists()


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nothing", "must be path/to/file.py:Class"),
        ("missing.py:Env", "no such file missing.py"),
        ("broken.py:Env", "cannot import broken.py (SyntaxError"),
        ("ok.py:Nope", "has no attribute 'Nope'"),
        ("ok.py:fn", "is a function, not a class"),
        ("ok.py:NoStep", "has no step method"),
        ("ok.py:NeedsArgs", "an environment is built without arguments"),
        ("no_such_module_x:Env", "cannot import no_such_module_x (ModuleNotFoundError"),
    ],
)
def test_an_env_that_cannot_be_used_is_one_config_error(tmp_path, monkeypatch, spec, message):
    _write(tmp_path, "def broken(:\n", "broken.py")
    _write(
        tmp_path,
        "def fn():\n    pass\nclass NoStep:\n    def reset(self, e):\n        pass\n"
        "class NeedsArgs:\n    def __init__(self, x):\n        pass\n    def reset(self, e):\n        pass\n"
        "    def step(self, c):\n        return '', True\n",
        "ok.py",
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as info:
        load_env(spec)
    assert "\n" not in str(info.value)


class Raises:
    def reset(self, example):
        pass

    def step(self, call):
        raise RuntimeError("boom")


class Hangs:
    def reset(self, example):
        pass

    def step(self, call):
        import threading

        threading.Event().wait(30)  # longer than the test's timeout


class NotText:
    def reset(self, example):
        pass

    def step(self, call):
        return 42, False


class BadReset:
    def reset(self, example):
        raise KeyError("documents")

    def step(self, call):
        return "x", False


@pytest.mark.parametrize(
    "cls, counter, text",
    [
        (Raises, "env_errors", "RuntimeError: boom"),
        (Hangs, "env_timeouts", "timed out"),
        (NotText, "env_errors", "expected (reply: str, done: bool)"),
    ],
)
def test_a_failing_env_ends_its_episode_and_is_counted(cls, counter, text):
    stats = EnvStats()
    ep = Episode(cls, stats, timeout_s=0.2)
    assert ep.reset({})
    assert ep.step("call") == ("", True)
    assert ep.step("again") == ("", True)  # over: not called again
    assert text in stats.last_error
    row = stats.take()
    assert row[counter] == 1 and sum(row.values()) == 1
    assert ep.reset({}) and ep.env is not None  # the next episode starts afresh


def test_a_failing_reset_is_counted():
    stats = EnvStats()
    ep = Episode(BadReset, stats)
    assert not ep.reset({})
    assert ep.step("x") == ("", True)
    assert stats.errors == 1


@pytest.mark.parametrize(
    "expr, value",
    [
        ("1+2*3", 7),
        ("(1+2)*3", 9),
        ("7/2", 3.5),
        ("7//2", 3),
        ("-3**2", -9),
        ("2^10", 1024),
        ("10 % 4", 2),
        ("1e3 + 0.5", 1000.5),
        ("+4 - -4", 8),
    ],
)
def test_calculator_evaluates_arithmetic(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize(
    "expr",
    [
        "__import__('os')",
        "x + 1",
        "(1).real",
        "'a' * 3",
        "[1, 2]",
        "1 / 0",
        "9 ** 9 ** 9",
        "10 ** 40",
        "True + 1",
        "lambda: 1",
        "",
        "1 +",
    ],
)
def test_calculator_refuses_everything_else(expr):
    with pytest.raises(CalcError):
        calculate(expr)


def test_calculator_tool_replies():
    calc = Calculator()
    calc.reset({})
    assert calc.step("I need <calc>12*(3+4)</calc>") == ("84", False)
    assert calc.step("<calc>1/3") == ("0.333333333333", False)  # cut at the stop string: read to the end
    assert calc.step("<calc>os.system('x')</calc>")[0].startswith("error: ")
    assert call_content("a <calc>1</calc> b <calc>2</calc>", "calc") == "2"


def test_search_ranks_the_matching_document_first():
    pytest.importorskip("bm25s")
    docs = [
        "Zorvex lives in Quillton and works as a baker.",
        "Mirabel lives in Dunmore and works as a pilot.",
        "Quillton is a city on the river Ashe.",
    ]
    s = Search()
    s.reset({"documents": docs})
    reply, done = s.step("<search>where does Mirabel live</search>")
    assert not done and reply.split("\n")[0] == docs[1]
    assert s.step("<search>unknownword</search>") == ("no results", False)
    assert s.step("<search>  </search>") == ("no results", False)
    empty = Search()
    empty.reset({})
    assert empty.step("<search>Mirabel</search>") == ("no results", False)


def test_search_corpus_from_a_subclass():
    pytest.importorskip("bm25s")

    class KB(Search):
        corpus = ("alpha beta", "gamma delta")
        top_n = 1

    kb = KB()
    kb.reset({})
    assert kb.step("<search>delta</search>") == ("gamma delta", False)
