"""The lab task: prompts, targets, the scorer and the held-out split."""

import random

import pytest

from masktrl.config import load_config
from masktrl.errors import ConfigError
from masktrl.tasks import Task, get_task, make_task
from masktrl.tasks.factory import HELDOUT_SEED
from masktrl.tasks.residues import ALPHABET, ResidueTask, is_correct, parse_prompt


def test_registered_and_follows_the_task_protocol():
    task = get_task("residues", n_test=10)
    assert isinstance(task, Task) and task.name == "residues"
    with pytest.raises(ConfigError, match="unknown option.*answerz"):
        get_task("residues", answerz=3)


@pytest.mark.parametrize("distinct", [False, True])
def test_every_prompt_has_11_to_100_solutions_and_every_target_is_correct(distinct):
    task = ResidueTask(distinct=distinct, n_test=200, seed=5)
    examples = task.train_examples(500, random.Random(0)) + task.test_examples()
    counts = []
    for ex in examples:
        lo, hi, m, r = parse_prompt(ex.prompt)
        assert ex.prompt == f"{lo} {hi} {m} {r} =" and 2 <= m <= 9 and 0 <= r < m and 0 <= lo < hi <= 2000
        sols = list(task.solutions(lo, hi, m, r))
        assert sols == [x for x in range(lo, hi) if x % m == r]
        counts.append(len(sols))
        xs = [int(w) for w in task.format_target(ex).split()]
        assert len(xs) == 4 and all(x in sols for x in xs)
        assert not distinct or len(set(xs)) == 4
        assert task.score(ex, task.format_target(ex)) == 1.0
    assert min(counts) >= 11 and max(counts) <= 100
    assert max(counts) - min(counts) > 60  # the range is used, not one size


def test_targets_are_fresh_draws_from_the_correct_set():
    task = ResidueTask(n_test=10)
    rng = random.Random(0)
    ex = task.train_examples(1, rng)[0]
    lo, hi, m, r = parse_prompt(ex.prompt)
    answers = {task._example_of("train", (lo, hi, m, r), rng).answer for _ in range(50)}
    assert len(answers) > 40  # many different correct completions of one prompt


@pytest.mark.parametrize(
    "completion, distinct, expected",
    [
        ("3 5 7 9", False, True),
        (" 3  5 7 9 ", False, True),  # whitespace is free
        ("3 3 3 3", False, True),
        ("3 3 3 3", True, False),  # repeats not allowed with distinct
        ("3 5 7", False, False),  # too few
        ("3 5 7 9 11", False, False),  # too many
        ("3 5 7 4", False, False),  # wrong residue
        ("1 3 5 7", False, False),  # below lo
        ("3 5 7 13", False, False),  # not below hi
        ("3 5 7 =", False, False),
        ("3 5 7 -9", False, False),
        ("3 5 7 ９", False, False),  # a non-ASCII digit
        ("", False, False),
    ],
)
def test_scorer(completion, distinct, expected):
    assert is_correct(3, 13, 2, 1, completion, 4, distinct) is expected


def test_score_never_raises_on_malformed_output():
    task = ResidueTask(n_test=10)
    ex = task.test_examples()[0]
    for bad in [None, 3, "<unk>", "1e3 1 1 1", "0x10 2 3 4"]:
        assert task.score(ex, bad) == 0.0
    assert task.score_many([ex, ex], [task.format_target(ex), "x"]) == [1.0, 0.0]


def test_held_out_split_is_fixed_and_disjoint_from_training():
    a, b = ResidueTask(n_test=300, seed=3), ResidueTask(n_test=300, seed=3)
    assert a.test_examples() == b.test_examples()
    assert ResidueTask(n_test=300, seed=4).test_examples() != a.test_examples()
    test_prompts = {e.prompt for e in a.test_examples()}
    assert len(test_prompts) == 300
    # A narrow space (m = 2, 11..12 solutions: a few thousand prompts) so that draws would
    # hit the test split often without rejection.
    narrow = ResidueTask(moduli=[2], min_solutions=11, max_solutions=12, n_test=500, seed=1)
    held = {e.prompt for e in narrow.test_examples()}
    train = {e.prompt for e in narrow.train_examples(5000, random.Random(0))}
    assert not held & train
    assert len(train) > 1000


