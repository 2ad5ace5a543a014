"""Partial rollouts in the training loop (``rollout.partial``; docs/ROLLOUTS.md, "Partial rollouts").

During step S the batches sampled ahead (``rl/schedule.py``: ``sample_now``) start with the
policy after step S-1. A batch the weight sync lands in (``partial_at``) is generated once step
S's update is done, by ``rollout/partial.py``'s ``PartialEngine`` from a copy of the policy taken
before the update (``snapshot``) up to the drawn decode position, and by the updated policy
after it: what an asynchronous trainer produces when the sync after step S arrives while the
batch is being generated. Every other batch of a run with rollout.partial records one version
per token too (``stamp_versions``). Without rollout.partial nothing here runs and no version is
recorded.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from masktrl.rl.schedule import partial_at, sample_now, sampled_at
from masktrl.rollout.base import Sample
from masktrl.runs.store import rollout_key

if TYPE_CHECKING:
    from masktrl.rl.run_state import State


def due_batches(s: State, step: int) -> list[tuple[int, int | None]]:
    """(step t, decode position of the sync or None) of every batch to sample during ``step``:
    those of ``sample_now`` neither held nor stored (by the run before a resume); none under
    ``--rollouts-from`` (the batches are used as stored)."""
    if s.run.source:
        return []
    r, seed = s.cfg.rollout, s.cfg.seed
    ahead = [
        t
        for t in sample_now(r.staleness, seed, step, s.count.steps)
        if t not in s.count.ahead and not s.store.is_done(rollout_key(t))
    ]
    return [(t, partial_at(r.partial, seed, t, r.max_new_tokens)) for t in ahead]


def snapshot(s: State, step: int) -> torch.nn.Module | None:
    """A copy of the policy after step ``step`` - 1 (taken before step ``step``'s update) when a
    weight sync lands in a batch sampled during ``step``; None otherwise (and always without
    rollout.partial)."""
    if s.cfg.rollout.partial is None or not any(at is not None for _, at in due_batches(s, step)):
        return None
    old = copy.deepcopy(s.parts.model)
    for param in old.parameters():
        param.grad = None
        param.requires_grad_(False)
    return old


def stamp_versions(s: State, samples: list[Sample], step: int) -> None:
    """rollout.partial: every token of step ``step``'s batch not stamped by ``PartialEngine``
    carries the version of the policy that sampled the batch (sigma(t) - 1, ``rl/schedule.py``)."""
    if s.cfg.rollout.partial is None:
        return
    version = sampled_at(s.cfg.rollout.staleness, s.cfg.seed, step) - 1
    for x in samples:
        if x.gen.version is None:
            x.gen.version = [version] * len(x.gen.response_ids)
