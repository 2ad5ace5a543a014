"""The aggregation denominator without a forward pass, ``Method.aggregate`` with a horizon that only
the constant-horizon mode reads, ``Method.denominator``, and the one kernel behind grpo and dapo
(docs/METHODS.md §2, §8)."""

from __future__ import annotations

import math

import pytest
import torch

from masktrl.methods import (
    AGG_MODES,
    TokenBatch,
    aggregate,
    aggregate_denominator,
    aggregate_denominator_from_counts,
    get_method,
    make_params,
    method_names,
    token_losses,
)

F64 = torch.float64
NEG_INF = float("-inf")


def batch_of(lengths: list[int], invalid: set[tuple[int, int]], seed: int = 0) -> tuple[TokenBatch, list[int]]:
    """Sequences of the given lengths, in shuffled token order; ``invalid`` holds (seq, pos) with
    log mu = -inf. Returns the batch and each sequence's valid-token count."""
    gen = torch.Generator().manual_seed(seed)
    seq = torch.tensor([s for s, n in enumerate(lengths) for _ in range(n)])
    pos = [(s, j) for s, n in enumerate(lengths) for j in range(n)]
    blp = torch.tensor([NEG_INF if p in invalid else -1.0 for p in pos], dtype=F64)
    perm = torch.randperm(len(pos), generator=gen)
    n = len(pos)
    lp = torch.full((n,), -0.9, dtype=F64)
    b = TokenBatch(
        lp,
        blp[perm],
        torch.zeros(n, dtype=torch.long),
        torch.zeros(n, 1, dtype=torch.long),
        blp[perm][:, None],
        lp[:, None],
        seq[perm] * 7 + 3,
    )  # seq ids need not be dense
    counts = [sum(1 for j in range(n_s) if (s, j) not in invalid) for s, n_s in enumerate(lengths)]
    return b, counts


@pytest.mark.parametrize("mode", AGG_MODES)
def test_denominator_from_counts_equals_the_built_batch(mode):
    lengths = [3, 1, 4, 2, 5, 1]
    invalid = {(0, 1), (1, 0), (3, 0), (3, 1), (4, 4)}  # sequence 1 and 3: no valid token
    b, counts = batch_of(lengths, invalid)
    assert counts == [2, 0, 4, 0, 4, 1]
    want = aggregate_denominator(b, mode)
    assert want == (11 if mode == "token-mean" else 4)
    assert aggregate_denominator_from_counts(counts, mode) == want
    assert aggregate_denominator_from_counts(torch.tensor(counts), mode) == want
    for name in method_names():  # the method's own mode, from counts or from the batch
        m, p = get_method(name), make_params(name, loss_agg=mode)
        assert m.denominator(p, counts) == m.denominator(p, b) == want
    assert aggregate_denominator_from_counts([], mode) == 0


def test_denominator_from_counts_validates():
    for bad in ([1, -1], [1.5], [True], torch.tensor([1.0]), torch.tensor([[1]])):
        with pytest.raises(ValueError, match="valid_counts"):
            aggregate_denominator_from_counts(bad, "token-mean")
    with pytest.raises(ValueError, match="mode"):
        aggregate_denominator_from_counts([1], "sum")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_method_aggregate_reads_the_horizon_only_where_the_mode_needs_it(mode):
    b, _ = batch_of([3, 2, 4], {(1, 1)}, seed=1)
    loss = torch.arange(1.0, b.n + 1, dtype=F64)
    for name in ("grpo", "dppo", "sis"):
        m, p = get_method(name), make_params(name, loss_agg=mode)
        h7, h20 = m.aggregate(p, loss, b, horizon=7), m.aggregate(p, loss, b, horizon=20)
        if mode == "seq-mean-token-sum-norm":
            assert torch.equal(h7, aggregate(loss, b, mode, norm_len=7))
            assert math.isclose(float(h7) / float(h20), 20 / 7, rel_tol=1e-12)
        else:
            assert torch.equal(h7, aggregate(loss, b, mode)) and torch.equal(h7, h20)
        for bad in (0, -3, None, math.nan, True):
            with pytest.raises(ValueError, match="horizon must be a positive number"):
                m.aggregate(p, loss, b, horizon=bad)  # checked in every mode, not only where it is read


def test_grpo_and_dapo_share_one_kernel():
    grpo, dapo = get_method("grpo"), get_method("dapo")
    assert grpo.kernel is dapo.kernel
    assert grpo.params_cls is not dapo.params_cls and grpo.help != dapo.help
    b, _ = batch_of([3, 3], set())
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0], dtype=F64)
    assert torch.equal(token_losses("grpo", b, adv).loss, token_losses("dapo", b, adv).loss)