def test_options_are_validated():
    with pytest.raises(ConfigError, match="answers"):
        ResidueTask(answers=0)
    with pytest.raises(ConfigError, match="distinct"):
        ResidueTask(distinct="yes")
    with pytest.raises(ConfigError, match="moduli"):
        ResidueTask(moduli=[1, 3])
    with pytest.raises(ConfigError, match="max_value"):
        ResidueTask(moduli=[9], max_solutions=300)  # 9 * 300 numbers do not fit below 2000
    with pytest.raises(ConfigError, match="min_solutions"):
        ResidueTask(distinct=True, answers=4, min_solutions=3)  # fewer solutions than answers


def test_config_builds_the_task_with_its_options_and_fixed_heldout_seed():
    cfg = load_config(
        None,
        [
            "task.name=residues",
            "task.n_test=20",
            "model.tokenizer=numbers",
            "task.options={answers: 3, distinct: true}",
        ],
    )
    task = make_task(cfg.task, cfg.model)
    assert task.answers == 3 and task.distinct and len(task.test_examples()) == 20
    assert task.seed == HELDOUT_SEED
    assert set(ALPHABET) >= set(task.test_examples()[0].prompt + task.format_target(task.test_examples()[0]))
    with pytest.raises(ConfigError, match="tokenizer=numbers cannot encode task 'arithmetic'"):
        load_config(None, ["model.tokenizer=numbers"])
    with pytest.raises(ConfigError, match="embedding_init=numbers needs model.tokenizer=numbers"):
        load_config(None, ["model.embedding_init=numbers"])
    for options in ("{seed: 3}", "{n_test: 3}"):  # the held-out split is task.n_test problems of a fixed seed
        with pytest.raises(ConfigError, match="held-out split"):
            make_task(load_config(None, ["task.name=residues", f"task.options={options}"]).task, cfg.model)
    with pytest.raises(ConfigError, match="task.options"):
        make_task(load_config(None, ["task.options={answers: 3}"]).task, cfg.model)  # arithmetic has task.* keys


def test_count_range_and_ascending_order():
    lo, hi, m, r = 2, 30, 2, 1  # odd numbers in [2, 30)
    ok = lambda c: is_correct(lo, hi, m, r, c, 3, True, max_answers=5, ascending=True)  # noqa: E731
    assert ok("3 5 7") and ok("3 5 7 9 11")
    assert not ok("3 5") and not ok("3 5 7 9 11 13")  # fewer than answers, more than max_answers
    assert not ok("3 7 5") and not ok("3 3 5")  # not strictly increasing
    assert is_correct(lo, hi, m, r, "7 5 3", 3, True)  # the default: any order, exactly answers
    assert not is_correct(lo, hi, m, r, "3 5 7 9", 3, True)


def test_long_targets_are_correct_ascending_and_use_the_count_range():
    task = ResidueTask(
        answers=47,
        max_answers=63,
        ascending=True,
        distinct=True,
        min_solutions=64,
        max_solutions=200,
        n_test=20,
        seed=1,
    )
    lengths = set()
    for ex in task.train_examples(200, random.Random(0)) + task.test_examples():
        xs = [int(w) for w in task.format_target(ex).split()]
        assert xs == sorted(set(xs)) and 47 <= len(xs) <= 63
        assert task.score(ex, task.format_target(ex)) == 1.0
        lengths.add(len(xs))
    assert len(lengths) > 10
    with pytest.raises(ConfigError, match="max_answers"):
        ResidueTask(answers=5, max_answers=4)
    with pytest.raises(ConfigError, match="ascending"):
        ResidueTask(ascending="yes")
    with pytest.raises(ConfigError, match="min_solutions"):
        ResidueTask(answers=47, max_answers=63, ascending=True, min_solutions=50)  # fewer solutions than a target needs


