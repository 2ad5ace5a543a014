"""What the synthetic tasks (arithmetic, residues) share: a held-out split drawn once from a
seeded generator, training draws that reject every held-out problem, and option checks.

A subclass sets ``name`` and ``seed`` and defines ``_draw(rng) -> key`` (a hashable problem)
and ``_example_of(split, key, rng) -> Example``, then calls ``_draw_split(n_test)``.
"""

from __future__ import annotations

import random

from masktrl.errors import ConfigError
from masktrl.tasks.base import Example


def int_option(task: str, name: str, value, lo: int, hi: int) -> int:
    """``value`` if it is an integer in [lo, hi], else a ConfigError naming the task's option."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{task}: {name} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


class SyntheticTask:
    """Base of a synthetic task: the Task protocol's split handling and no resources to close."""

    name: str
    seed: int

    def _draw(self, rng: random.Random):
        raise NotImplementedError

    def _example_of(self, split: str, key, rng: random.Random) -> Example:
        raise NotImplementedError

    def _draw_split(self, n_test: int) -> None:
        """The held-out split: ``n_test`` distinct problems, a fixed function of the options and ``seed``."""
        rng = random.Random(f"masktrl.{self.name}.test:{self.seed}")
        test: dict = {}  # insertion-ordered set
        while len(test) < n_test:
            test.setdefault(self._draw(rng))
        self._test_keys = frozenset(test)
        self._test = [self._example_of("test", key, rng) for key in test]

    def train_examples(self, n: int, rng: random.Random) -> list[Example]:
        """``n`` fresh i.i.d. problems from ``rng``, never one of the test split."""
        out: list[Example] = []
        while len(out) < n:
            key = self._draw(rng)
            if key not in self._test_keys:
                out.append(self._example_of("train", key, rng))
        return out

    def test_examples(self) -> list[Example]:
        return list(self._test)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
