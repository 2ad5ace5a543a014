"""TOPR: Tapered Off-Policy REINFORCE (arXiv 2503.14286), ROLL's ``pg_variant: topr`` (docs/METHODS.md §16.5).

    A > 0:   l = -w_pos A log pi_k                      (SFT-like, no importance weight)
    A <= 0:  l = -w_neg sg(clamp(r, 0, 1)) A log pi_k   (truncated importance weight)

Value form as CISPO's (§15): l = grad_coef pi_k/sg(pi_k), value = grad_coef; nothing is blocked.
ROLL splits by the episode's score (> 0), masktrl's kernels see advantages: with rewards in
{0, 1} and group advantages the two splits agree wherever A != 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from masktrl.methods.batch import TokenBatch, log_ratio, unit_ratio_log
from masktrl.methods.params import _common, _number, _Protocol
from masktrl.methods.registry import TokenLosses, register_method


@dataclass(frozen=True)
class TOPRParams(_Protocol):
    """TOPR: REINFORCE on A > 0, sg(clamp(r, 0, 1))-weighted REINFORCE on A <= 0 (§16.5)."""

    positive_weight: float = 1.0
    """Weight of the A > 0 tokens (ROLL topr_positive_weight)."""
    negative_weight: float = 1.0
    """Weight of the A <= 0 tokens (ROLL topr_negative_weight)."""
    loss_agg: str = "seq-mean-token-mean"
    """Batch aggregation (§8)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""

    def __post_init__(self) -> None:
        _number("positive_weight", self.positive_weight, lo=0)
        _number("negative_weight", self.negative_weight, lo=0)
        _common(self)


@register_method(
    "topr", TOPRParams, "tapered off-policy REINFORCE: plain on A > 0, sg(clamp(r, 0, 1)) on A <= 0 (ROLL)"
)
def topr(batch: TokenBatch, adv: Tensor, p: TOPRParams, u: Tensor | None) -> TokenLosses:
    """TOPR (§16.5)."""
    lw = log_ratio(batch)  # [N] detached, +inf on invalid
    w = torch.where(adv > 0, torch.full_like(lw, p.positive_weight), p.negative_weight * lw.clamp_max(0.0).exp())  # [N]
    coef = torch.where(adv == 0, torch.zeros_like(w), -adv * w)  # [N] = grad_coef
    return TokenLosses(coef * unit_ratio_log(batch).exp(), ~batch.valid, None, None, None, lw)