def test_200_number_targets_configs_lab_long200():
    """configs/lab-long200.yaml: 200 to 240 ascending numbers out of exactly 240 per prompt."""
    task = ResidueTask(
        answers=200,
        max_answers=240,
        ascending=True,
        distinct=True,
        moduli=range(2, 9),
        min_solutions=240,
        max_solutions=240,
        n_test=20,
        seed=1,
    )
    for ex in task.train_examples(50, random.Random(0)) + task.test_examples():
        lo, hi, m, r = (int(w) for w in ex.prompt.split()[:4])
        assert len(task.solutions(lo, hi, m, r)) == 240 and hi <= 2000
        xs = [int(w) for w in task.format_target(ex).split()]
        assert xs == sorted(set(xs)) and 200 <= len(xs) <= 240
        assert task.score(ex, task.format_target(ex)) == 1.0
    with pytest.raises(ConfigError, match="answers"):
        ResidueTask(answers=1001)


def test_default_targets_unchanged_by_the_new_options():
    a = ResidueTask(distinct=True, n_test=10).train_examples(20, random.Random(3))
    b = ResidueTask(distinct=True, n_test=10, max_answers=4, ascending=False).train_examples(20, random.Random(3))
    assert [e.answer for e in a] == [e.answer for e in b]


def test_scratchpad_targets_configs_lab_scratch():
    """configs/lab-scratch.yaml: 200 to 240 integers from [lo, hi), "=", then the lab's answer."""
    cfg = load_config(["configs/lab.yaml", "configs/lab-scratch.yaml"])
    task = make_task(cfg.task, cfg.model)
    assert (task.scratch_min, task.scratch_max, task.answers, task.distinct) == (200, 240, 4, True)
    counts = set()
    for ex in task.train_examples(60, random.Random(0)) + task.test_examples()[:20]:
        lo, hi, m, r = parse_prompt(ex.prompt)
        head, sep, tail = task.format_target(ex).partition(" = ")
        pad, xs = [int(w) for w in head.split()], [int(w) for w in tail.split()]
        assert sep and 200 <= len(pad) <= 240 and all(lo <= x < hi for x in pad)
        assert len(xs) == 4 == len(set(xs)) and all(lo <= x < hi and x % m == r for x in xs)
        assert task.score(ex, task.format_target(ex)) == 1.0
        counts.add(len(pad))
    assert min(counts) < 210 and max(counts) > 230  # the count is drawn over the whole range
    # the longest response fits max_new_tokens: 240 integers, "=", 4 numbers and EOS
    assert cfg.rollout.max_new_tokens == 240 + 1 + 4 + 1


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("5 " * 3 + "= 11 14 17 20", True),  # scratch words are not graded: any integers
        ("1999 0 7 = 11 14 17 20", True),
        ("5 5 = 11 14 17 20", False),  # 2 < scratch_min
        ("5 " * 5 + "= 11 14 17 20", False),  # 5 > scratch_max
        ("11 14 17 20", False),  # no "="
        ("5 5 5 11 14 17 20", False),
        ("5 x 5 = 11 14 17 20", False),  # a scratch word that is not an integer
        ("5 5 5 = 11 14 17 21", False),  # the answer is still graded
        ("5 5 5 = 11 14 17 20 = 1", False),
        ("5 5 5 = 11 14 17", False),
    ],
)
def test_scratchpad_scoring(completion, expected):
    """lo 10, hi 30, m 3, r 2: an answer is 4 distinct x = 2 (mod 3) in [10, 30) after 3 or 4 integers."""
    assert is_correct(10, 30, 3, 2, completion, 4, True, scratch=(3, 4)) is expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("11 14 17 20 = 5 5 5", True),
        ("11 14 17 20 = 1999 0 7 8", True),
        ("11 14 17 20 = 5 5", False),  # 2 < scratch_min
        ("11 14 17 20 = " + "5 " * 5, False),  # 5 > scratch_max
        ("11 14 17 20", False),  # no "="
        ("11 14 17 20 = 5 x 5", False),  # a scratch word that is not an integer
        ("11 14 17 21 = 5 5 5", False),  # the answer is still graded
        ("11 14 17 20 = 5 5 = 5", False),
        ("5 5 5 = 11 14 17 20", False),  # the other order
    ],
)
def test_a_scratchpad_after_the_answer_is_scored_by_its_length(completion, expected):
    """scratch_position=after: 4 distinct x = 2 (mod 3) in [10, 30), then "=" and 3 or 4 integers."""
    assert is_correct(10, 30, 3, 2, completion, 4, True, scratch=(3, 4), scratch_position="after") is expected


