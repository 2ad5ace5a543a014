"""M2PO: second-moment trust policy optimization (arXiv 2510.01161), AReaL's ``m2_threshold`` (docs/METHODS.md §16.6).

    M2_t = (log r_t)^2                                   over the batch's valid tokens (detached)
    sort M2 descending; mask the largest ones, fewest first, until the mean of the rest is
    below m2_threshold (all but one if it never is)
    l = -A (1 - mask) sg(r) pi_k / sg(pi_k)              value -A r on kept tokens, 0 on masked

AReaL computes M2 from log pi_prox - log mu (the recomputed proximal policy against the
behaviour); in bypass mode masktrl's r = pi/mu with pi the policy being trained, which is
pi_prox itself on a step's first minibatch. No PPO clip: the paper's objective is the masked
importance-weighted surrogate (AReaL's example sets eps_clip 0.0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from masktrl.methods.batch import TokenBatch, log_ratio, unit_ratio_log
from masktrl.methods.masks import masked_pg_loss
from masktrl.methods.params import _common, _number, _Protocol
from masktrl.methods.registry import TokenLosses, register_method


def m2_mask(log_r: Tensor, valid: Tensor, threshold: float) -> Tensor:
    """[N] bool: the valid tokens AReaL's ``_get_m2po_loss_mask`` masks (largest (log r)^2 first,
    until the mean of the rest is < threshold; all but one if never)."""
    m2 = torch.where(valid, log_r * log_r, torch.zeros_like(log_r))  # [N]
    vals = m2[valid]
    n = vals.numel()
    out = torch.zeros_like(valid)
    if n == 0:
        return out
    sorted_m2, order = torch.sort(vals, descending=True)
    suffix = sorted_m2.flip(0).cumsum(0).flip(0)  # [n] sum of sorted_m2[i:]
    counts = torch.arange(n, 0, -1, dtype=vals.dtype, device=vals.device)
    below = torch.nonzero(suffix / counts < threshold).flatten()
    drop = int(below[0]) if below.numel() else n - 1
    chosen = torch.zeros(n, dtype=torch.bool, device=vals.device)
    chosen[order[:drop]] = True
    out[torch.nonzero(valid).flatten()] = chosen
    return out


@dataclass(frozen=True)
class M2POParams(_Protocol):
    """M2PO: mask the largest (log r)^2 until their mean is below m2_threshold (§16.6)."""

    m2_threshold: float = 0.04
    """Bound on the mean second moment of log r over the kept tokens (AReaL m2_threshold; 0.04 in its example)."""
    loss_agg: str = "token-mean"
    """Batch aggregation (§8); the paper divides by the batch's token count."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""

    def __post_init__(self) -> None:
        _number("m2_threshold", self.m2_threshold, lo=0, inf_ok=True)
        if self.m2_threshold <= 0:
            raise ValueError(f"method.m2_threshold must be > 0, got {self.m2_threshold!r}")
        _common(self)


@register_method(
    "m2po", M2POParams, "mask the largest (log r)^2 until their batch mean is below m2_threshold 0.04 (AReaL)"
)
def m2po(batch: TokenBatch, adv: Tensor, p: M2POParams, u: Tensor | None) -> TokenLosses:
    """M2PO (§16.6)."""
    lw = log_ratio(batch)  # [N] detached, +inf on invalid
    mask = m2_mask(torch.where(batch.valid, lw, torch.zeros_like(lw)), batch.valid, p.m2_threshold) | ~batch.valid
    loss = masked_pg_loss(unit_ratio_log(batch), lw, adv, mask, None)
    return TokenLosses(loss, mask, None, None, None, lw)
