"""GMPO: Geometric-Mean Policy Optimization (arXiv 2507.20673), verl's ``geo_mean`` loss (docs/METHODS.md §16.2).

Per sequence, with the token log-ratios clipped in log space on the advantage's side:

    m_t = sign(A) min(sign(A) log r_t, sign(A) clamp(log r_t, -clip_low, clip_high))
    L   = -A exp(mean_t m_t)                                   one value per sequence

Token form (as GSPO's, §5): l_t = -A sg(s) exp(m_t - sg(m_t)), s = exp(mean_t m_t), so each
token's value is -A s (seq-mean-token-mean gives L per sequence) and d l_t / d log pi_t =
-A s on tokens whose m_t is unclipped, 0 on clipped ones (``mask``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from masktrl.methods.batch import TokenBatch, log_ratio, log_ratio_live, seq_index
from masktrl.methods.params import _common, _number, _Protocol
from masktrl.methods.registry import TokenLosses, register_method


@dataclass(frozen=True)
class GMPOParams(_Protocol):
    """GMPO: L = -A exp(mean_t clip_A(log r_t)) per sequence (§16.2)."""

    clip_low: float = 0.4
    """log r is clipped below at -clip_low when A < 0 (verl clip_ratio_low; GMPO's example sets 0.4, in log space)."""
    clip_high: float = 0.4
    """log r is clipped above at clip_high when A > 0 (verl clip_ratio_high; 0.4 in GMPO's example)."""
    loss_agg: str = "seq-mean-token-mean"
    """Batch aggregation (§8); seq-mean-token-mean gives verl's mean over sequences of -A s."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""

    def __post_init__(self) -> None:
        _number("clip_low", self.clip_low, lo=0, inf_ok=True)
        _number("clip_high", self.clip_high, lo=0, inf_ok=True)
        _common(self)


@register_method(
    "gmpo", GMPOParams, "geometric mean of the token ratios, clipped in log space (verl geo_mean; clip 0.4)"
)
def gmpo(batch: TokenBatch, adv: Tensor, p: GMPOParams, u: Tensor | None) -> TokenLosses:
    """GMPO (§16.2)."""
    valid = batch.valid
    live = log_ratio_live(batch)  # [N] log r with gradient, 0 on invalid
    lr = live.detach()
    sgn = torch.sign(adv)
    clipped = lr.clamp(-p.clip_low, p.clip_high)  # [N]
    mask = (sgn * lr > sgn * clipped) & valid  # [N] the clamp binds on the advantage's side
    m = torch.where(mask, clipped, live)  # [N] m_t with gradient where unclipped
    inv, g = seq_index(batch)
    mv = torch.where(valid, m.detach(), torch.zeros_like(lr))
    total = torch.zeros(g, dtype=lr.dtype, device=lr.device).index_add_(0, inv, mv)  # [G]
    count = torch.zeros(g, dtype=lr.dtype, device=lr.device).index_add_(0, inv, valid.to(lr.dtype))  # [G]
    s = (total / count.clamp_min(1.0)).exp()[inv]  # [N]
    loss = -adv * s * (m - m.detach()).exp()
    loss = torch.where(adv == 0, torch.zeros_like(loss), loss)
    return TokenLosses(loss, mask, None, None, None, log_ratio(batch))
