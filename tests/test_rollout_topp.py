"""rollout/topp.py: SortFreeTopP gives transformers' TopPLogitsWarper's scores bit for bit."""

import math

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from masktrl.rollout.topp import SortFreeTopP, sort_free


def rows(kind: str, n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 3
    if kind == "ties":  # few distinct values: cuts through runs of equal scores
        x = torch.round(x)
    elif kind == "coarse ties":
        x = torch.round(x / 4)
    elif kind == "peaked":
        x[:, 0] += 40
    elif kind == "masked":  # an earlier top-k cut: most entries -inf
        keep = x.topk(min(7, vocab), dim=-1).indices
        x = torch.full_like(x, -math.inf).scatter(1, keep, x.gather(1, keep))
    return x


@pytest.mark.parametrize("kind", ["plain", "ties", "coarse ties", "peaked", "masked"])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999, 1.0])
@pytest.mark.parametrize("keep", [1, 3])
@pytest.mark.parametrize("vocab", [17, 2004])
def test_scores_equal_the_warpers_bit_for_bit(kind, top_p, keep, vocab):
    x = rows(kind, 96, vocab, seed=vocab + keep)
    warper = TopPLogitsWarper(top_p, min_tokens_to_keep=keep)
    want = warper(None, x)
    got = SortFreeTopP(warper)(None, x)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got.nan_to_num(neginf=0.0), want.nan_to_num(neginf=0.0))
    if kind in ("plain", "ties") and top_p <= 0.95:
        assert torch.isinf(want).any()  # the cut removed tokens


def test_float64_rows_a_filter_value_and_non_finite_rows():
    x = rows("ties", 40, 300, seed=5).double()
    x[3] = -math.inf  # all -inf: the softmax is NaN, nothing is removed
    x[4, 7] = math.nan
    x[5] = math.inf
    warper = TopPLogitsWarper(0.8, filter_value=-1e4)
    want, got = warper(None, x), SortFreeTopP(warper)(None, x)
    assert torch.equal(want.isnan(), got.isnan())
    assert torch.equal(want.nan_to_num(nan=7.0), got.nan_to_num(nan=7.0))


def test_the_tied_rows_the_warper_decides_are_its_own_rows_of_the_batch():
    """Rows whose cut runs through a tie are handed to the warper alone; its sort of one row does
    not depend on the rows around it."""
    x = rows("coarse ties", 200, 50, seed=1)
    warper = TopPLogitsWarper(0.7)
    whole = warper(None, x)
    for r in range(0, 200, 7):
        assert torch.equal(warper(None, x[r : r + 1]), whole[r : r + 1])


def test_sort_free_replaces_only_the_top_p_warper():
    temp, top_p = TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)
    out = sort_free(LogitsProcessorList([temp, top_p]))
    assert out[0] is temp and isinstance(out[1], SortFreeTopP) and out[1].warper is top_p
    x = rows("plain", 8, 100, seed=2)
    assert torch.equal(out(None, x), LogitsProcessorList([temp, top_p])(None, x))


def test_rows_cut_through_a_tie_go_to_the_warper_and_the_others_do_not():
    x = rows("coarse ties", 300, 40, seed=3)
    warper = TopPLogitsWarper(0.6)
    seen = []

    class Counting(TopPLogitsWarper):
        def __call__(self, input_ids, scores):
            seen.append(scores.shape[0])
            return super().__call__(input_ids, scores)

    got = SortFreeTopP(Counting(0.6))(None, x)
    assert torch.equal(got.nan_to_num(neginf=0.0), warper(None, x).nan_to_num(neginf=0.0))
    assert len(seen) == 1 and 0 < seen[0] < 300  # some rows, not all, were the warper's


def full_count(cumulative, top_p, keep):
    """The warper's own count of removed tokens: its mask, summed."""
    remove = cumulative <= (1 - top_p)
    remove[..., -keep:] = False
    return remove.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("top_p, keep", [(0.9, 1), (0.3, 2), (0.9, 50)])
def test_the_binary_search_counts_what_the_warpers_mask_counts(top_p, keep):
    """Including cumulative sums exactly at the bound 1 - top_p (as float32) and one step either
    side of it, rows that are not numbers, and more tokens to keep than the row has."""
    g = torch.Generator().manual_seed(0)
    cum = torch.rand(60, 40, generator=g).cumsum(-1)
    cum = cum / cum[:, -1:]
    bound = torch.tensor(1 - top_p, dtype=torch.float32)
    for r, at in enumerate(range(0, 39, 2)):  # put the bound itself, or a neighbour, into the rows
        v = [bound, torch.nextafter(bound, torch.tensor(0.0)), torch.nextafter(bound, torch.tensor(2.0))][r % 3]
        cum[r, at] = v
        cum[r, :at] = torch.minimum(cum[r, :at], v)
        cum[r, at + 1 :] = torch.maximum(cum[r, at + 1 :], v)
    cum[50] = math.nan
    got = SortFreeTopP(TopPLogitsWarper(top_p, min_tokens_to_keep=keep))._removed(cum)
    assert torch.equal(got, full_count(cum, top_p, keep))


def test_a_count_the_boundary_check_rejects_is_counted_in_full(monkeypatch):
    cum = torch.linspace(0.01, 1.0, 30).expand(4, 30).contiguous()
    warper = SortFreeTopP(TopPLogitsWarper(0.5))
    monkeypatch.setattr(torch, "searchsorted", lambda *a, **k: torch.tensor([[0], [3], [29], [14]]))
    assert torch.equal(warper._removed(cum), full_count(cum, 0.5, 1))
