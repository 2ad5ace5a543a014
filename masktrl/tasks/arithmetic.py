"""Synthetic verifiable arithmetic: ``123+456=`` -> ``579`` (or ``\\boxed{579}``).

Operands are uniform in ``[0, 10**digits)``; the operator is uniform over ``ops``.
Subtraction may go negative (``12-345=`` -> ``-333``). The held-out test split is a fixed
function of ``(ops, digits, n_test, seed)`` and training sampling rejects every test
problem, so train and test never overlap.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from masktrl.errors import ConfigError
from masktrl.tasks.base import Example, register_task
from masktrl.tasks.rewards import boxed_match, exact_match
from masktrl.tasks.synthetic import SyntheticTask, int_option

OPS = ("+", "-", "*")
ANSWER_FORMATS = ("plain", "boxed")
ALPHABET_PLAIN = "0123456789+-*="
ALPHABET_BOXED = ALPHABET_PLAIN + "\\boxed{}"


def alphabet(answer_format: str = "plain") -> str:
    """Every character prompts and targets of this task can contain (no duplicates).

    The same for every ``ops``/``digits``, so one character tokenizer serves all configs.
    """
    return ALPHABET_BOXED if answer_format == "boxed" else ALPHABET_PLAIN


def _parse_ops(ops: str | Iterable[str]) -> tuple[str, ...]:
    items = [c for c in ops if c not in ", "] if isinstance(ops, str) else list(ops)
    bad = [o for o in items if o not in OPS]
    if bad or not items:
        raise ConfigError(f"arithmetic: ops must be a non-empty subset of {''.join(OPS)!r}, got {ops!r}")
    return tuple(o for o in OPS if o in items)  # canonical order: the split ignores how ops were listed


def _int_option(name: str, value, lo: int, hi: int) -> int:
    return int_option("arithmetic", name, value, lo, hi)


@register_task("arithmetic")
class ArithmeticTask(SyntheticTask):
    """Arithmetic problems with exact-match scoring.

    Args:
        ops: operators to draw from, a subset of ``"+-*"`` (string or list). Default ``"+"``.
        digits: operands are uniform in ``[0, 10**digits)``. Default 3.
        answer_format: ``"plain"`` (completion ``579``, scored by ``completion.strip() == answer``)
            or ``"boxed"`` (completion ``\\boxed{579}``, scored on the last box's content): the
            registered rewards ``exact-match`` and ``boxed-match``.
        n_test: size of the held-out test split. Default 500.
        seed: seed of the test split (training samples come from the caller's rng).
    """

    name = "arithmetic"

    def __init__(
        self,
        ops: str | Iterable[str] = "+",
        digits: int = 3,
        answer_format: str = "plain",
        n_test: int = 500,
        seed: int = 0,
    ) -> None:
        self.ops = _parse_ops(ops)
        self.digits = _int_option("digits", digits, 1, 9)
        if answer_format not in ANSWER_FORMATS:
            raise ConfigError(
                f"arithmetic: answer_format must be one of {', '.join(ANSWER_FORMATS)}, got {answer_format!r}"
            )
        self.answer_format = answer_format
        n_problems = len(self.ops) * 10 ** (2 * self.digits)
        self.n_test = _int_option("n_test", n_test, 1, n_problems // 2)
        self.seed = _int_option("seed", seed, -(2**63), 2**63 - 1)
        self._draw_split(self.n_test)

    # ----------------------------------------------------------------- Task protocol (and SyntheticTask's)
    def score(self, example: Example, completion: str) -> float:
        return self.score_many([example], [completion])[0]

    def score_many(self, examples: list[Example], completions: list[str]) -> list[float]:
        """The registered rewards ``exact-match`` (plain) or ``boxed-match`` (boxed)."""
        reward = exact_match if self.answer_format == "plain" else boxed_match
        return reward(completions=completions, answers=[e.answer for e in examples])

    def format_target(self, example: Example) -> str:
        return example.answer if self.answer_format == "plain" else f"\\boxed{{{example.answer}}}"

    def alphabet(self) -> str:
        return alphabet(self.answer_format)

    # ----------------------------------------------------------------- helpers
    def _draw(self, rng: random.Random) -> tuple[int, str, int]:
        op = rng.choice(self.ops)
        hi = 10**self.digits
        return rng.randrange(hi), op, rng.randrange(hi)

    def _example_of(self, split: str, key: tuple[int, str, int], rng: random.Random) -> Example:
        return self._example(split, *key)

    @staticmethod
    def _example(split: str, a: int, op: str, b: int) -> Example:
        value = a + b if op == "+" else a - b if op == "-" else a * b
        expr = f"{a}{op}{b}"
        return Example(id=f"{split}/{expr}", prompt=f"{expr}=", answer=str(value))
