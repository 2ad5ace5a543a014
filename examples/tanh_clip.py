"""A trust-region rule written outside masktrl: the tanh soft clip (an example, not a shipped rule).

PPO's clip cuts a token's gradient to zero the moment its ratio r = pi/mu leaves
[1 - eps_low, 1 + eps_high] in the direction its advantage pushes. This rule bends the
surrogate smoothly into the same bounds instead, on both sides and for either sign of A:

    f(r) = 1 + e * tanh((r - 1) / e),   e = eps_high where r >= 1, eps_low where r < 1
    l    = -A f(r)                                   (value form)
    dl/dlog pi = -A r sech^2((r - 1) / e)            (what the update uses)

f(1) = 1 and f'(1) = 1, so near r = 1 it is plain importance-weighted policy gradient; far
from 1 the gradient decays like sech^2 instead of stopping, and the value stays within
[1 - eps_low, 1 + eps_high]. No token is blocked outright (``mask`` marks invalid tokens only).

Train with it, sweep it against the shipped rules and compare (docs/METHODS.md "Writing your
own rule"):

    masktrl train --method examples/tanh_clip.py:tanh_clip --set train.steps=20
    masktrl sweep --methods grpo,examples/tanh_clip.py:tanh_clip --seeds 2 --set train.steps=20
    masktrl sweep --methods examples/tanh_clip.py:tanh_clip:eps_high=0.5 --seeds 2
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from masktrl.methods import (
    MethodParams,
    TokenBatch,
    TokenLosses,
    check_number,
    log_ratio,
    register_method,
    unit_ratio_log,
)


@dataclass(frozen=True)
class TanhClipParams(MethodParams):
    """The tanh soft clip's parameters (``--set method.eps_high=0.5``); the shared ones
    (loss_agg, adv_norm, dynamic_sampling, kl_coef, entropy_coef...) come from MethodParams."""

    eps_low: float = 0.2
    """The surrogate's floor is 1 - eps_low (the soft counterpart of PPO's eps_low)."""
    eps_high: float = 0.28
    """The surrogate's ceiling is 1 + eps_high (the soft counterpart of clip-higher's eps_high)."""

    def __post_init__(self) -> None:
        check_number("eps_low", self.eps_low, lo=1e-6, hi=1)
        check_number("eps_high", self.eps_high, lo=1e-6)
        super().__post_init__()  # checks the shared fields


@register_method(
    "tanh_clip", TanhClipParams, "tanh soft clip: l = -A (1 + e tanh((r - 1)/e)), e = eps_high | eps_low (example)"
)
def tanh_clip(batch: TokenBatch, adv: Tensor, p: TanhClipParams, u: Tensor | None) -> TokenLosses:
    """l = -A f(r), f(r) = 1 + e tanh((r - 1)/e); gradient -A r sech^2((r - 1)/e) through log pi."""
    valid = batch.valid  # [N] bool
    lr = torch.where(valid, log_ratio(batch), torch.zeros_like(batch.logp))  # [N] log r, detached; 0 on invalid tokens
    r = lr.exp()  # [N] (inf for log r > 709: f and the gradient below stay finite)
    e = torch.where(r >= 1, torch.full_like(r, p.eps_high), torch.full_like(r, p.eps_low))  # [N]
    x = (r - 1) / e  # [N]
    f = 1 + e * torch.tanh(x)  # [N] the soft-clipped ratio
    ax = x.abs()
    # r sech^2(x) = exp(log r + log 4 - 2|x| - 2 log(1 + exp(-2|x|))), in log space so r = inf gives 0, not inf * 0
    weight = torch.exp(lr + math.log(4.0) - 2 * ax - 2 * torch.log1p(torch.exp(-2 * ax)))  # [N]
    coef = torch.where(valid & (adv != 0), -adv * weight, torch.zeros_like(weight))  # [N] d loss / d log pi
    value = torch.where(adv != 0, -adv * f, torch.zeros_like(f))  # [N]
    loss = value + coef * unit_ratio_log(batch)  # [N] value -A f(r); gradient coef
    return TokenLosses(loss, ~valid, None, None, None, log_ratio(batch))
