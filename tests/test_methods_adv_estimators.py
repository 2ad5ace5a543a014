"""The advantage estimators beside group-std and none (docs/METHODS.md §13.4): rloo, batch-std,
reinforce++, reinforce++-baseline, each hand-computed, with the edge cases (a group of one,
all-equal rewards, n = 2, token weights) and their identities with the anchors' formulas."""

from __future__ import annotations

import math

import pytest
import torch

from masktrl.methods import ADV_NORMS, get_method, group_advantages, make_params, method_names

F64 = torch.float64
EPS = 1e-6


def test_every_estimator_is_a_value_of_adv_norm():
    assert set(ADV_NORMS) == {"group-std", "none", "rloo", "batch-std", "reinforce++", "reinforce++-baseline"}
    for name in method_names():
        for norm in ADV_NORMS:
            assert make_params(name, adv_norm=norm).advantage_norm == norm


def test_rloo_by_hand():
    # group 0: R = [1, 0, 0, 1] -> baselines (0+0+1)/3 = 1/3 for the ones, (1+0+1)/3 = 2/3 for the zeros
    # group 1 (n = 2): R = [3, 5] -> 3 - 5 = -2, 5 - 3 = 2;  group 2 (n = 1): no other response -> 0
    a = group_advantages([1.0, 0.0, 0.0, 1.0, 3.0, 5.0, 7.0], [0, 0, 0, 0, 1, 1, 2], norm="rloo")
    want = [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, -2.0, 2.0, 0.0]
    assert a.tolist() == pytest.approx(want, abs=1e-15)
    # verl's form n/(n-1) (R - mean) equals the leave-one-out form on random groups
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(12, generator=gen, dtype=F64)
    g = torch.tensor([0, 1, 2] * 4)
    got = group_advantages(r, g, norm="rloo")
    for i in range(12):
        others = [r[j] for j in range(12) if g[j] == g[i] and j != i]
        assert math.isclose(float(got[i]), float(r[i] - sum(others) / len(others)), abs_tol=1e-13)
    assert group_advantages([0.4] * 3, [0] * 3, norm="rloo").abs().max() < 1e-15  # all equal
    assert group_advantages([1.0, 1.0, 1.0], [0, 0, 0], norm="rloo").tolist() == [0.0, 0.0, 0.0]


def test_batch_std_by_hand():
    # group means 0.5 and 4; batch std of [1, 0, 3, 5] (unbiased): mean 2.25, var = (1.5625+5.0625+0.5625+7.5625)/3
    r, g = [1.0, 0.0, 3.0, 5.0], [0, 0, 1, 1]
    std = math.sqrt((1.5625 + 5.0625 + 0.5625 + 7.5625) / 3)
    got = group_advantages(r, g, norm="batch-std")
    assert got.tolist() == pytest.approx(
        [0.5 / (std + EPS), -0.5 / (std + EPS), -1 / (std + EPS), 1 / (std + EPS)], abs=1e-15
    )
    # TRL's scale_rewards="batch" (with our eps): centre per group, divide by the batch's reward std
    t = torch.tensor(r, dtype=F64)
    trl = (t - torch.tensor([0.5, 0.5, 4.0, 4.0], dtype=F64)) / (t.std() + EPS)
    assert torch.equal(got, trl)
    assert group_advantages([2.0], [0], norm="batch-std").tolist() == [0.0]  # batch of one: std 0, centred 0
    assert group_advantages([1.0, 1.0, 1.0, 1.0], [0, 0, 1, 1], norm="batch-std").tolist() == [0.0] * 4
    # one group: batch-std equals group-std
    assert torch.allclose(
        group_advantages([1.0, 0.0, 2.0], [0, 0, 0], norm="batch-std"),
        group_advantages([1.0, 0.0, 2.0], [0, 0, 0]),
        atol=0,
        rtol=1e-15,
    )


