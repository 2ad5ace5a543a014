"""The reference policy of the reference-KL term (docs/METHODS.md §13): the log-probabilities
pi_ref assigns to each sampled response token.

``Reference`` is the hook the update calls: any callable ``(samples, share=None) -> Tensor [N]``
(log pi_ref of the samples' response tokens, in order, without gradient). ``FrozenReference``
is the one masktrl builds: a frozen copy of the starting policy, taken before a resumed run
loads its checkpoint, so the reference stays the run's starting point. A policy trained through
adapters can pass its own hook instead (the same model with its adapters switched off), with
no second copy of the weights.
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch

from masktrl.rl.policy import policy_token_batch
from masktrl.rollout.base import Sample


class Reference(Protocol):
    def __call__(self, samples: list[Sample], share: bool | None = None) -> torch.Tensor:
        """[N] log pi_ref at the response tokens of ``samples`` (in order), no gradient.
        ``share``: the prompt-sharing choice of the policy forward it accompanies."""
        ...


class FrozenReference:
    """A frozen copy of ``model`` (eval mode, no gradients): the policy's training forward run on
    it, at the policy's temperature and log-prob chunk. It holds a second copy of the weights."""

    def __init__(self, model: torch.nn.Module, temperature: float, chunk: int):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.temperature, self.chunk = temperature, chunk

    @torch.no_grad()
    def __call__(self, samples: list[Sample], share: bool | None = None) -> torch.Tensor:
        out = policy_token_batch(self.model, samples, self.temperature, self.chunk, share=share)
        return out.batch.logp.detach()


def reference_logprobs(reference: Reference, samples: list[Sample], batch_size: int) -> list[torch.Tensor]:
    """Per sample, [len(response)] log pi_ref, computed ``batch_size`` samples at a time."""
    out: list[torch.Tensor] = []
    for start in range(0, len(samples), max(batch_size, 1)):
        part = samples[start:start + batch_size]
        lp = reference(part)
        out.extend(lp.split([len(s.gen.response_ids) for s in part]))
    return out
