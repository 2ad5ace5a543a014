"""transformers' top-p (nucleus) cut without its full index sort, for masktrl's decode loops.

``TopPLogitsWarper`` sorts every row's scores with their indices (``torch.sort``), takes the
softmax of the sorted row and its cumulative sum from the smallest token up, and removes the
prefix whose cumulative probability is ``<= 1 - top_p`` (keeping the last ``min_tokens_to_keep``).
On a CPU that index sort is most of a top-p decode step at the lab's shapes (docs/BENCHMARKS.md,
"Top-p at the lab shape").

``SortFreeTopP`` gives the same scores, bit for bit. Only the sorted *values* enter the softmax
and the cumulative sum, so it sorts values alone (numpy's ``np.sort``, several times faster than
an index sort), takes the same softmax and cumulative sum of the same ascending row, and so finds
the same number ``n`` of removed tokens. Those are the row's ``n`` smallest scores: every score
below the first kept value ``v``, and, when scores tie with ``v`` across the cut, some of the tied
ones. Which tied tokens ``torch.sort`` puts first is its own (it is not stable on a CPU), so a row
with such a tie is handed to the warper itself. Anything else the warper covers (a tensor that is
not a float32 or float64 CPU tensor) goes to the warper too. tests/test_rollout_topp.py checks the
scores against the warper's on rows with heavy ties, ``-inf`` entries and non-finite rows.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.generation.logits_process import LogitsProcessorList, TopPLogitsWarper


class SortFreeTopP:
    """``TopPLogitsWarper(top_p, filter_value, min_tokens_to_keep)``'s scores without an index sort."""

    def __init__(self, warper: TopPLogitsWarper):
        self.warper = warper  # its top_p, filter_value and min_tokens_to_keep are read from it

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.device.type != "cpu" or scores.dtype not in (torch.float32, torch.float64) or scores.dim() != 2:
            return self.warper(input_ids, scores)
        with torch.no_grad():
            ascending = torch.from_numpy(np.sort(scores.detach().contiguous().numpy(), axis=-1))
            cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)  # [R, V], never decreasing
            n = self._removed(cumulative)  # [R, 1]: the warper's sorted_indices_to_remove is the first n
            if not bool(n.any()):
                return scores.clone()
            first_kept = ascending.gather(1, n)  # [R, 1] (n < V: at least one token is kept)
            cut = scores < first_kept  # [R, V]: every score below the first kept one is removed
            # rows whose cut runs through scores equal to first_kept: fewer than n scores lie below it
            tied = torch.searchsorted(ascending, first_kept, right=False) < n
            out = scores.masked_fill(cut, self.warper.filter_value)
            if bool(tied.any()):
                rows = tied.squeeze(1).nonzero().squeeze(1)
                ids = input_ids[rows] if input_ids is not None else None
                out[rows] = self.warper(ids, scores[rows])
        return out

    def _removed(self, cumulative: torch.Tensor) -> torch.Tensor:
        """[R, 1] how many of each row's smallest tokens the warper removes: the count of
        ``cumulative <= 1 - top_p`` (a prefix, as the cumulative sum never decreases), at most
        V - ``min_tokens_to_keep``; 0 for a row whose softmax is not a number. Found by binary
        search, then checked at the boundary with the warper's own comparison; a row that fails
        the check (none is known) is counted in full."""
        rows, vocab = cumulative.shape
        keep = self.warper.min_tokens_to_keep
        bound = 1 - self.warper.top_p
        limit = max(vocab - keep, 0)
        target = torch.full((rows, 1), bound, dtype=cumulative.dtype)
        n = torch.searchsorted(cumulative, target, right=True).clamp_max_(limit)
        undefined = cumulative[:, -1:].isnan()
        n = n.masked_fill_(undefined, 0)
        last_removed = cumulative.gather(1, (n - 1).clamp_min(0)) <= bound
        first_kept = cumulative.gather(1, n.clamp_max(vocab - 1)) <= bound
        wrong = ((n > 0) & ~last_removed) | ((n < limit) & first_kept & ~undefined)
        if bool(wrong.any()):
            full = cumulative <= bound
            full[..., -keep:] = False
            n = torch.where(wrong, full.sum(dim=-1, keepdim=True), n)
        return n


def sort_free(processors: LogitsProcessorList) -> LogitsProcessorList:
    """``processors`` with each ``TopPLogitsWarper`` in it computed by ``SortFreeTopP``."""
    return LogitsProcessorList(SortFreeTopP(p) if type(p) is TopPLogitsWarper else p for p in processors)