def masked_whiten_reference(rewards, lengths, baseline=None):
    """verl's masked_whiten on a [B, T] token matrix: every token of response i holds its (centred)
    reward; mean and unbiased variance over the mask, (x - mean) * rsqrt(var + 1e-8)."""
    t_max = max(lengths)
    x = torch.tensor(rewards, dtype=F64)
    if baseline is not None:
        x = x - torch.tensor(baseline, dtype=F64)
    vals = x[:, None].expand(len(rewards), t_max)
    mask = torch.tensor([[1.0] * n + [0.0] * (t_max - n) for n in lengths], dtype=F64)
    mean = (vals * mask).sum() / mask.sum()
    var = (((vals - mean) ** 2) * mask).sum() / mask.sum() * (mask.sum() / (mask.sum() - 1))
    white = (vals - mean) * torch.rsqrt(var + 1e-8)
    return [float(white[i, 0]) for i in range(len(rewards))]


def test_reinforce_pp_is_token_weighted_batch_whitening():
    r, g, lengths = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0], [0, 0, 0, 1, 1, 1], [3, 1, 5, 2, 2, 4]
    got = group_advantages(r, g, norm="reinforce++", lengths=lengths)
    assert got.tolist() == pytest.approx(masked_whiten_reference(r, lengths), abs=1e-12)
    # by hand without lengths: mean 0.5, unbiased var 0.3 -> (R - 0.5) / sqrt(0.3 + 1e-8); groups ignored
    plain = group_advantages(r, g, norm="reinforce++")
    s = math.sqrt(0.3 + 1e-8)
    assert plain.tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0.5 / s, -0.5 / s], abs=1e-15)
    assert torch.equal(plain, group_advantages(r, [0] * 6, norm="reinforce++"))
    assert group_advantages([0.0, 0.0, 0.0], [0, 1, 2], norm="reinforce++").tolist() == [0.0] * 3  # all equal
    assert group_advantages([3.0], [0], norm="reinforce++").tolist() == [0.0]  # one response: var 0, centred 0
    assert group_advantages([3.0, 1.0], [0, 0], norm="reinforce++", lengths=[1, 0]).tolist()[0] == 0.0  # one token


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens():
    r, g, lengths = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 2.0], [0, 0, 0, 1, 1, 1, 2], [3, 1, 5, 2, 2, 4, 6]
    base = [1 / 3, 1 / 3, 1 / 3, 2 / 3, 2 / 3, 2 / 3, 2.0]  # the group of one is its own mean: centred 0
    got = group_advantages(r, g, norm="reinforce++-baseline", lengths=lengths)
    assert got.tolist() == pytest.approx(masked_whiten_reference(r, lengths, base), abs=1e-12)
    # n = 2 by hand without lengths: centred [-1, 1, 0.5, -0.5], mean 0, var (1+1+0.25+0.25)/3
    two = group_advantages([0.0, 2.0, 3.0, 2.0], [0, 0, 1, 1], norm="reinforce++-baseline")
    s = math.sqrt(2.5 / 3 + 1e-8)
    assert two.tolist() == pytest.approx([-1 / s, 1 / s, 0.5 / s, -0.5 / s], abs=1e-15)
    assert group_advantages([1.0] * 4, [0, 0, 1, 1], norm="reinforce++-baseline").tolist() == [0.0] * 4


def test_method_advantages_passes_lengths_and_bad_lengths_are_named():
    r, g, lengths = [1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1], [1, 7, 2, 2]
    for name in method_names():
        m = get_method(name)
        p = make_params(name, adv_norm="reinforce++")
        assert torch.equal(m.advantages(p, r, g, lengths), group_advantages(r, g, norm="reinforce++", lengths=lengths))
        # lengths are read only by the reinforce++ estimators
        q = make_params(name, adv_norm="rloo")
        assert torch.equal(m.advantages(q, r, g, lengths), m.advantages(q, r, g))
    with pytest.raises(ValueError, match="lengths must be"):
        group_advantages(r, g, norm="reinforce++", lengths=[1, 2])
    with pytest.raises(ValueError, match="lengths must be"):
        group_advantages(r, g, norm="reinforce++", lengths=[1.0, 2.0, 3.0, 4.0])
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        group_advantages(r, g, norm="reinforce++", lengths=[1, -2, 3, 4])
    with pytest.raises(ValueError, match="method.adv_norm must be one of"):
        make_params("grpo", adv_norm="reinforce_plus_plus")
