"""Partial rollouts (``rollout.partial``): a weight sync that lands while a batch is being
generated, so each response's later tokens are sampled by a newer policy.

``PartialEngine`` wraps the run's engine for one batch: it samples the first ``at`` tokens of
every response from the older policy, syncs the engine to the newer one, and continues every
response still running (not ended by EOS) from its prompt and prefix, recomputed by the newer
policy: no KV cache of the older one is carried over, so each later token's log mu is exactly
the newer policy's on the prefix. Each token records the optimizer step of the policy that
sampled it (``Generation.version``); logp, the top-K lists and the kept sets are those of that
policy. The continuation draws from its own seeded stream, so the batch is a pure function of
the seed, the step and the two policies.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from masktrl.rollout.base import Generation, RolloutEngine, SamplingSettings
from masktrl.seeding import stream_seed


class PartialEngine:
    """``engine`` sampling from ``old`` (version ``versions[0]``) up to decode position ``at``,
    then from ``new`` (version ``versions[1]``); the engine is left synced to ``new``."""

    def __init__(
        self, engine: RolloutEngine, old: torch.nn.Module, new: torch.nn.Module, at: int, versions: tuple[int, int]
    ):
        self.engine, self.old, self.new, self.at, self.versions = engine, old, new, at, versions
        self.name = engine.name

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.engine.sync_weights(model)

    def generate(self, prompts: list[list[int]], settings: SamplingSettings, seed: int) -> list[list[Generation]]:
        at = min(self.at, settings.max_new_tokens)
        old_v, new_v = self.versions
        self.engine.sync_weights(self.old)
        try:
            gens = self.engine.generate(prompts, replace(settings, max_new_tokens=at), seed)
        finally:
            self.engine.sync_weights(self.new)  # the sync lands
        flat = [(p, g) for p, group in zip(prompts, gens) for g in group]
        for _, g in flat:
            g.version = [old_v] * len(g.response_ids)
        going = [i for i, (_, g) in enumerate(flat) if not g.finished and len(g.response_ids) == at]
        if going and at < settings.max_new_tokens:
            rest = self.engine.generate(
                [list(flat[i][0]) + list(flat[i][1].response_ids) for i in going],
                replace(settings, n=1, max_new_tokens=settings.max_new_tokens - at),
                stream_seed(seed, "partial"),
            )
            for i, (tail,) in zip(going, rest):
                extend(flat[i][1], tail, new_v)
        return gens


def extend(gen: Generation, tail: Generation, version: int) -> None:
    """``gen`` continued by ``tail`` (sampled by policy ``version`` on gen's prompt and response)."""
    gen.response_ids = list(gen.response_ids) + list(tail.response_ids)
    gen.logp = list(gen.logp) + list(tail.logp)
    gen.topk_ids = list(gen.topk_ids) + list(tail.topk_ids)
    gen.topk_logp = list(gen.topk_logp) + list(tail.topk_logp)
    gen.finished = tail.finished
    if gen.kept is not None and tail.kept is not None:
        gen.kept = list(gen.kept) + list(tail.kept)
    gen.version = list(gen.version or []) + [version] * len(tail.response_ids)
