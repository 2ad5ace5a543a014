"""Group advantages from sequence rewards (docs/METHODS.md §11).

Every response of a group answers the same prompt. With rewards R_i of the group's n responses:

    group-std  (GRPO):     A_i = (R_i - mean R) / (std R + eps)   unbiased std; std = 0 when n = 1
    none       (Dr.GRPO):  A_i =  R_i - mean R

computed in float64, one group at a time with the same tensor ops, so the values do not depend
on how the groups are laid out in the batch.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from masktrl.methods.batch import check_choice

ADV_NORMS = ("group-std", "none")
ADV_EPS = 1e-6  # added to the group std (GRPO)


def group_advantages(rewards: Sequence[float] | Tensor, groups: Sequence[int] | Tensor, *, norm: str = "group-std",
                     eps: float = ADV_EPS) -> Tensor:
    """[B] float64 advantages of B responses; ``groups`` [B] names each response's group.

    Responses of one group need not be contiguous; within a group their order is kept.
    ``norm``: "group-std" (divide the centred reward by the group's unbiased std + ``eps``; a group
    of one has std 0) or "none" (centre only, Dr.GRPO). A group whose rewards are all equal gets
    0 up to the rounding of its mean (exactly 0 for 0/1 rewards).
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
    out = torch.zeros_like(r)  # [B]
    for gid in torch.unique(g):
        idx = (g == gid).nonzero().squeeze(1)  # [n] in batch order
        group = r[idx]  # [n]
        centred = group - group.mean()
        if norm == "group-std":
            std = group.std() if group.shape[0] > 1 else torch.tensor(0.0, dtype=torch.float64)
            centred = centred / (std + eps)
        out[idx] = centred
    return out
