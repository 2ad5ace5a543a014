"""Batch aggregation of per-token losses and its denominator (docs/METHODS.md §8).

* ``aggregate(loss, batch, mode, norm_len=...)``: the scalar batch loss over valid tokens.
* ``aggregate_denominator(batch, mode)``: what ``aggregate`` divides by, from a built batch.
* ``aggregate_denominator_from_counts(valid_counts, mode)``: the same number from the valid-token
  count of each sequence, so a trainer can normalise a split batch before any forward pass.

``Method.aggregate`` and ``Method.denominator`` (registry) call these with the method's own mode,
so a trainer never names a mode.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from masktrl.methods.batch import TokenBatch, check_choice, seq_index

AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
HORIZON_MODES = ("seq-mean-token-sum-norm",)  # modes that divide by a constant horizon (Dr.GRPO)


def check_horizon(value, mode: str, name: str = "norm_len") -> float:
    """``value`` as a float; ValueError naming ``name`` unless it is a positive number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number (mode {mode!r}), got {value!r}")
    return float(value)


def aggregate(loss: Tensor, batch: TokenBatch, mode: str, *, norm_len: int | float | None = None) -> Tensor:
    """Scalar batch loss (§8) over valid tokens only (``behavior_logp > -inf``).

    * ``token-mean``: sum_t l_t / (number of valid tokens)                       (DAPO)
    * ``seq-mean-token-mean``: (1/G) sum_seq (1/|y|) sum_t l_t                   (GRPO, GSPO)
    * ``seq-mean-token-sum-norm``: (1/G) sum_seq sum_t l_t / norm_len            (Dr.GRPO)
    G counts sequences with at least one valid token; |y| is a sequence's valid-token count.
    ``norm_len`` is read only by ``seq-mean-token-sum-norm``. An empty batch (no valid token)
    gives 0, still connected to the graph.
    """
    check_choice("mode", mode, AGG_MODES)
    if not isinstance(loss, Tensor) or loss.shape != (batch.n,):
        raise ValueError(f"loss must have shape [N] = [{batch.n}], got {list(getattr(loss, 'shape', []))}")
    valid = batch.valid
    lv = torch.where(valid, loss, torch.zeros_like(loss))  # [N]
    if mode == "token-mean":
        return lv.sum() / valid.sum().clamp_min(1).to(lv.dtype)
    inv, g = seq_index(batch)
    sums = torch.zeros(g, dtype=lv.dtype, device=lv.device).index_add(0, inv, lv)  # [G]
    counts = torch.zeros(g, dtype=lv.dtype, device=lv.device).index_add_(0, inv, valid.to(lv.dtype))  # [G]
    n_seq = (counts > 0).sum().clamp_min(1).to(lv.dtype)
    if mode == "seq-mean-token-mean":
        return (sums / counts.clamp_min(1.0)).sum() / n_seq
    return sums.sum() / check_horizon(norm_len, mode) / n_seq


def aggregate_denominator(batch: TokenBatch, mode: str) -> int:
    """What ``aggregate`` divides by (before its clamp to 1), so a batch split across processes or
    micro-batches can be normalised by the whole batch's count (§8):

    * ``token-mean``: the number of valid tokens;
    * ``seq-mean-token-mean`` and ``seq-mean-token-sum-norm``: the number of sequences with at
      least one valid token.

    For a batch cut into parts along sequence boundaries, ``aggregate(whole)`` equals
    ``sum_parts aggregate(part) * denominator(part) / denominator(whole)``.
    """
    check_choice("mode", mode, AGG_MODES)
    valid = batch.valid
    if mode == "token-mean":
        return int(valid.sum())
    return int(torch.unique(batch.seq_ids[valid]).numel())


def aggregate_denominator_from_counts(valid_counts: Sequence[int] | Tensor, mode: str) -> int:
    """``aggregate_denominator`` from the number of valid tokens of each sequence (no forward pass).

    ``valid_counts``: one non-negative integer per sequence (a list or a 1-D integer tensor), e.g.
    the count of finite behaviour log-probabilities of each recorded response. Equals
    ``aggregate_denominator(batch, mode)`` on the batch built from those sequences.
    """
    check_choice("mode", mode, AGG_MODES)
    if isinstance(valid_counts, Tensor):
        if valid_counts.dim() != 1 or valid_counts.is_floating_point() or valid_counts.dtype == torch.bool:
            raise ValueError(
                f"valid_counts must be a 1-D integer tensor, got {valid_counts.dtype} {list(valid_counts.shape)}"
            )
        counts = [int(c) for c in valid_counts.tolist()]
    else:
        counts = list(valid_counts)
    for c in counts:
        if isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 0:
            raise ValueError(f"valid_counts must hold integers >= 0, got {c!r}")
    if mode == "token-mean":
        return int(sum(counts))
    return sum(1 for c in counts if c > 0)
