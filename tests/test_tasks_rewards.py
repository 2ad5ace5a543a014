"""Rewards: registered names, module:function and file.py:function, run in worker processes;
a failing completion scores 0 and is counted, a broken reward is a one-line ConfigError up front."""

import math
import sys
import textwrap

import pytest

from masktrl.errors import ConfigError
from masktrl.tasks import get_task, make_reward, register_reward, reward_names
from masktrl.tasks.rewards import _REWARDS, answer_line
from tests.datasets_helpers import datasets_cache, write_jsonl  # noqa: F401

REWARDS_PY = textwrap.dedent(
    '''
    import math, time

    def flaky(prompts, completions, answers, **fields):
        """Raises on "boom", NaN on "nan", hangs on "hang", else 1 for the answer + 0.5 if the row has a hint."""
        out = []
        for c, a, hint in zip(completions, answers, fields["hint"]):
            if c == "boom":
                raise ValueError("boom")
            if c == "nan":
                out.append(math.nan)
            elif c == "hang":
                time.sleep(60)
            else:
                out.append(float(c.strip() == a) + (0.5 if hint else 0.0))
        return out

    def too_many(prompts, completions, answers, **fields):
        return [0.0] * (len(completions) + 1)

    def words(completions, level):  # no **kwargs: gets only the fields it names
        return [len(c.split()) * level for c, level in zip(completions, level)]

    def needs_missing(completions, difficulty):
        return [0.0 for _ in completions]

    print("printing is harmless")
    '''
)


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS_PY)
    return path


ARGS = dict(prompts=["p"] * 6, answers=["4"] * 6)


def test_file_reward_in_workers_counts_failures_and_goes_on(reward_file):
    reward = make_reward(f"{reward_file}:flaky", timeout_s=1.0, workers=2)
    try:
        reward.check("p", "4", {"hint": None})
        completions = ["4", "boom", "nan", "hang", "5", " 4 "]
        fields = [{"hint": h} for h in (None, None, None, None, None, "yes")]
        scores = reward.score(ARGS["prompts"], completions, ARGS["answers"], fields)
        assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 1.5]
        assert reward.errors == 3  # raised, NaN, timed out
        assert reward.score(["p"], ["4"], ["4"], [{"hint": None}]) == [1.0] and reward.errors == 3  # a fresh worker
    finally:
        reward.close()


def test_module_path_and_signature_without_kwargs(reward_file, monkeypatch):
    monkeypatch.syspath_prepend(str(reward_file.parent))  # workers get this process's sys.path
    reward = make_reward("my_rewards:words", workers=1)
    try:
        assert reward.score(["p", "p"], ["a b", "a b c"], ["x", "x"], [{"level": 2, "other": 1}, {"level": 1}]) == [
            4.0,
            3.0,
        ]
    finally:
        reward.close()


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_module_xyz:f", "cannot import 'f' from no_such_module_xyz (ModuleNotFoundError"),
        ("{file}:absent", "has no attribute 'absent'"),
        ("{dir}/nope.py:f", "no such file"),
        ("{file}:too_many", "returned 3 values for 2 completions"),
        ("{file}:needs_missing", "cannot be called with prompts, completions, answers and the example's fields"),
        (
            "not-registered",
            "unknown reward 'not-registered'; registered rewards: answer-line, boxed-match, exact-match, math-verify",
        ),
        ("{file}:bad name", "expected module:function"),
    ],
)
def test_broken_rewards_are_one_line_config_errors_before_training(
    tmp_path, datasets_cache, reward_file, spec, message
):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "2+2=", "answer": "4", "hint": None, "level": 1}] * 3)
    spec = spec.format(file=reward_file, dir=tmp_path)
    with pytest.raises(ConfigError) as info:
        get_task("dataset", source=str(data), n_test=1, reward=spec, reward_workers=1).close()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_registered_rewards(tmp_path, reward_file, monkeypatch):
    assert {"math-verify", "answer-line", "exact-match", "boxed-match"} <= set(reward_names())
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "registering.py"
    module.write_text(
        "from masktrl.tasks import register_reward\n\n"
        "@register_reward('test-length', target='{answer}!')\n"
        "def length(completions, **fields):\n    return [float(len(c)) for c in "
        "completions]\n"
    )
    monkeypatch.delitem(_REWARDS, "test-length", raising=False)
    import importlib

    sys.modules.pop("registering", None)
    importlib.import_module("registering")
    try:
        reward = make_reward("test-length", workers=1)  # registered in a module: runs in workers, found by name
        try:
            assert reward.score(["p"], ["abc"], ["x"], [{}]) == [3.0] and reward.format_target("7") == "7!"
        finally:
            reward.close()
        with pytest.raises(ValueError, match="registered twice"):
            register_reward("test-length", lambda completions, **kw: [])

        def local(completions, **fields):
            return [1.0 for _ in completions]

        register_reward("test-local", local)
        with pytest.raises(ConfigError, match="not defined at the top level"):
            make_reward("test-local")
        register_reward(
            "test-inproc", lambda completions, **kw: [1 / (len(c) - 1) for c in completions], isolated=False
        )
        inproc = make_reward("test-inproc")
        assert (
            inproc.score(["p"] * 3, ["ab", "a", "abc"], ["x"] * 3, [{}] * 3) == [1.0, 0.0, 0.5] and inproc.errors == 1
        )
    finally:
        for name in ("test-length", "test-local", "test-inproc"):
            _REWARDS.pop(name, None)


def test_builtins():
    exact = make_reward("exact-match")
    assert exact.score(["p"] * 3, [" 4\n", "40", None], ["4"] * 3, [{}] * 3) == [1.0, 0.0, 0.0]
    boxed = make_reward("boxed-match")
    assert boxed.score(["p"] * 2, ["so \\boxed{4}", "4"], ["4"] * 2, [{}] * 2) == [1.0, 0.0]
    assert boxed.format_target("4") == "\\boxed{4}"
    assert make_reward("math-verify").format_target("4") == "The final answer is \\boxed{4}."
    assert answer_line("work\nAnswer: $\\frac{1}{2}$.\n") == "\\frac{1}{2}"
    assert answer_line("answer: 3\nthen ANSWER :  5 ") == "5" and answer_line("no line") is None
    with _closing(make_reward("answer-line")) as line:
        assert line.score(
            ["p"] * 3, ["Answer: 0.5", "Answer: 1/2", "\\boxed{0.5}"], ["\\frac{1}{2}"] * 3, [{}] * 3
        ) == [1.0, 1.0, 0.0]


class _closing:
    def __init__(self, reward):
        self.reward = reward

    def __enter__(self):
        return self.reward

    def __exit__(self, *exc):
        self.reward.close()


def test_non_finite_values_are_errors_in_process_too():
    register_reward(
        "test-inf", lambda completions, **kw: [math.inf if c == "x" else 1.0 for c in completions], isolated=False
    )
    try:
        reward = make_reward("test-inf")
        assert reward.score(["p"] * 2, ["x", "y"], ["a"] * 2, [{}] * 2) == [0.0, 1.0] and reward.errors == 1
    finally:
        _REWARDS.pop("test-inf", None)
