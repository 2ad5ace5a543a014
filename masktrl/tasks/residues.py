"""The lab task: numbers in a range with a given residue, many correct answers per prompt.

Prompt ``"lo hi m r ="``; a correct completion is ``answers`` integers ``x`` (default 4), space
separated, each with ``lo <= x < hi`` and ``x % m == r`` (and pairwise different when
``distinct``). Every prompt has between ``min_solutions`` and ``max_solutions`` such integers,
so many completions are correct: the policy can stay spread over them, which keeps the
behaviour's probability mass outside its top-K list large (what the top-K estimators and SIS
need to be tested on). Reward 1 iff the whole completion is correct; with ``credit: partial``
the fraction of its numbers that are correct (configs/lab-credit.yaml: 200 numbers, each graded).

With ``scratch_max > 0`` a completion first holds a scratchpad: ``scratch_min`` to ``scratch_max``
integers (any integers: the reward reads only their count), then ``=``, then the answer. A
warm-start target's scratchpad is a uniform count of integers drawn uniformly from ``[lo, hi)``.
The shape of configs/lab-scratch.yaml: long responses whose many tokens are sampled from a wide
distribution the reward does not grade, before a short answer it does, as in a long chain of
thought, so the sequence log-ratio sums grow with length without compounding the answer's errors.
The lab's 1.0M-parameter model does not learn where to put ``=`` (docs/LAB.md). With
``scratch_index`` the target's scratchpad carries its own clock: pairs ``i v`` with ``i`` counting
down to 1 and ``v`` uniform in ``[lo, hi)``, so ``=`` follows the pair indexed 1 and no position
has to be counted (scoring is unchanged: the reward still reads only the scratchpad's length).
With ``scratch_values: solutions`` the target's scratchpad integers (the ``v`` of the pairs) are
drawn from the prompt's correct answers instead, so the scratchpad is a list of candidates the
answer can be copied from, as a chain of thought works towards its answer. With
``scratch_position: after`` the scratchpad follows the answer (``answer = scratchpad``): a
postscript the reward still requires (its length is read), so a response is as long, with the
answer where the lab's model learns it, right after the prompt.

Sampling: ``m`` uniform in ``moduli``, ``r`` uniform in ``[0, m)``, the width ``hi - lo``
uniform in ``[min_solutions * m, max_solutions * m]``, ``lo`` uniform with ``hi <= max_value``.
The held-out split is a fixed function of the options and ``seed``; training sampling rejects
every test prompt, so train and test never overlap. A training example's ``answer`` (the warm
start's target) is a fresh uniform draw from the correct answers; a test example's is one fixed
correct answer (scoring never uses it: any correct completion scores 1).
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from masktrl.errors import ConfigError
from masktrl.tasks.base import Example, register_task
from masktrl.tasks.synthetic import SyntheticTask, int_option

ALPHABET = "0123456789 ="
CREDITS = ("all", "partial")  # reward 1 iff every number is correct; or the fraction that are
SCRATCH_VALUES = ("range", "solutions")
SCRATCH_POSITIONS = (
    "before",
    "after",
)  # where the scratchpad is: before the answer, or after it  # what a warm-start scratchpad's integers are drawn from


def _int_option(name: str, value, lo: int, hi: int) -> int:
    return int_option("residues", name, value, lo, hi)


def parse_prompt(prompt: str) -> tuple[int, int, int, int]:
    """(lo, hi, m, r) of a prompt ``"lo hi m r ="``."""
    lo, hi, m, r = (int(w) for w in prompt.split()[:4])
    return lo, hi, m, r


def answer_after_scratch(completion: str, scratch_min: int, scratch_max: int, position: str = "before") -> str | None:
    """The answer part of a completion with a scratchpad: with the scratchpad ``before`` the answer,
    what follows the first ``=`` when the words before it are ``scratch_min`` to ``scratch_max``
    integers; ``after`` it, what precedes the first ``=`` when the words after it are. None when they
    are not (or there is no ``=``). Without a scratchpad (``scratch_max == 0``) the completion itself."""
    if not scratch_max:
        return completion
    head, sep, tail = completion.partition("=")
    answer, pad = (tail, head) if position == "before" else (head, tail)
    words = pad.split()
    if not sep or not scratch_min <= len(words) <= scratch_max:
        return None
    return answer if all(w.isdecimal() and w.isascii() for w in words) else None


def is_correct(
    lo: int,
    hi: int,
    m: int,
    r: int,
    completion: str,
    answers: int,
    distinct: bool,
    max_answers: int | None = None,
    ascending: bool = False,
    scratch: tuple[int, int] = (0, 0),
    scratch_position: str = "before",
) -> bool:
    """Whether ``completion`` is ``answers`` (to ``max_answers``, when given) whitespace-separated
    integers in [lo, hi), each = r mod m (pairwise different with ``distinct``, strictly
    increasing with ``ascending``), with a scratchpad of ``scratch`` = (min, max) integers and ``=``
    before it (``scratch_position`` ``before``) or after it (``after``) when max > 0."""
    answer = answer_after_scratch(completion, *scratch, scratch_position) if isinstance(completion, str) else None
    words = answer.split() if answer is not None else []
    if not answers <= len(words) <= (max_answers or answers) or not all(w.isdecimal() and w.isascii() for w in words):
        return False
    xs = [int(w) for w in words]
    if distinct and len(set(xs)) != len(xs):
        return False
    if ascending and any(a >= b for a, b in zip(xs, xs[1:])):
        return False
    return all(lo <= x < hi and x % m == r for x in xs)


def partial_credit(lo: int, hi: int, m: int, r: int, completion: str, answers: int) -> float:
    """The fraction of a completion's numbers that are correct, each graded on its own: the words
    among its first ``answers`` that are integers x with lo <= x < hi and x = r (mod m), over
    ``answers`` or over its word count when it has more (extra words count as wrong). A missing
    number (EOS before ``answers`` of them) counts as wrong; a completion that is not a string
    scores 0."""
    words = completion.split() if isinstance(completion, str) else []
    good = sum(w.isdecimal() and w.isascii() and lo <= int(w) < hi and int(w) % m == r for w in words[:answers])
    return good / max(answers, len(words))


@register_task("residues")
class ResidueTask(SyntheticTask):
    """``lo hi m r =`` -> ``answers`` integers x with lo <= x < hi and x = r (mod m).

    Args:
        answers: integers per completion. Default 4.
        distinct: the integers must be pairwise different. Default False.
        max_answers: with it, a completion may hold from ``answers`` to ``max_answers`` integers
            (a training target's count is uniform in that range). Default: exactly ``answers``.
        ascending: the integers must be strictly increasing (the long-response lab,
            configs/lab-long.yaml: each number is then a step above the previous one). Default False.
        max_value: every number is < max_value (the number tokenizer has 2,000). Default 2000.
        moduli: the moduli to draw ``m`` from (integers >= 2). Default 2..9.
        min_solutions, max_solutions: range of the number of correct integers per prompt.
            Default 11 and 100.
        scratch_min, scratch_max: with ``scratch_max > 0``, a completion is a scratchpad of
            ``scratch_min`` to ``scratch_max`` integers, ``=``, then the answer. Default 0 (none).
        scratch_index: the warm-start target's scratchpad is n pairs ``i v``, i = n, n - 1, ..., 1
            (2n integers in [scratch_min, scratch_max]), instead of uniform integers. Needs a
            scratchpad with room for an even count. Default False.
        scratch_values: what the warm-start target's scratchpad integers are drawn from: ``range``,
            uniform in ``[lo, hi)`` (the default), or ``solutions``, uniform over the prompt's correct
            answers. Scoring is the same either way.
        scratch_position: ``before`` the answer (``scratchpad = answer``, the default) or ``after`` it
            (``answer = scratchpad``).
        answer_weight: the warm start's loss weight of the answer's tokens, the scratchpad's and the
            rest weighing 1 (a weighted mean of the target tokens' cross-entropies): the 4 answer
            tokens among ~220 scratchpad tokens otherwise get ~2% of the loss. Default 1 (the plain
            mean). Other values need a scratchpad.
        credit: ``all`` (the default): reward 1 iff the whole completion is correct; ``partial``: the
            fraction of its ``answers`` numbers that are correct, each graded on its own
            (:func:`partial_credit`), so every token of a long answer carries signal
            (configs/lab-credit.yaml). The held-out accuracy is then the mean credit. ``partial``
            grades numbers one at a time, so it does not combine with ``distinct``, ``ascending``,
            ``max_answers`` or a scratchpad.
        n_test: size of the held-out split. Default 500.
        seed: seed of the held-out split (training samples come from the caller's rng).
    """

    name = "residues"

    def __init__(
        self,
        answers: int = 4,
        distinct: bool = False,
        max_answers: int | None = None,
        ascending: bool = False,
        max_value: int = 2000,
        moduli: Iterable[int] = tuple(range(2, 10)),
        min_solutions: int = 11,
        max_solutions: int = 100,
        scratch_min: int = 0,
        scratch_max: int = 0,
        scratch_index: bool = False,
        scratch_values: str = "range",
        scratch_position: str = "before",
        answer_weight: float = 1,
        credit: str = "all",
        n_test: int = 500,
        seed: int = 0,
    ) -> None:
        self.answers = _int_option("answers", answers, 1, 1000)
        if not isinstance(distinct, bool):
            raise ConfigError(f"residues: distinct must be true or false, got {distinct!r}")
        self.distinct = distinct
        self.max_answers = (
            self.answers if max_answers is None else _int_option("max_answers", max_answers, self.answers, 1000)
        )
        if not isinstance(ascending, bool):
            raise ConfigError(f"residues: ascending must be true or false, got {ascending!r}")
        self.ascending = ascending
        self.max_value = _int_option("max_value", max_value, 2, 10**9)
        self.moduli = tuple(sorted({_int_option("moduli", m, 2, self.max_value) for m in moduli}))
        if not self.moduli:
            raise ConfigError("residues: moduli must not be empty")
        lo_sol = max(self.max_answers if distinct or ascending else 1, 1)
        self.min_solutions = _int_option("min_solutions", min_solutions, lo_sol, self.max_value)
        self.max_solutions = _int_option("max_solutions", max_solutions, self.min_solutions, self.max_value)
        if self.max_solutions * max(self.moduli) > self.max_value:
            raise ConfigError(
                "residues: max_solutions * max(moduli) = "
                f"{self.max_solutions * max(self.moduli)} exceeds max_value {self.max_value}"
            )
        self.scratch_max = _int_option("scratch_max", scratch_max, 0, 1000)
        self.scratch_min = _int_option("scratch_min", scratch_min, 0, 1000)
        if self.scratch_min > self.scratch_max:
            raise ConfigError(
                f"residues: scratch_min={self.scratch_min} exceeds scratch_max={self.scratch_max} "
                "(a scratchpad needs scratch_max >= scratch_min)"
            )
        if not isinstance(scratch_index, bool):
            raise ConfigError(f"residues: scratch_index must be true or false, got {scratch_index!r}")
        self.scratch_index = scratch_index
        self._pairs = (-(-self.scratch_min // 2), self.scratch_max // 2)  # n with 2n in [min, max]
        if scratch_index and not 1 <= self._pairs[0] <= self._pairs[1]:
            raise ConfigError(
                f"residues: scratch_index needs an even scratchpad length >= 2 in [scratch_min, scratch_max] = "
                f"[{self.scratch_min}, {self.scratch_max}]"
            )
        self.scratch_values = self._scratch_choice("scratch_values", scratch_values, SCRATCH_VALUES)
        self.scratch_position = self._scratch_choice("scratch_position", scratch_position, SCRATCH_POSITIONS)
        if isinstance(answer_weight, bool) or not isinstance(answer_weight, int | float) or not 0 < answer_weight < 1e6:
            raise ConfigError(f"residues: answer_weight must be a number in (0, 1e6), got {answer_weight!r}")
        if answer_weight != 1 and not self.scratch_max:
            raise ConfigError(f"residues: answer_weight={answer_weight} needs a scratchpad (scratch_max > 0)")
        self.answer_weight = float(answer_weight)
        if credit not in CREDITS:
            raise ConfigError(f"residues: credit must be one of {', '.join(CREDITS)}, got {credit!r}")
        joint = [
            name
            for name, on in (
                ("distinct", distinct),
                ("ascending", ascending),
                ("max_answers", self.max_answers != self.answers),
                ("a scratchpad", bool(self.scratch_max)),
            )
            if on
        ]
        if credit == "partial" and joint:
            raise ConfigError(
                f"residues: credit=partial grades each number on its own; it does not combine with {', '.join(joint)}"
            )
        self.credit = credit
        self.n_test = _int_option("n_test", n_test, 1, 100_000)
        self.seed = _int_option("seed", seed, -(2**63), 2**63 - 1)
        self._draw_split(self.n_test)

    def _scratch_choice(self, name: str, value, choices: tuple[str, ...]) -> str:
        """``value`` if it is one of ``choices``; anything but the first (the default) needs a scratchpad."""
        if value not in choices:
            raise ConfigError(f"residues: {name} must be one of {', '.join(choices)}, got {value!r}")
        if value != choices[0] and not self.scratch_max:
            raise ConfigError(f"residues: {name}={value} needs a scratchpad (scratch_max > 0)")
        return value

    @property
    def partial_scores(self) -> bool:
        """Whether a score is a fraction of the numbers right (``credit: partial``), not 0/1: what
        rl/evaluation.py's ``scores_are_partial`` asks."""
        return self.credit == "partial"

    # ----------------------------------------------------------------- Task protocol (and SyntheticTask's)
    def score(self, example: Example, completion: str) -> float:
        if self.partial_scores:
            return partial_credit(*parse_prompt(example.prompt), completion, self.answers)
        return float(
            is_correct(
                *parse_prompt(example.prompt),
                completion,
                self.answers,
                self.distinct,
                self.max_answers,
                self.ascending,
                (self.scratch_min, self.scratch_max),
                self.scratch_position,
            )
        )

    def score_many(self, examples: list[Example], completions: list[str]) -> list[float]:
        return [self.score(e, c) for e, c in zip(examples, completions, strict=True)]

    def format_target(self, example: Example) -> str:
        return example.answer

    def weighted_target(self, example: Example) -> list[tuple[str, float]] | None:
        """The warm-start target as (text, loss weight) segments: the answer's words weigh
        ``answer_weight``, the scratchpad and ``=`` 1; None with ``answer_weight`` 1 (the plain mean)."""
        if self.answer_weight == 1:
            return None
        words = example.answer.split()
        sep = words.index("=")
        if self.scratch_position == "before":  # scratchpad = answer
            return [(" ".join(words[: sep + 1]) + " ", 1.0), (" ".join(words[sep + 1 :]), self.answer_weight)]
        return [(" ".join(words[:sep]), self.answer_weight), (" " + " ".join(words[sep:]), 1.0)]  # answer = scratchpad

    def alphabet(self) -> str:
        return ALPHABET

    # ----------------------------------------------------------------- helpers
    def solutions(self, lo: int, hi: int, m: int, r: int) -> range:
        """The integers x with lo <= x < hi and x = r (mod m), ascending."""
        first = lo + (r - lo) % m
        return range(first, hi, m)

    def _draw(self, rng: random.Random) -> tuple[int, int, int, int]:
        m = rng.choice(self.moduli)
        r = rng.randrange(m)
        width = rng.randint(self.min_solutions * m, self.max_solutions * m)
        lo = rng.randint(0, self.max_value - width)
        return lo, lo + width, m, r  # [lo, lo + width) holds between min and max solutions

    def _example_of(self, split: str, key: tuple[int, int, int, int], rng: random.Random) -> Example:
        lo, hi, m, r = key
        sols = self.solutions(lo, hi, m, r)
        count = self.answers if self.max_answers == self.answers else rng.randint(self.answers, self.max_answers)
        xs = rng.sample(sols, count) if self.distinct or self.ascending else [rng.choice(sols) for _ in range(count)]
        if self.ascending:
            xs.sort()
        answer = " ".join(map(str, xs))

        def value() -> int:  # one scratchpad integer
            return rng.choice(sols) if self.scratch_values == "solutions" else rng.randrange(lo, hi)

        if self.scratch_index:  # drawn after the answer, as below: n pairs "i v", i counting down to 1
            n = rng.randint(*self._pairs)
            pad = [w for i in range(n, 0, -1) for w in (i, value())]
        elif self.scratch_max:  # drawn after the answer: without a scratchpad the examples are as before
            pad = [value() for _ in range(rng.randint(self.scratch_min, self.scratch_max))]
        if self.scratch_max:
            parts = (
                [*map(str, pad), "=", answer] if self.scratch_position == "before" else [answer, "=", *map(str, pad)]
            )
            answer = " ".join(parts)
        return Example(id=f"{split}/{lo}-{hi}-{m}-{r}", prompt=f"{lo} {hi} {m} {r} =", answer=answer)
