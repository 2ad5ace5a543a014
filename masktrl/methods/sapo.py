"""SAPO: Soft Adaptive Policy Optimization (arXiv 2511.20347), a sigmoid gate instead of a clip (docs/METHODS.md §16.1).

    tau = tau_pos if A > 0 else tau_neg
    l   = -A * (4 / tau) * sigmoid(tau * (r - 1)),      log r clamped to [-20, 20] first (verl)
    grad_coef = d l / d log pi_k = -A * 4 * s * (1 - s) * r,   s = sigmoid(tau (r - 1))

At r = 1 the gate's slope is exactly 1 (grad_coef = -A, plain policy gradient); away from 1 it
decays smoothly on both sides, faster for larger tau. No token is blocked outright (``mask`` is
only the invalid tokens). Anchors: verl ``compute_policy_loss_sapo`` (``tau_pos``, ``tau_neg``),
TRL ``loss_type="sapo"`` (``sapo_temperature_pos``, ``sapo_temperature_neg``), AReaL
``use_sapo_loss`` (``sapo_tau_pos``, ``sapo_tau_neg``); all default to 1.0 and 1.05 and
aggregate seq-mean-token-mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from masktrl.methods.batch import TokenBatch, log_ratio, log_ratio_live
from masktrl.methods.params import _common, _number, _Protocol
from masktrl.methods.registry import TokenLosses, register_method

LOG_RATIO_BOUND = 20.0  # verl clamps log r to [-20, 20] before exp (core_algos.py, compute_policy_loss_sapo)


@dataclass(frozen=True)
class SAPOParams(_Protocol):
    """SAPO: l = -A (4/tau) sigmoid(tau (r - 1)), tau = tau_pos if A > 0 else tau_neg (§16.1)."""

    tau_pos: float = 1.0
    """Gate temperature for A > 0 (verl tau_pos, TRL sapo_temperature_pos, AReaL
    sapo_tau_pos); larger = a narrower soft trust region."""
    tau_neg: float = 1.05
    """Gate temperature for A <= 0 (verl tau_neg, TRL sapo_temperature_neg, AReaL sapo_tau_neg)."""
    loss_agg: str = "seq-mean-token-mean"
    """Batch aggregation (§8); verl and TRL aggregate SAPO seq-mean-token-mean."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""

    def __post_init__(self) -> None:
        for name in ("tau_pos", "tau_neg"):
            _number(name, getattr(self, name))
            if getattr(self, name) <= 0:
                raise ValueError(f"method.{name} must be > 0, got {getattr(self, name)!r}")
        _common(self)


def sapo_gate(log_r: Tensor, tau: Tensor) -> Tensor:
    """[N] (4/tau) sigmoid(tau (r - 1)) with log r clamped to [-20, 20]; carries the gradient of ``log_r``."""
    r = log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()  # [N]
    return torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau)


@register_method(
    "sapo", SAPOParams, "soft sigmoid gate (4/tau) sigmoid(tau (r-1)) instead of a clip (tau_pos 1.0, tau_neg 1.05)"
)
def sapo(batch: TokenBatch, adv: Tensor, p: SAPOParams, u: Tensor | None) -> TokenLosses:
    """SAPO (§16.1): l = -A (4/tau) sigmoid(tau (r - 1)); nothing is blocked."""
    tau = torch.where(adv > 0, torch.full_like(adv, p.tau_pos), torch.full_like(adv, p.tau_neg))  # [N]
    loss = -adv * sapo_gate(log_ratio_live(batch), tau)  # [N]
    loss = torch.where(adv == 0, torch.zeros_like(loss), loss)
    return TokenLosses(loss, ~batch.valid, None, None, None, log_ratio(batch))
