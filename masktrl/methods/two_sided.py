"""TRL's two-sided clip (``delta``; INTELLECT-2, arXiv 2505.07291), docs/METHODS.md §16.9.

    l = -min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A)

With ``delta > 1 + eps_high`` (required here, as TRL recommends) the upper bound only binds for
A < 0, where it caps the loss at -A delta: exactly the dual clip of §2 with c = delta, so one
kernel serves it (``masks.ppo_clip_loss``). ``delta = inf`` is grpo with these eps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from masktrl.methods.batch import TokenBatch, log_ratio, log_ratio_live
from masktrl.methods.masks import ppo_clip_loss
from masktrl.methods.params import _common, _eps, _number, _Protocol
from masktrl.methods.registry import TokenLosses, register_method


@dataclass(frozen=True)
class TwoSidedParams(_Protocol):
    """TRL's two-sided GRPO clip: the ratio is also capped at delta (§16.9)."""

    eps_low: float = 0.2
    """Lower clip 1 - eps_low (TRL epsilon, default 0.2)."""
    eps_high: float = 0.2
    """Upper clip 1 + eps_high (TRL epsilon_high, default = epsilon)."""
    delta: float = 4.0
    """Upper cap of the ratio, > 1 + eps_high (TRL delta; INTELLECT-2 uses 4); inf = grpo."""
    loss_agg: str = "token-mean"
    """Batch aggregation (§8); TRL's default loss_type dapo normalises by the token count."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""

    def __post_init__(self) -> None:
        _eps(self)
        _number("delta", self.delta, inf_ok=True)
        if not self.delta > 1 + self.eps_high:
            raise ValueError(f"method.delta must be > 1 + eps_high = {1 + self.eps_high:g}, got {self.delta!r}")
        _common(self)


@register_method(
    "two-sided",
    TwoSidedParams,
    "PPO clip with the ratio also capped at delta for A < 0 (TRL delta, INTELLECT-2; eps 0.2, delta 4)",
)
def two_sided(batch: TokenBatch, adv: Tensor, p: TwoSidedParams, u: Tensor | None) -> TokenLosses:
    """Two-sided clip (§16.9): grpo's loss with dual clip c = delta."""
    cap = None if math.isinf(p.delta) else float(p.delta)
    loss, mask = ppo_clip_loss(log_ratio_live(batch), adv, p.eps_low, p.eps_high, cap)
    return TokenLosses(loss, mask, None, None, None, log_ratio(batch))
