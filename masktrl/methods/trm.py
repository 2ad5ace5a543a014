"""Trust Region Masking (TRM, arXiv 2512.23075): mask whole sequences by their maximum token
divergence (docs/METHODS.md §16.10).

    D_t   = the token divergence of ``divergence``: k3 = r - 1 - log r (log r clamped to ±20; a
            one-sample estimate of KL(mu || pi), verl's ``seq_max_k3``) or one of masktrl's
            binary-tv | binary-kl | topk-tv | topk-kl (§3; top-K KL from the lists)
    mask  = every token of a sequence with max_t D_t > delta, plus PPO's clip (§2) elsewhere
    l     = grpo's clipped loss (§2) on the kept sequences

The paper's bounds depend on the maximum token KL D_KL^tok,max; it masks sequences that violate
it. Its threshold and estimator were not read for masktrl (only its abstract); the defaults
(k3, delta 0.01) are verl's rejection preset for the same per-sequence maximum
(``verl/trainer/ppo/rollout_corr_helper.py``, ``compute_rollout_rejection_mask``: ``seq_max_k3``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from masktrl.methods.batch import TokenBatch, log_ratio, log_ratio_live, seq_index
from masktrl.methods.divergence import DIVERGENCE_KINDS, divergence
from masktrl.methods.masks import ppo_clip_loss
from masktrl.methods.params import _choice, _common, _eps, _number, _Protocol
from masktrl.methods.registry import TokenLosses, register_method

TRM_DIVERGENCES = ("k3",) + DIVERGENCE_KINDS
K3_LOG_BOUND = 20.0  # verl's SAFETY_BOUND


@dataclass(frozen=True)
class TRMParams(_Protocol):
    """TRM: mask sequences whose maximum token divergence exceeds delta; grpo's clip elsewhere (§16.10)."""

    divergence: str = "k3"
    """Token divergence: k3 (r - 1 - log r, verl's seq_max_k3) | binary-tv | binary-kl | topk-tv | topk-kl."""
    delta: float = 0.01
    """Sequences with max_t D_t > delta are masked (verl's k3 rejection preset 0.01); inf masks none."""
    eps_low: float = 0.2
    """PPO lower clip on the kept sequences (grpo's)."""
    eps_high: float = 0.28
    """PPO upper clip on the kept sequences (grpo's)."""
    loss_agg: str = "seq-mean-token-mean"
    """Batch aggregation (§8)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""

    def __post_init__(self) -> None:
        _choice("divergence", self.divergence, TRM_DIVERGENCES)
        _number("delta", self.delta, lo=0, inf_ok=True)
        _eps(self)
        _common(self)

    @property
    def diag_deltas(self) -> tuple[float, float]:
        """The diagnostics' D > delta fraction uses the rule's own D and delta (§12)."""
        return float(self.delta), float(self.delta)


def token_divergence(batch: TokenBatch, kind: str) -> Tensor:
    """[N] D_t of ``kind`` (detached); values on invalid tokens are unspecified."""
    if kind == "k3":
        lr = torch.where(
            batch.valid, log_ratio(batch), torch.zeros((), dtype=batch.dtype, device=batch.valid.device)
        ).clamp(-K3_LOG_BOUND, K3_LOG_BOUND)
        return lr.exp() - 1.0 - lr
    return divergence(batch, kind)


@register_method(
    "trm",
    TRMParams,
    "trust region masking: drop sequences whose max token divergence > delta "
    "(k3 0.01, verl seq_max_k3); grpo's clip elsewhere",
)
def trm(batch: TokenBatch, adv: Tensor, p: TRMParams, u: Tensor | None) -> TokenLosses:
    """TRM (§16.10)."""
    d = token_divergence(batch, p.divergence)  # [N]
    d = torch.where(batch.valid, d, torch.full_like(d, float("-inf")))
    inv, g = seq_index(batch)
    worst = torch.full((g,), float("-inf"), dtype=d.dtype, device=d.device).scatter_reduce(0, inv, d, "amax")  # [G]
    dropped = (worst > p.delta)[inv]  # [N]
    loss, clip = ppo_clip_loss(log_ratio_live(batch), adv, p.eps_low, p.eps_high)
    loss = torch.where(dropped, torch.zeros_like(loss), loss)
    return TokenLosses(loss, clip | dropped, d.detach(), None, None, log_ratio(batch))
