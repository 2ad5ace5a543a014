import random

import pytest

from masktrl.errors import ConfigError
from masktrl.tasks import Example, Task, get_task
from masktrl.tasks.arithmetic import ALPHABET_BOXED, ALPHABET_PLAIN, ArithmeticTask


def test_registry_builds_task_and_rejects_unknown():
    task = get_task("arithmetic", digits=2, n_test=20)
    assert isinstance(task, Task) and task.name == "arithmetic"
    with pytest.raises(ConfigError, match="valid tasks: .*arithmetic"):
        get_task("arithmetics")
    with pytest.raises(ConfigError, match="unknown option.*digitz.*accepted"):
        get_task("arithmetic", digitz=3)


@pytest.mark.parametrize(
    "op, a, b, answer", [("+", 123, 456, "579"), ("-", 12, 345, "-333"), ("*", 12, 34, "408"), ("-", 7, 7, "0")]
)
def test_prompt_and_answer_per_op(op, a, b, answer):
    ex = ArithmeticTask._example("train", a, op, b)
    assert ex.prompt == f"{a}{op}{b}=" and ex.answer == answer


@pytest.mark.parametrize("ops", ["+", "-", "*", "+-*"])
def test_sampled_answers_are_correct(ops):
    task = ArithmeticTask(ops=ops, digits=3, n_test=50)
    fns = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for ex in task.train_examples(200, random.Random(1)) + task.test_examples():
        expr = ex.prompt[:-1]
        op = next(o for o in "+*" if o in expr) if ("+" in expr or "*" in expr) else "-"
        a, b = expr.split(op, 1)
        assert ex.prompt.endswith("=") and op in ops
        assert 0 <= int(a) < 1000 and 0 <= int(b) < 1000
        assert ex.answer == str(fns[op](int(a), int(b)))


def test_formats_targets_and_alphabet():
    plain = ArithmeticTask(answer_format="plain", n_test=10)
    boxed = ArithmeticTask(answer_format="boxed", n_test=10)
    ex = ArithmeticTask._example("test", 123, "+", 456)
    assert plain.format_target(ex) == "579"
    assert boxed.format_target(ex) == "\\boxed{579}"
    assert plain.alphabet() == ALPHABET_PLAIN and boxed.alphabet() == ALPHABET_BOXED
    for task in (plain, boxed):
        chars = set(task.alphabet())
        assert len(chars) == len(task.alphabet())
        for e in task.test_examples() + [ex]:
            assert set(e.prompt + task.format_target(e)) <= chars


def test_test_split_fixed_and_disjoint_from_training():
    t1 = ArithmeticTask(ops="+-", digits=2, n_test=500, seed=3)
    t2 = ArithmeticTask(ops=["-", "+"], digits=2, n_test=500, seed=3)  # order of ops irrelevant
    assert t1.test_examples() == t2.test_examples() == t1.test_examples()
    test_prompts = {e.prompt for e in t1.test_examples()}
    assert len(test_prompts) == 500
    # 2-digit +/-: 20,000 problems, 500 held out; 20,000 draws would hit ~500 of them without rejection
    train = t1.train_examples(20_000, random.Random(0))
    assert len(train) == 20_000 and not test_prompts & {e.prompt for e in train}
    assert ArithmeticTask(ops="+-", digits=2, n_test=500, seed=4).test_examples() != t1.test_examples()


def test_training_samples_are_fresh_and_seeded():
    task = ArithmeticTask(n_test=10)
    assert task.train_examples(5, random.Random(7)) == task.train_examples(5, random.Random(7))
    rng = random.Random(7)
    assert task.train_examples(5, rng) != task.train_examples(5, rng)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(ops="/"),
        dict(ops=""),
        dict(digits=0),
        dict(digits="3"),
        dict(answer_format="latex"),
        dict(digits=1, n_test=500),
        dict(n_test=0),
    ],
)
def test_bad_config_is_config_error(kwargs):
    with pytest.raises(ConfigError):
        ArithmeticTask(**kwargs)


GARBAGE = ["", "   ", "\x00\x01", "🙂🙃 ∑∫√", "5" * 100_000, "\\boxed{579", "}}}{{{", "\\boxed{{{{579}", None, 579]


def test_score_plain():
    task = ArithmeticTask(answer_format="plain", n_test=10)
    ex = ArithmeticTask._example("test", 123, "+", 456)
    assert task.score(ex, "579") == 1.0 and task.score(ex, " 579\n") == 1.0
    for wrong in ["578", "0579", "579.", "\\boxed{579}", "+579", "5 79", "579\n580"]:
        assert task.score(ex, wrong) == 0.0, wrong
    neg = ArithmeticTask._example("test", 12, "-", 345)
    assert task.score(neg, "-333") == 1.0 and task.score(neg, "333") == 0.0
    for g in GARBAGE:
        assert task.score(ex, g) == 0.0


def test_score_boxed():
    task = ArithmeticTask(answer_format="boxed", n_test=10)
    ex = ArithmeticTask._example("test", 123, "+", 456)
    assert task.score(ex, "\\boxed{579}") == 1.0
    assert task.score(ex, "\\boxed{1}\\boxed{579}") == 1.0  # the last box counts
    assert task.score(ex, "\\boxed{579}\\boxed{1}") == 0.0
    assert task.score(ex, "579") == 0.0 and task.score(ex, "\\boxed{}") == 0.0
    for g in GARBAGE:
        assert task.score(ex, g) == 0.0
    assert task.score_many([ex, ex], ["\\boxed{579}", "x"]) == [1.0, 0.0]


def test_example_is_frozen_and_hashable():
    ex = Example("a", "1+1=", "2", meta={"x": 1})
    with pytest.raises(AttributeError):
        ex.answer = "3"
    assert hash(ex) == hash(Example("a", "1+1=", "2")) and ex == Example("a", "1+1=", "2")
