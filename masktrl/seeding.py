"""Named random streams: every random draw of a run comes from ``stream_seed(seed, purpose, ...)``."""

from __future__ import annotations

import random


def stream_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed for one named random stream (e.g. ("rollout", step, attempt)).

    Every random choice of a run is drawn from such a stream, so a resumed run draws
    exactly what an uninterrupted one would, without saving generator states.
    """
    return random.Random(repr((seed, *parts))).getrandbits(63)
