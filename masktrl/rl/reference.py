"""The reference policy of the reference-KL term (docs/METHODS.md §13): the log-probabilities
pi_ref assigns to each sampled response token.

``Reference`` is the hook the update calls: any callable ``(samples, share=None) -> Tensor [N]``
(log pi_ref of the samples' response tokens, in order, without gradient). ``FrozenReference``
is the one masktrl builds: a frozen copy of the starting policy, taken before a resumed run
loads its checkpoint, so the reference stays the run's starting point. A LoRA policy
(``model.lora``) gets ``AdapterReference`` instead: the same model with its adapters switched
off, with no second copy of the weights (``make_reference`` chooses).
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch

from masktrl.methods import BoundMethod, kl_reward_penalty
from masktrl.models.lora import has_lora, reference_policy
from masktrl.rl.policy import behaviour_logp, policy_token_batch
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


class AdapterReference:
    """The reference of a LoRA policy: the same model with its adapters switched off
    (``models.lora.reference_policy``), i.e. the base weights, which never train: the run's
    starting policy, with no second copy of the weights. Runs in eval mode, like
    ``FrozenReference``."""

    def __init__(self, model: torch.nn.Module, temperature: float, chunk: int):
        self.model = model
        self.temperature, self.chunk = temperature, chunk

    @torch.no_grad()
    def __call__(self, samples: list[Sample], share: bool | None = None) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        try:
            with reference_policy(self.model):
                out = policy_token_batch(self.model, samples, self.temperature, self.chunk, share=share)
        finally:
            self.model.train(was_training)
        return out.batch.logp.detach()


def make_reference(model: torch.nn.Module, temperature: float, chunk: int) -> Reference:
    """``AdapterReference`` for a model with LoRA adapters, else ``FrozenReference``."""
    if has_lora(model):
        return AdapterReference(model, temperature, chunk)
    return FrozenReference(model, temperature, chunk)


def micro_batch_size(n: int, minibatches: int, grad_accum: int) -> int:
    """The samples of one training micro-batch of an ``n``-sample batch: the reference forward
    over a whole batch (a KL in the reward) runs in pieces of this size."""
    return max(1, n // (minibatches * grad_accum))


def reference_logprobs(reference: Reference, samples: list[Sample], batch_size: int) -> list[torch.Tensor]:
    """Per sample, [len(response)] log pi_ref, computed ``batch_size`` samples at a time."""
    out: list[torch.Tensor] = []
    for start in range(0, len(samples), max(batch_size, 1)):
        part = samples[start : start + batch_size]
        lp = reference(part)
        out.extend(lp.split([len(s.gen.response_ids) for s in part]))
    return out


def response_lengths(samples: list[Sample]) -> list[int]:
    """Each response's token count: the batch weights of the reinforce++ advantages (§13.4)."""
    return [len(s.gen.response_ids) for s in samples]


def penalise_kl(samples: list[Sample], ref_logp: list[torch.Tensor], method: BoundMethod) -> dict:
    """``method.kl_in=reward`` (docs/METHODS.md §13.2): each reward minus kl_coef * sum_t kl_t,
    the estimator at the recorded log mu against ``ref_logp`` (one [len] tensor per sample), then
    every advantage again from the penalised rewards (``method.advantages``, as ``rl/collect.py``
    sets them). Returns the metrics ``kl_ref`` (the mean estimate over valid tokens) and
    ``kl_penalty`` (the mean penalty per response)."""
    if not samples:
        return {}
    mu = torch.tensor(
        [x for s in samples for x in behaviour_logp(s)], dtype=torch.float64
    )  # [N] (-inf: environment tokens, invalid)
    ref = torch.cat([r.detach().to(torch.float64).cpu() for r in ref_logp])  # [N]
    seq = torch.tensor([i for i, s in enumerate(samples) for _ in s.gen.response_ids])  # [N], sorted
    params = method.params
    per_token = kl_reward_penalty(mu, ref, torch.arange(mu.shape[0]), params.kl_estimator, 1.0)  # [N] (0 where invalid)
    penalty = params.kl_coef * torch.zeros(len(samples), dtype=torch.float64).index_add_(0, seq, per_token)  # [B]
    valid = mu > float("-inf")
    for s, p in zip(samples, penalty.tolist()):
        s.reward = s.reward - p
    adv = method.advantages([s.reward for s in samples], [s.group for s in samples], response_lengths(samples))
    for s, a in zip(samples, adv.tolist()):
        s.advantage = a
    return {
        "kl_ref": float(per_token[valid].mean()) if bool(valid.any()) else float("nan"),
        "kl_penalty": float(penalty.mean()),
    }