def test_a_scratchpad_after_the_answer_makes_targets_that_score_one():
    task = ResidueTask(
        distinct=True, n_test=10, scratch_min=200, scratch_max=240, scratch_index=True, scratch_position="after"
    )
    before = ResidueTask(distinct=True, n_test=10, scratch_min=200, scratch_max=240, scratch_index=True)
    a, b = task.train_examples(30, random.Random(4)), before.train_examples(30, random.Random(4))
    for x, y in zip(a, b, strict=True):
        answer, sep, pad = x.answer.partition(" = ")
        assert sep and task.score(x, x.answer) == 1.0 and before.score(x, x.answer) == 0.0
        assert y.answer == f"{pad} = {answer}"  # the same draws, in the other order
        assert [int(w) for w in pad.split()][0::2][-1] == 1


def test_scratchpad_options_are_validated_and_off_by_default():
    with pytest.raises(ConfigError, match="scratch_max"):
        ResidueTask(scratch_max=1001)
    with pytest.raises(ConfigError, match="scratch_min"):
        ResidueTask(scratch_min=5, scratch_max=4)
    a = ResidueTask(distinct=True, n_test=10).train_examples(20, random.Random(3))
    b = ResidueTask(distinct=True, n_test=10, scratch_min=0, scratch_max=0).train_examples(20, random.Random(3))
    assert [e.answer for e in a] == [e.answer for e in b]
    assert ResidueTask(distinct=True, n_test=10).score(a[0], "1 = " + a[0].answer) == 0.0


def test_an_indexed_scratchpad_counts_down_to_the_answer():
    """scratch_index: the target's scratchpad is n pairs "i v", i = n .. 1, v in [lo, hi), 2n in
    [scratch_min, scratch_max]; scoring is unchanged (only the scratchpad's length is read)."""
    task = ResidueTask(distinct=True, n_test=10, scratch_min=199, scratch_max=240, scratch_index=True)
    lengths = set()
    for ex in task.train_examples(80, random.Random(1)):
        lo, hi, m, r = parse_prompt(ex.prompt)
        head, sep, tail = task.format_target(ex).partition(" = ")
        pad = [int(w) for w in head.split()]
        n = len(pad) // 2
        assert sep and len(pad) == 2 * n and 100 <= n <= 120  # 2n in [199, 240]: n in [100, 120]
        assert pad[0::2] == list(range(n, 0, -1)) and all(lo <= v < hi for v in pad[1::2])
        assert task.score(ex, task.format_target(ex)) == 1.0
        lengths.add(n)
    assert min(lengths) < 105 and max(lengths) > 115
    # off, the targets are the uniform scratchpad's, draw for draw
    a = ResidueTask(distinct=True, n_test=10, scratch_min=4, scratch_max=6).train_examples(20, random.Random(3))
    b = ResidueTask(distinct=True, n_test=10, scratch_min=4, scratch_max=6, scratch_index=False).train_examples(
        20, random.Random(3)
    )
    assert [e.answer for e in a] == [e.answer for e in b]


