"""Padded [B, T] tensors as masktrl's ``TokenBatch``, and a rule's loss on it as masktrl's update computes it.

What both integrations share. ``rule_loss`` is ``rl/update.py: micro_update`` for one
micro-batch: the method's corrected token losses (``BoundMethod.corrected_token_losses``), the
regularisers (``BoundMethod.regularize``), the kept batch under ``denominator: kept`` and the
method's aggregation (``BoundMethod.aggregate``).
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import torch
from torch import Tensor

from masktrl.config import resolve_method_spec
from masktrl.errors import ConfigError
from masktrl.methods import BoundMethod, TokenBatch, TokenLosses
from masktrl.methods.corrections import kept_batch


def bind(method: Any, correction: dict | None = None) -> BoundMethod:
    """A bound method from a spec string as ``--methods`` takes it (``pdm``, ``dppo:divergence=topk-tv``,
    ``path/to/rules.py:name``) and an optional ``method.correction`` block, or a ``BoundMethod`` as is."""
    if isinstance(method, BoundMethod):
        if correction is not None:
            raise ConfigError("correction applies to a method spec string; a BoundMethod carries its own")
        return method
    if not isinstance(method, str):
        raise ConfigError(
            f"method must be a spec string such as 'pdm' or 'path/to/rules.py:name', got {type(method).__name__}"
        )
    return resolve_method_spec(method, correction)


def padded_token_batch(
    logp: Tensor,
    behavior_logp: Tensor,
    sampled_ids: Tensor,
    mask: Tensor,
    *,
    topk_ids: Tensor | None = None,
    topk_behavior_logp: Tensor | None = None,
    topk_logp: Tensor | None = None,
    pi_sq_sum: Tensor | None = None,
    vocab_size: int | None = None,
) -> TokenBatch:
    """The tokens of ``mask`` [B, T] (row-major: sequence b's tokens in order) as a ``TokenBatch``;
    ``seq_ids`` is the row. Without top-K lists every token gets one padding slot (K = 1, id -1):
    the sampled token alone, which is all a sampled-token rule reads."""
    sel = mask.bool()
    b, t = sel.shape
    seq_ids = torch.arange(b, device=sel.device).unsqueeze(1).expand(b, t)[sel]
    n = int(sel.sum())
    if topk_ids is None:
        ids = torch.full((n, 1), -1, dtype=torch.long, device=sel.device)
        mu_k = torch.full((n, 1), float("-inf"), dtype=behavior_logp.dtype, device=sel.device)
        pi_k = torch.full((n, 1), float("-inf"), dtype=logp.dtype, device=sel.device)
    else:
        if topk_behavior_logp is None or topk_logp is None:
            raise ValueError(
                "top-K lists need their ids, the behaviour's log-probs and the policy's log-probs at those ids"
            )
        ids, mu_k, pi_k = topk_ids[sel].long(), topk_behavior_logp[sel], topk_logp[sel].detach()
    return TokenBatch(
        logp=logp[sel],
        behavior_logp=behavior_logp[sel].detach(),
        sampled_ids=sampled_ids[sel].long(),
        topk_ids=ids,
        topk_behavior_logp=mu_k,
        topk_logp=pi_k,
        seq_ids=seq_ids,
        vocab_size=vocab_size,
        pi_sq_sum=None if pi_sq_sum is None else pi_sq_sum[sel].detach(),
    )


def token_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """[N] per-token advantages of the tokens of ``mask``, from [B] per sequence or [B, T] per token."""
    sel = mask.bool()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand(sel.shape)
    return advantages[sel].detach()


class RuleLoss(NamedTuple):
    loss: Tensor  # scalar: the aggregate, with the gradient
    token_loss: Tensor  # [N] the per-token loss the aggregate reads (correction and regularisers included)
    losses: TokenLosses  # the rule's output with the correction applied
    batch: TokenBatch  # the batch aggregated (rejected tokens invalid under denominator: kept)


def rule_loss(
    method: BoundMethod,
    batch: TokenBatch,
    advantages: Tensor,
    *,
    horizon: int | float,
    old: tuple | None = None,
    u: Tensor | None = None,
    entropy: Tensor | None = None,
    ref_logp: Tensor | None = None,
) -> RuleLoss:
    """``method``'s scalar loss on ``batch`` exactly as masktrl's update computes it for one micro-batch
    (``rl/update.py: micro_update``); ``old``: (log pi_old [N], at the top-K ids [N, K]) when the
    correction needs pi_old; ``u``: SIS's uniforms [N]; ``horizon``: the completion length limit."""
    losses, corr, _ = method.corrected_token_losses(batch, advantages, old=old, u=u)
    reg = method.regularize(losses.loss, batch, ref_logp=ref_logp, entropy=entropy)
    agg_batch = kept_batch(batch, corr) if method.correction.drops_rejected else batch
    return RuleLoss(method.aggregate(reg.loss, agg_batch, horizon=horizon), reg.loss, losses, agg_batch)


def keyed_uniforms(key: str, n: int) -> Tensor:
    """[n] float64 uniforms from a generator seeded with the first 8 bytes of sha256(``key``): the
    random stream of a rule's per-token draws (sis) inside a trainer that carries none (TRL: one
    key per seed, optimizer step and micro-batch; verl: per seed, rank and call)."""
    digest = hashlib.sha256(key.encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.rand(n, generator=gen, dtype=torch.float64)


def needs_topk(method: BoundMethod) -> bool:
    """Whether the rule reads the behaviour's top-K lists: its loss on a probe batch with real lists
    differs from the loss with the sampled token alone (holds for a rule from a file too)."""
    gen = torch.Generator().manual_seed(0)
    n, k, v = 24, 4, 16
    logits_mu = torch.randn(n, v, generator=gen, dtype=torch.float64) * 2
    logits_pi = logits_mu + torch.randn(n, v, generator=gen, dtype=torch.float64) * 1.5
    mu, pi = logits_mu.log_softmax(-1), logits_pi.log_softmax(-1)
    sampled = torch.multinomial(mu.exp(), 1, generator=gen).squeeze(1)
    ids = mu.topk(k, dim=-1).indices
    seq = torch.arange(n) // 6
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    u = torch.rand(n, generator=gen, dtype=torch.float64) if method.needs_u else None
    common = dict(
        logp=pi.gather(1, sampled[:, None]).squeeze(1),
        behavior_logp=mu.gather(1, sampled[:, None]).squeeze(1),
        sampled_ids=sampled,
        seq_ids=seq,
        vocab_size=v,
        pi_sq_sum=pi.exp().pow(2).sum(-1),
    )
    with_lists = TokenBatch(topk_ids=ids, topk_behavior_logp=mu.gather(1, ids), topk_logp=pi.gather(1, ids), **common)
    pad = torch.full((n, 1), -1, dtype=torch.long)
    inf = torch.full((n, 1), float("-inf"), dtype=torch.float64)
    alone = TokenBatch(topk_ids=pad, topk_behavior_logp=inf, topk_logp=inf, **common)
    a = method.token_losses(with_lists, adv, u=u).loss
    b = method.token_losses(alone, adv, u=u).loss
    return not torch.allclose(a, b, rtol=1e-9, atol=1e-12, equal_nan=True)
