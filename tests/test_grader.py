import sys
import textwrap
import time

import pytest

from masktrl.tasks import grader as grader_mod
from masktrl.tasks.grader import Grader, extract_answer, gold_answer, last_boxed, quick_verdict

TIMEOUT = 2.0
STARTUP = 30.0  # generous bound for spawning workers and importing math_verify


@pytest.fixture(scope="module")
def grader():
    with Grader(workers=2) as g:
        yield g


def box(s):
    return f"Some reasoning... so the answer is $\\boxed{{{s}}}$."


# (prediction inside \boxed{}, gold, equivalent?)
TABLE = [
    ("\\frac{1}{2}", "0.5", True),
    ("0.5", "\\frac{1}{2}", True),
    ("1/2", "\\frac{1}{2}", True),
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True),
    ("\\tfrac12", "1/2", True),
    ("042", "42", True),
    ("42", "042", True),
    ("-0", "0", True),
    ("1,000", "1000", True),
    ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}", True),
    ("\\sqrt{2}", "2^{1/2}", True),
    ("3\\sqrt{3}", "\\sqrt{27}", True),
    ("x^2+1", "1+x^2", True),
    ("\\{1,2\\}", "\\{2,1\\}", True),
    ("\\frac{1}{3}", "0.5", False),
    ("0.333", "\\frac{1}{3}", False),
    ("41", "42", False),
    ("420", "42", False),
    ("-42", "42", False),
    ("\\sqrt{2}", "2", False),
    ("x+1", "x+2", False),
    ("", "1", False),
]


@pytest.mark.parametrize("pred, gold, expected", TABLE)
def test_equivalence_table(grader, pred, gold, expected):
    assert grader.grade(box(pred), gold, timeout_s=TIMEOUT) is expected


def test_grade_many_matches_table_and_gold_may_be_boxed(grader):
    pairs = [(box(p), g) for p, g, _ in TABLE] + [(box("\\frac{1}{2}"), "\\boxed{\\frac12}")]
    assert grader.grade_many(pairs, timeout_s=TIMEOUT) == [e for _, _, e in TABLE] + [True]


def test_unboxed_or_empty_box_is_wrong(grader):
    assert grader.grade("The answer is 42", "42") is False
    assert grader.grade("\\boxed{}", "42") is False
    assert grader.grade("\\boxed{42", "42") is False  # truncated box
    with Grader(require_boxed=False) as lenient:
        assert lenient.grade("so the final answer is 1/2.", "\\frac{1}{2}", timeout_s=TIMEOUT) is True


def test_malformed_inputs_never_raise(grader):
    junk = [None, 42, b"\\boxed{1}", "", "\x00", "🙂∑", "\ud800\\boxed{1}", "}{" * 50, "\\boxed"]
    out = grader.grade_many([(j, "1") for j in junk] + [("\\boxed{1}", None)], timeout_s=TIMEOUT)
    assert out == [False, False, False, False, False, False, True, False, False, False]


def test_adversarial_batch_is_wrong_and_bounded():
    adversarial = [
        box("9^{9^{9^{9}}}"),
        box("9^9^9^9"),
        box("10^{10^{10}}"),
        box("x^{x^{x^{x}}} = 9^{9^{9}}"),
        "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_001,  # 10,000-deep nesting
        "\\boxed{" + "{" * 1_500 + "1" + "}" * 1_501,  # deep nesting that fits the 4k window
        "\\boxed{" + "\\frac{" * 300 + "1" + "}{2}" * 300 + "}",
        "x" * 1_000_000,  # 1 MB
        "\\boxed{" + "1" * 1_000_000 + "}",
        "\\boxed{" + "1+" * 500_000 + "1}",
    ]
    start = time.monotonic()
    with Grader(workers=2) as g:
        out = g.grade_many([(a, "42") for a in adversarial], timeout_s=TIMEOUT)
        assert out == [False] * len(adversarial), g.stats
        # grading continues normally afterwards
        assert g.grade_many([(box("\\frac{84}{2}"), "42"), (box("41"), "42")], timeout_s=TIMEOUT) == [True, False]
    elapsed = time.monotonic() - start
    assert elapsed < STARTUP + TIMEOUT * (len(adversarial) + 2) * 2