def test_a_scratchpad_of_candidates_lists_correct_answers():
    """scratch_values=solutions: every scratchpad integer (each pair's v) is a correct answer of the
    prompt, so the answer can be copied from it; the default draws from [lo, hi), draw for draw as before."""
    task = ResidueTask(
        distinct=True, n_test=10, scratch_min=200, scratch_max=240, scratch_index=True, scratch_values="solutions"
    )
    seen_outside = False
    for ex in task.train_examples(40, random.Random(2)):
        lo, hi, m, r = parse_prompt(ex.prompt)
        head, sep, _ = ex.answer.partition(" = ")
        values = [int(w) for w in head.split()][1::2]
        assert sep and values and all(lo <= v < hi and v % m == r for v in values)
        assert task.score(ex, ex.answer) == 1.0
    for scratch_index in (False, True):
        a = ResidueTask(distinct=True, n_test=10, scratch_min=4, scratch_max=6, scratch_index=scratch_index)
        b = ResidueTask(
            distinct=True, n_test=10, scratch_min=4, scratch_max=6, scratch_index=scratch_index, scratch_values="range"
        )
        xa, xb = a.train_examples(30, random.Random(5)), b.train_examples(30, random.Random(5))
        assert [e.answer for e in xa] == [e.answer for e in xb]
        for ex in xa:  # the range's draws include non-solutions (what "solutions" changes)
            lo, hi, m, r = parse_prompt(ex.prompt)
            values = [int(w) for w in ex.answer.partition(" = ")[0].split()][scratch_index :: 1 + scratch_index]
            seen_outside |= any(v % m != r for v in values)
    assert seen_outside


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"scratch_index": True}, "even scratchpad length"),  # no scratchpad
        ({"scratch_index": True, "scratch_min": 3, "scratch_max": 3}, "even scratchpad length"),
        ({"scratch_index": "yes", "scratch_max": 4}, "true or false"),
        ({"scratch_values": "solutions"}, "needs a scratchpad"),
        ({"scratch_position": "after"}, "needs a scratchpad"),
        ({"scratch_position": "middle", "scratch_max": 4}, "must be one of before, after"),
        ({"scratch_values": "primes", "scratch_max": 4}, "must be one of range, solutions"),
        ({"answer_weight": 50}, "needs a scratchpad"),
        ({"answer_weight": 0, "scratch_max": 4}, "answer_weight must be a number"),
        ({"answer_weight": True, "scratch_max": 4}, "answer_weight must be a number"),
        ({"answer_weight": "50", "scratch_max": 4}, "answer_weight must be a number"),
        ({"answer_weight": float("nan"), "scratch_max": 4}, "answer_weight must be a number"),
    ],
)
def test_an_indexed_scratchpad_needs_room_for_pairs(options, match):
    with pytest.raises(ConfigError, match=match):
        ResidueTask(**options)


@pytest.mark.parametrize("position", ["before", "after"])
@pytest.mark.parametrize("tokenizer", ["numbers", "char"])
def test_answer_weight_weighs_the_answer_tokens_of_the_unchanged_target(position, tokenizer):
    """answer_weight: the warm start's target is the same tokens (the segments tokenise to the
    whole target), its answer's tokens weigh answer_weight, everything else 1 (EOS included)."""
    from masktrl.models.tiny import tiny_tokenizer
    from masktrl.rl.warmstart import _sft_batch

    options = dict(distinct=True, n_test=10, scratch_min=20, scratch_max=24, scratch_index=True)
    task = ResidueTask(**options, scratch_position=position, answer_weight=50)
    plain = ResidueTask(**options, scratch_position=position)
    tok = tiny_tokenizer(tokenizer, task.alphabet())
    examples = task.train_examples(6, random.Random(2))
    assert [e.answer for e in examples] == [e.answer for e in plain.train_examples(6, random.Random(2))]
    ids, attention, labels, weights = _sft_batch(tok, task, examples)
    ids0, attention0, labels0, weights0 = _sft_batch(tok, plain, examples)
    assert weights0 is None and plain.weighted_target(examples[0]) is None
    assert ids.equal(ids0) and attention.equal(attention0) and labels.equal(labels0)
    for ex, row, w, mask in zip(examples, ids, weights, attention, strict=True):
        answer = ex.answer.split(" = ")[0 if position == "after" else 1]
        answer_ids = tok(answer, add_special_tokens=False)["input_ids"]
        heavy = [int(i) for i, x in zip(row, w, strict=True) if x == 50]
        assert heavy == answer_ids
        assert ((w == 1) | (w == 50) | (w == 0)).all() and (w[mask == 0] == 0).all()


