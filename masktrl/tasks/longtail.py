"""A long-response synthetic task: long prompts, ragged responses with a heavy-tailed length.

Prompt ``"<letters>|<L>="``: a run of random lowercase letters, then the target length ``L``;
the correct completion is the prompt's letters repeated from the start, cut to ``L - 1``
characters (the ``L``-th response token is EOS). Reward 1 iff the completion is exactly that.

The shapes are what matters (it is the workload of ``benchmarks/vs_trl.py --shape long``): the
prompt is ``prompt_min..prompt_max`` characters (uniform), the target ``L`` is log-normal
(median ``length_median``, log-scale spread ``length_sigma``) clipped to
``response_min..response_max``, so responses are tens to hundreds of tokens with a long tail,
as with reasoning models, and a padded micro-batch is mostly padding. With the character
tokenizer a character is a token.
"""

from __future__ import annotations

import hashlib
import math
import random

from masktrl.errors import ConfigError
from masktrl.tasks.base import Example, register_task
from masktrl.tasks.synthetic import SyntheticTask, int_option

LETTERS = "abcdefghijklmnopqrstuvwxyz"
ALPHABET = LETTERS + "0123456789|="


def target_length(prompt: str) -> int:
    """``L`` of a prompt ``"<letters>|<L>="``."""
    return int(prompt.rsplit("|", 1)[1].rstrip("="))


def expected_completion(prompt: str) -> str:
    letters = prompt.rsplit("|", 1)[0]
    n = target_length(prompt) - 1
    return (letters * (n // len(letters) + 1))[:n]


@register_task("longtail")
class LongTailTask(SyntheticTask):
    """``<letters>|<L>=`` -> the letters repeated to ``L - 1`` characters (then EOS).

    Args:
        prompt_min, prompt_max: prompt length in characters (tokens), uniform. Default 64..256.
        response_min, response_max: the target length's range (EOS included). Default 32..512.
        length_median, length_sigma: the log-normal target length before clipping. Default 128, 0.7.
        n_test: held-out prompts. seed: the held-out split's seed.
    """

    name = "longtail"

    def __init__(
        self,
        n_test: int = 64,
        prompt_min: int = 64,
        prompt_max: int = 256,
        response_min: int = 32,
        response_max: int = 512,
        length_median: float = 128.0,
        length_sigma: float = 0.7,
        seed: int = 1234,
    ):
        def opt(name, value, lo, hi):
            return int_option("longtail", name, value, lo, hi)

        self.prompt_min = opt("prompt_min", prompt_min, 8, 1 << 16)
        self.prompt_max = opt("prompt_max", prompt_max, self.prompt_min, 1 << 16)
        self.response_min = opt("response_min", response_min, 2, 1 << 16)
        self.response_max = opt("response_max", response_max, self.response_min, 1 << 16)
        if not (
            isinstance(length_median, (int, float))
            and length_median > 0
            and isinstance(length_sigma, (int, float))
            and length_sigma >= 0
        ):
            raise ConfigError(
                f"longtail: length_median must be > 0 and length_sigma >= 0, got {length_median!r}, {length_sigma!r}"
            )
        self.length_median, self.length_sigma = float(length_median), float(length_sigma)
        self.seed = seed
        self._draw_split(opt("n_test", n_test, 1, 1 << 20))

    def _draw(self, rng: random.Random) -> str:
        length = min(
            self.response_max,
            max(self.response_min, round(rng.lognormvariate(math.log(self.length_median), self.length_sigma))),
        )
        suffix = f"|{length}="
        n = max(1, rng.randint(self.prompt_min, self.prompt_max) - len(suffix))
        return "".join(rng.choice(LETTERS) for _ in range(n)) + suffix

    def _example_of(self, split: str, key: str, rng: random.Random) -> Example:
        return Example(f"{split}/{hashlib.sha1(key.encode()).hexdigest()[:12]}", key, expected_completion(key))

    def score(self, example: Example, completion: str) -> float:
        return float(isinstance(completion, str) and completion.strip() == example.answer)

    def score_many(self, examples: list[Example], completions: list[str]) -> list[float]:
        return [self.score(e, c) for e, c in zip(examples, completions)]

    def format_target(self, example: Example) -> str:
        return example.answer

    def alphabet(self) -> str:
        return ALPHABET
