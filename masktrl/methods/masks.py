"""Token masks and the two loss forms they plug into (docs/METHODS.md §2-4).

* ``ppo_clip_loss``: l = -min(w A, clip(w, 1-eps_low, 1+eps_high) A) with its mask, optionally
  dual-clipped at -A c for A < 0 (§2).
* ``dppo_mask``: D > delta(A) and sign(A (r-1)) > 0 (DPPO, arXiv 2602.04879, §3).
* ``pdm_mask``: D > delta(A) and sign(A Ddot) > 0 (predictive divergence mask, §4).
* ``bracket_mask``: the same with the sign certified by the bracket of Ddot_KL (§4.6).
* ``masked_pg_loss``: l = -A (1-mask) sg(w) pi_k/sg(pi_k), the loss of DPPO and PDM.

Losses take a *live* log-weight tensor (value log w, gradient d log w / d logp) so one
function serves plain ratios and SIS weights. Nothing here knows about invalid tokens; the
caller zeroes them (``objectives.finalize``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def ppo_clip_loss(
    log_w: Tensor, adv: Tensor, eps_low: float, eps_high: float, dual_clip: float | None = None
) -> tuple[Tensor, Tensor]:
    """PPO clip with clip-higher; returns loss [N] and mask [N] (strict inequalities).

    log_w [N] carries the gradient. Unmasked: value -A w, d/dlogp = -A w (d log w/dlogp).
    Masked: value -A clip(w), gradient 0. A = 0: loss 0, gradient 0, mask False.
    dual_clip c > 1: where A < 0 and w > c the loss is -A c (gradient 0, masked): the
    min(max(-A w, -A clip(w)), -A c) of dual-clip PPO; c = None or inf is plain PPO.
    """
    w = log_w.detach().exp()  # [N]
    mask = ((adv > 0) & (w > 1 + eps_high)) | ((adv < 0) & (w < 1 - eps_low))  # [N]
    clipped = w.clamp(1 - eps_low, 1 + eps_high)
    if dual_clip is not None:
        capped = (adv < 0) & (w > dual_clip)  # [N] (c > 1 >= 1 - eps_low: disjoint from the clip mask)
        mask = mask | capped
        clipped = torch.where(capped, torch.full_like(w, dual_clip), clipped)
    idle = mask | (adv == 0)
    live = torch.where(idle, torch.zeros_like(log_w), log_w)  # keeps exp finite where unused
    loss = torch.where(mask, -adv * clipped, -adv * live.exp())  # [N]
    return torch.where(adv == 0, torch.zeros_like(loss), loss), mask


def delta_of(adv: Tensor, delta_pos: float, delta_neg: float) -> Tensor:
    """[N] delta(A) = delta_pos if A > 0 else delta_neg."""
    return torch.where(adv > 0, torch.full_like(adv, delta_pos), torch.full_like(adv, delta_neg))


def dppo_mask(d: Tensor, log_r: Tensor, adv: Tensor, delta_pos: float, delta_neg: float) -> Tensor:
    """[N] bool: D > delta(A) and sign(A (r - 1)) > 0 (sign(r-1) = sign(log r))."""
    return (d > delta_of(adv, delta_pos, delta_neg)) & (adv * torch.sign(log_r) > 0)


def pdm_mask(d: Tensor, ddot: Tensor, adv: Tensor, delta_pos: float, delta_neg: float) -> Tensor:
    """[N] bool: D > delta(A) and sign(A Ddot) > 0 (Ddot = 0 or A = 0: not masked)."""
    return (d > delta_of(adv, delta_pos, delta_neg)) & (adv * torch.sign(ddot) > 0)


def bracket_mask(
    d: Tensor, lo: Tensor, hi: Tensor, adv: Tensor, delta_pos: float, delta_neg: float, uncertain: str
) -> Tensor:
    """[N] bool: the certified-sign mask of §4.6 from the bracket lo <= Ddot_KL <= hi.

    keep: D > delta(A) and ((A > 0 and lo > 0) or (A < 0 and hi < 0))   only a certified increase
    mask: D > delta(A) and ((A > 0 and hi > 0) or (A < 0 and lo < 0))   all but a certified non-increase
    """
    up, down = (lo, hi) if uncertain == "keep" else (hi, lo)
    increase = ((adv > 0) & (up > 0)) | ((adv < 0) & (down < 0))  # [N]
    return (d > delta_of(adv, delta_pos, delta_neg)) & increase


def masked_pg_loss(unit_log: Tensor, log_w: Tensor, adv: Tensor, mask: Tensor, ratio_cap: float | None) -> Tensor:
    """[N] l = -A (1 - mask) sg(w) pi_k/sg(pi_k) with w = r or min(r, ratio_cap).

    ``unit_log`` [N] is log(pi_k/sg(pi_k)) (value 0, gradient 1); ``log_w`` [N] is detached.
    Value -A (1-mask) w; d l / d logp = -A (1-mask) w. Masked or A = 0 tokens: exactly 0.
    """
    w = log_w.detach().exp()  # [N]
    if ratio_cap is not None:
        w = w.clamp_max(ratio_cap)
    coef = torch.where(mask | (adv == 0), torch.zeros_like(w), -adv * w)  # [N] = grad_coef
    return coef * unit_log.exp()