def _credit_by_hand(lo, hi, m, r, completion, answers):
    """An independent transcription of credit=partial: count the correct numbers among the first
    ``answers`` words, over the larger of ``answers`` and the word count."""
    words = completion.split()
    good = 0
    for w in words[:answers]:
        try:
            x = int(w)
        except ValueError:
            continue
        good += w == str(x) and lo <= x < hi and (x - r) % m == 0
    return good / max(answers, len(words))


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("10 13 16 19", 1.0),  # lo=10 hi=20 m=3 r=1: 10, 13, 16, 19 all correct
        ("10 10 10 10", 1.0),  # repeats are allowed (no distinct)
        ("10 11 16 19", 0.75),
        ("11 12 14 20", 0.0),  # 20 is out of range
        ("10 13", 0.5),  # EOS after 2 of 4: the missing ones count as wrong
        ("10 13 16 19 10 13", 4 / 6),  # extra words count as wrong
        ("10 x 16 +19", 0.5),
        ("", 0.0),
        ("١٠ 13 16 19", 0.75),  # non-ASCII digits are not numbers
    ],
)
def test_partial_credit_grades_each_number(completion, expected):
    task = ResidueTask(answers=4, credit="partial", n_test=5)
    ex = task.test_examples()[0]
    ex = type(ex)(id="x", prompt="10 20 3 1 =", answer="10")
    assert task.score(ex, completion) == pytest.approx(expected)
    assert _credit_by_hand(10, 20, 3, 1, completion, 4) == pytest.approx(expected)


def test_partial_credit_matches_the_transcription_on_sampled_completions():
    task = ResidueTask(answers=12, credit="partial", n_test=30, seed=4)
    rng = random.Random(0)
    for ex in task.test_examples():
        lo, hi, m, r = parse_prompt(ex.prompt)
        for _ in range(20):
            words = [str(rng.randrange(max(0, lo - 20), hi + 20)) for _ in range(rng.randint(0, 15))]
            completion = " ".join(words)
            assert task.score(ex, completion) == pytest.approx(_credit_by_hand(lo, hi, m, r, completion, 12))
    assert task.score(task.test_examples()[0], None) == 0.0  # a malformed completion scores 0, never raises


def test_credit_partial_preset_configs_lab_credit():
    """configs/lab-credit.yaml: 200 numbers (repeats allowed), each graded; targets score 1."""
    cfg = load_config(["configs/lab.yaml", "configs/lab-credit.yaml"])
    task = make_task(cfg.task, cfg.model)
    assert task.partial_scores and task.answers == 200 and not task.distinct
    assert cfg.rollout.max_new_tokens == 201
    for ex in task.train_examples(30, random.Random(1)):
        xs = ex.answer.split()
        assert len(xs) == 200 and task.score(ex, ex.answer) == 1.0
        assert task.score(ex, " ".join(xs[:150])) == 0.75


def test_credit_option_is_validated_and_all_by_default():
    assert not ResidueTask(n_test=5).partial_scores
    a = ResidueTask(n_test=10).train_examples(20, random.Random(3))
    b = ResidueTask(n_test=10, credit="partial").train_examples(20, random.Random(3))
    assert [e.answer for e in a] == [e.answer for e in b]  # the targets do not depend on the credit
    with pytest.raises(ConfigError, match="credit must be one of all, partial"):
        ResidueTask(credit="some")
    for options, name in (
        ({"distinct": True}, "distinct"),
        ({"ascending": True}, "ascending"),
        ({"max_answers": 6}, "max_answers"),
        ({"scratch_min": 2, "scratch_max": 4}, "a scratchpad"),
    ):
        with pytest.raises(ConfigError, match=f"does not combine with {name}"):
            ResidueTask(credit="partial", **options)
