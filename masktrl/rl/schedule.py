"""The learning-rate schedule: a linear warm-up, then constant, linear or cosine decay.

``lr_factor`` gives the multiplier of ``train.lr`` for optimizer update ``u`` (0-based; the
scheduler steps once per optimizer update, so a run makes ``train.steps x train.minibatches``
of them). ``constant``: ``min(1, (u + 1) / warmup)``, then 1 (the warm start uses it too).
After the warm-up, ``linear`` and ``cosine`` decay from 1 at update ``warmup`` towards
``min_ratio`` at update ``total`` (one past the last update, as in transformers'
``get_linear_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup`` with a floor).
"""

from __future__ import annotations

import math
from typing import Callable

import torch


def lr_factor(schedule: str, warmup: int, total: int, min_ratio: float = 0.0) -> Callable[[int], float]:
    """The multiplier of the base learning rate at optimizer update ``u``.

    ``warmup``: warm-up updates (0: none). ``total``: updates in the run (decay schedules only)."""
    if schedule == "constant":
        return lambda u: min(1.0, (u + 1) / warmup) if warmup else 1.0
    if schedule not in ("linear", "cosine"):
        raise ValueError(f"unknown learning-rate schedule {schedule!r}")
    span = max(1, total - warmup)

    def factor(u: int) -> float:
        if u < warmup:
            return (u + 1) / warmup
        progress = min(1.0, (u - warmup) / span)
        decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_ratio + (1.0 - min_ratio) * decay

    return factor


def make_scheduler(optimizer, train_cfg, total_updates: int):
    """``LambdaLR`` over ``optimizer`` for ``train_cfg`` (warmup_steps, lr_schedule, min_lr_ratio),
    stepped once per optimizer update; ``total_updates``: the run's number of updates."""
    t = train_cfg
    warmup = t.warmup_steps * t.minibatches
    fn = lr_factor(t.lr_schedule, warmup, total_updates, t.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
