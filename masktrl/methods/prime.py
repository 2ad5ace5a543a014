"""prime-rl's two built-in losses (``[trainer.loss] type = "default" | "ipo"``), docs/METHODS.md §16.7-16.8.

    default (prime-dppo):  mask = (A > 0 and pi_k - mu_k > dppo_mask_high) or (A <= 0 and pi_k - mu_k < -dppo_mask_low)
                           (DPPO's binary-TV mask, arXiv 2602.04879)
    ipo (prime-ipo):       mask = |pi_k - mu_k| > ipo_threshold                  (symmetric)
    both:                  l = -adv_tau A (1 - mask) r + kl_tau (log r)^2
                           (r live: gradient -adv_tau A r + 2 kl_tau log r)

The (log r)^2 term (Kimi K2.5's KL, arXiv 2602.02276) acts on every valid token, masked or not,
A = 0 included. prime-rl sums the per-token loss and divides by the batch's loss-token count
(token-mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from masktrl.methods.batch import TokenBatch, log_ratio, log_ratio_live
from masktrl.methods.params import _common, _number, _Protocol
from masktrl.methods.registry import TokenLosses, register_method


def _prime_loss(batch: TokenBatch, adv: Tensor, mask: Tensor, adv_tau: float, kl_tau: float) -> Tensor:
    live = log_ratio_live(batch)  # [N] log r with gradient, 0 on invalid
    idle = mask | (adv == 0)
    pg = torch.where(
        idle, torch.zeros_like(live), -adv_tau * adv * torch.where(idle, torch.zeros_like(live), live).exp()
    )
    return pg + kl_tau * live * live


def _probs_diff(batch: TokenBatch) -> Tensor:
    """[N] pi_k - mu_k (detached)."""
    dt = batch.dtype
    return batch.logp.detach().to(dt).exp() - batch.behavior_logp.to(dt).exp()


@dataclass(frozen=True)
class PrimeDPPOParams(_Protocol):
    """prime-rl's default loss: DPPO binary-TV mask against mu plus kl_tau (log r)^2 (§16.7)."""

    dppo_mask_low: float = 0.2
    """A <= 0: mask where pi_k - mu_k < -dppo_mask_low (prime-rl trainer.loss.dppo_mask_low)."""
    dppo_mask_high: float = 0.2
    """A > 0: mask where pi_k - mu_k > dppo_mask_high (prime-rl trainer.loss.dppo_mask_high)."""
    adv_tau: float = 1.0
    """Scale of the advantage (prime-rl trainer.loss.adv_tau)."""
    kl_tau: float = 1e-3
    """Coefficient of (log r)^2 on every valid token (prime-rl trainer.loss.kl_tau)."""
    loss_agg: str = "token-mean"
    """Batch aggregation (§8); prime-rl divides by the loss-token count."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""

    def __post_init__(self) -> None:
        for name in ("dppo_mask_low", "dppo_mask_high", "adv_tau", "kl_tau"):
            _number(name, getattr(self, name), lo=0, inf_ok=name.startswith("dppo"))
        _common(self)


@dataclass(frozen=True)
class PrimeIPOParams(_Protocol):
    """prime-rl's ipo loss: symmetric mask |pi_k - mu_k| > ipo_threshold plus kl_tau (log r)^2 (§16.8)."""

    ipo_threshold: float = 0.1
    """Mask where |pi_k - mu_k| > ipo_threshold, whatever the sign of A (prime-rl trainer.loss.ipo_threshold)."""
    adv_tau: float = 1.0
    """Scale of the advantage (prime-rl trainer.loss.adv_tau)."""
    kl_tau: float = 1e-3
    """Coefficient of (log r)^2 on every valid token (prime-rl trainer.loss.kl_tau)."""
    loss_agg: str = "token-mean"
    """Batch aggregation (§8); prime-rl divides by the loss-token count."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""

    def __post_init__(self) -> None:
        _number("ipo_threshold", self.ipo_threshold, lo=0, inf_ok=True)
        _number("adv_tau", self.adv_tau, lo=0)
        _number("kl_tau", self.kl_tau, lo=0)
        _common(self)


@register_method(
    "prime-dppo", PrimeDPPOParams, "prime-rl's default: DPPO binary-TV mask vs mu (0.2/0.2) + 1e-3 (log r)^2"
)
def prime_dppo(batch: TokenBatch, adv: Tensor, p: PrimeDPPOParams, u: Tensor | None) -> TokenLosses:
    """prime-rl default loss (§16.7)."""
    diff = _probs_diff(batch)
    mask = torch.where(adv > 0, diff > p.dppo_mask_high, diff < -p.dppo_mask_low) | ~batch.valid
    return TokenLosses(_prime_loss(batch, adv, mask, p.adv_tau, p.kl_tau), mask, None, None, None, log_ratio(batch))


@register_method("prime-ipo", PrimeIPOParams, "prime-rl's ipo: symmetric mask |pi_k - mu_k| > 0.1 + 1e-3 (log r)^2")
def prime_ipo(batch: TokenBatch, adv: Tensor, p: PrimeIPOParams, u: Tensor | None) -> TokenLosses:
    """prime-rl ipo loss (§16.8)."""
    mask = (_probs_diff(batch).abs() > p.ipo_threshold) | ~batch.valid
    return TokenLosses(_prime_loss(batch, adv, mask, p.adv_tau, p.kl_tau), mask, None, None, None, log_ratio(batch))