FAKE_WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["pred"] == "hang":
            while True:  # ignores signals, like a C-level big-integer operation
                time.sleep(0.01)
        if req["pred"] == "crash":
            os._exit(3)
        print(json.dumps({"id": req["id"], "ok": req["pred"] == req["gold"] + "x"}), flush=True)
    """
)


def test_hung_and_crashing_workers_are_replaced(tmp_path, monkeypatch):
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER)
    monkeypatch.setattr(grader_mod, "_WORKER_PATH", str(worker))
    pairs = [
        ("\\boxed{hang}", "1"),
        ("\\boxed{1x}", "1"),
        ("\\boxed{crash}", "1"),
        ("\\boxed{hang}", "2"),
        ("\\boxed{2x}", "2"),
        ("\\boxed{3y}", "3"),
    ]
    start = time.monotonic()
    with Grader(workers=2) as g:
        out = g.grade_many(pairs, timeout_s=0.5)
        assert g.stats["timeouts"] == 2 and g.stats["crashes"] == 1
        assert g.grade_many([("\\boxed{5x}", "5"), ("\\boxed{hang}", "1")], timeout_s=0.5) == [True, False]
        assert g.stats["timeouts"] == 3  # a timeout is not cached: the answer is tried again
    assert out == [False, True, False, False, True, False]
    assert time.monotonic() - start < STARTUP


def test_worker_that_cannot_start_is_a_clear_error(tmp_path, monkeypatch):
    from masktrl.errors import MasktrlError

    worker = tmp_path / "broken_worker.py"
    worker.write_text('import json; print(json.dumps({"error": "ModuleNotFoundError: math_verify"}), flush=True)\n')
    monkeypatch.setattr(grader_mod, "_WORKER_PATH", str(worker))
    with Grader() as g, pytest.raises(MasktrlError, match="math_verify"):
        g.grade("\\boxed{x+1}", "1+x")


def test_fast_path_needs_no_workers():
    with Grader() as g:
        assert g.grade_many([("\\boxed{042}", "42"), ("\\boxed{7}", "42"), ("nothing", "1")]) == [True, False, False]
        assert g._workers == []


def test_last_boxed_extraction():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert last_boxed("\\boxed 42 apples") == "42"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("\\boxed{a}\\boxed{unbalanced") is None
    assert last_boxed("no box") is None and last_boxed("") is None and last_boxed(None) is None
    deep = "\\boxed{" + "{" * 1000 + "}" * 1000 + "}"
    assert last_boxed(deep) == "{" * 1000 + "}" * 1000
    assert last_boxed("\\boxed{1}" + "x" * 5000) is None  # outside the 4k window
    assert extract_answer(" \\boxed{ 12 } ") == "12"
    assert gold_answer("\\boxed{5}") == "5" and gold_answer(" 7 ") == "7"


def test_quick_verdict():
    assert quick_verdict("042", "42") is True
    assert quick_verdict("-0", "+0") is True
    assert quick_verdict("1{,}000", "1000") is True
    assert quick_verdict("9" * 10_000, "9" * 10_000 + "1") is False
    assert quick_verdict("\\dfrac{1}{2}", "\\frac{1}{2}") is True
    assert quick_verdict("0.5", "\\frac12") is None
    assert quick_verdict("", "1") is False


def test_grader_does_not_import_math_verify_in_parent():
    import subprocess  # checked in a fresh interpreter: other tests may import math_verify here

    code = (
        "import sys; from masktrl.tasks.grader import Grader; g = Grader(); "
        "print(g.grade_many([('\\\\boxed{2}', '2')])); print('math_verify' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.split()
    assert out == ["[True]", "False"]
