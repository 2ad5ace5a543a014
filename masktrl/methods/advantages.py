"""Advantages from sequence rewards (docs/METHODS.md §11), one value per response.

Every response of a group answers the same prompt. With rewards R_i of the group's n responses:

    group-std  (GRPO):     A_i = (R_i - mean R) / (std R + eps)   unbiased std; std = 0 when n = 1
    none       (Dr.GRPO):  A_i =  R_i - mean R

and the estimators that look past the group (§13.4):

    rloo                  A_i = R_i - mean_{j != i} R_j = n/(n-1) (R_i - mean R)      0 when n = 1
    batch-std             A_i = (R_i - mean R) / (std over the batch of R + eps)      TRL scale_rewards=batch
    reinforce++           A_i = whiten_batch(R)_i                                    REINFORCE++ (outcome reward)
    reinforce++-baseline  A_i = whiten_batch(R - group mean R)_i

whiten_batch(x)_i = (x_i - m) / sqrt(v + 1e-8), m and v the mean and unbiased variance over the
batch's response tokens (each response weighted by its token count ``lengths``, or 1 without
it), as verl's ``masked_whiten``. Everything is float64; the group statistics are computed one
group at a time with the same tensor ops, so they do not depend on how the groups are laid out.

Any finite rewards give finite advantages, or a ValueError: rewards beyond 2^256 in magnitude
(whose squares, sums or spread would overflow float64, e.g. ±1e308) are divided by a power of
two s >= max|R| first (exactly), with the epsilons divided by s (by s^2 under the square root):
the same formulas, scale-free for group-std, batch-std and the whitened ones; none and rloo are
multiplied back by s, and an advantage no float can hold (rewards more than ~1.8e308 apart) is
refused. Ordinary rewards never take that path, so their advantages are bit for bit the plain
formulas'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from masktrl.methods.batch import check_choice

GROUP_NORMS = ("group-std", "none")
ADV_NORMS = GROUP_NORMS + ("rloo", "batch-std", "reinforce++", "reinforce++-baseline")
ADV_EPS = 1e-6  # added to the group std (GRPO) and the batch std
WHITEN_EPS = 1e-8  # added to the batch variance before its square root (REINFORCE++, verl's masked_whiten)
SCALE_ABOVE = 2.0**256  # rewards beyond this magnitude are scaled first (their squares and sums could overflow)
LINEAR_NORMS = ("none", "rloo")  # advantages proportional to the rewards' scale; the others are scale-free


def group_advantages(
    rewards: Sequence[float] | Tensor,
    groups: Sequence[int] | Tensor,
    *,
    norm: str = "group-std",
    eps: float = ADV_EPS,
    lengths: Sequence[int] | Tensor | None = None,
) -> Tensor:
    """[B] float64 advantages of B responses; ``groups`` [B] names each response's group.

    Responses of one group need not be contiguous; within a group their order is kept.
    ``norm``: one of ``ADV_NORMS`` (formulas in the module docstring and docs/METHODS.md §11, §13.4).
    A group whose rewards are all equal gets 0 from the group estimators up to the rounding of
    its mean (exactly 0 for 0/1 rewards); a group of one gets 0 from group-std, none and rloo.
    ``lengths`` [B]: each response's token count, the weights of the batch mean and variance of
    reinforce++ and reinforce++-baseline (None: every response weighs 1); read only by those two.
    """
    check_choice("norm", norm, ADV_NORMS)
    r = torch.as_tensor(rewards, dtype=torch.float64).detach().cpu()  # [B]; python floats exactly, no float32 detour
    g = torch.as_tensor(groups).detach().cpu()  # [B]
    if g.numel() == 0:
        g = g.long()
    if r.dim() != 1:
        raise ValueError(f"rewards must have shape [B], got {list(r.shape)}")
    if g.shape != r.shape:
        raise ValueError(f"groups must have the shape of rewards [{r.shape[0]}], got {list(g.shape)}")
    if g.is_floating_point() or g.is_complex():
        raise ValueError(f"groups must be integer ids, got {g.dtype}")
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite (found NaN or inf)")
    weights = _weights(lengths, r.shape[0])
    big = float(r.abs().max()) if r.numel() else 0.0
    if big <= SCALE_ABOVE:
        return _advantages(r, g, norm, eps, weights, WHITEN_EPS)
    scale = 2.0 ** min(math.ceil(math.log2(big)), 1023)  # a power of two: r / scale is exact, |r / scale| <= 2
    out = _advantages(r / scale, g, norm, eps / scale, weights, WHITEN_EPS / scale / scale)
    if norm in LINEAR_NORMS:
        out = out * scale
    if not bool(torch.isfinite(out).all()):
        raise ValueError(
            f"advantages are not finite: rewards from {r.min().item():.3g} to {r.max().item():.3g} "
            "are further "
            f"apart than the largest float (adv_norm={norm}); keep rewards within a "
            "sane range"
        )
    return out


def _advantages(r: Tensor, g: Tensor, norm: str, eps: float, weights: Tensor, whiten_eps: float) -> Tensor:
    if norm == "reinforce++":
        return _whiten(r, weights, whiten_eps)
    if norm == "batch-std":
        std = r.std() if r.shape[0] > 1 else torch.tensor(0.0, dtype=torch.float64)
        return _per_group(r, g, "none", eps) / (std + eps)
    if norm == "reinforce++-baseline":
        return _whiten(_per_group(r, g, "none", eps), weights, whiten_eps)
    return _per_group(r, g, norm, eps)


def _per_group(r: Tensor, g: Tensor, norm: str, eps: float) -> Tensor:
    out = torch.zeros_like(r)  # [B]
    for gid in torch.unique(g):
        idx = (g == gid).nonzero().squeeze(1)  # [n] in batch order
        group = r[idx]  # [n]
        n = group.shape[0]
        centred = group - group.mean()
        if norm == "group-std":
            std = group.std() if n > 1 else torch.tensor(0.0, dtype=torch.float64)
            centred = centred / (std + eps)
        elif norm == "rloo":  # R_i - (sum R - R_i) / (n - 1); a response alone has no baseline: 0
            centred = centred * (n / (n - 1)) if n > 1 else torch.zeros_like(centred)
        out[idx] = centred
    return out


def _weights(lengths, b: int) -> Tensor:
    if lengths is None:
        return torch.ones(b, dtype=torch.float64)
    w = torch.as_tensor(lengths).detach().cpu()
    if w.shape != (b,) or w.is_floating_point() or w.is_complex() or w.dtype == torch.bool:
        raise ValueError(f"lengths must be [B] = [{b}] integer token counts, got {w.dtype} {list(w.shape)}")
    if bool((w < 0).any()):
        raise ValueError("lengths must be >= 0")
    return w.to(torch.float64)


def _whiten(x: Tensor, w: Tensor, whiten_eps: float = WHITEN_EPS) -> Tensor:
    """(x - m) / sqrt(v + 1e-8) with the w-weighted mean m and unbiased variance
    v = sum w (x - m)^2 / (sum w - 1) (0 when sum w <= 1): verl's masked_whiten over tokens."""
    total = w.sum()
    if total <= 0:
        return torch.zeros_like(x)
    m = (w * x).sum() / total
    c = x - m
    v = (w * c * c).sum() / (total - 1) if total > 1 else torch.tensor(0.0, dtype=torch.float64)
    return c / torch.sqrt(v + whiten_eps)
