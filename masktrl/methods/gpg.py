"""GPG (AMAP-ML/GPG, the source verl cites), verl's ``gpg`` loss (docs/METHODS.md §16.11).

    l = -A log pi_k                 (value form -A pi_k/sg(pi_k), value -A; grad_coef = -A)

Plain REINFORCE with group advantages: no importance weight, no clip, nothing blocked. verl
``compute_policy_loss_gpg`` (``core_algos.py``) with its default token-mean aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from masktrl.methods.batch import TokenBatch, log_ratio, unit_ratio_log
from masktrl.methods.params import _common, _Protocol
from masktrl.methods.registry import TokenLosses, register_method


@dataclass(frozen=True)
class GPGParams(_Protocol):
    """GPG: l = -A log pi_k on every valid token (§16.11)."""

    loss_agg: str = "token-mean"
    """Batch aggregation (§8); verl's default token-mean."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""

    def __post_init__(self) -> None:
        _common(self)


@register_method("gpg", GPGParams, "plain REINFORCE -A log pi: no importance weight, no clip (verl gpg)")
def gpg(batch: TokenBatch, adv: Tensor, p: GPGParams, u: Tensor | None) -> TokenLosses:
    """GPG (§16.11)."""
    coef = torch.where(adv == 0, torch.zeros_like(adv), -adv)  # [N] = grad_coef
    return TokenLosses(coef * unit_ratio_log(batch).exp(), ~batch.valid, None, None, None, log_ratio(batch))
