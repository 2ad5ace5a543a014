"""Group advantages (docs/METHODS.md §11): bit-identical to the per-group GRPO formula, Dr.GRPO's
centring, the adv_norm parameter of every method."""

from __future__ import annotations

import math

import pytest
import torch

from masktrl.methods import get_method, group_advantages, make_params, method_names

F64 = torch.float64


def per_group_reference(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """The trainer's original per-group code, one group (a list of python floats) at a time."""
    r = torch.tensor(rewards, dtype=torch.float64)
    std = r.std() if len(rewards) > 1 else torch.tensor(0.0, dtype=torch.float64)
    return ((r - r.mean()) / (std + eps)).tolist()


def random_groups(seed: int):
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 3, 4, 8, 16, 5]
    rewards, groups = [], []
    for g, n in enumerate(sizes):
        kind = g % 3
        for _ in range(n):
            if kind == 0:
                rewards.append(float(torch.randint(0, 2, (1,), generator=gen)))  # 0/1 rewards
            elif kind == 1:
                rewards.append(float(torch.randn(1, generator=gen)) * 3.7 + 0.1)
            else:
                rewards.append(1.0 / 3.0)  # all equal
            groups.append(g)
    return rewards, groups, sizes


def test_group_std_is_bit_identical_to_the_per_group_formula():
    rewards, groups, sizes = random_groups(0)
    got = group_advantages(rewards, groups)
    assert got.dtype == F64 and got.shape == (len(rewards),)
    want, start = [], 0
    for n in sizes:
        want += per_group_reference(rewards[start : start + n])
        start += n
    assert got.tolist() == want  # bit for bit
    # interleaved (non-contiguous) groups, each group's own order kept: the same bits at each response
    rank = [groups[:i].count(g) for i, g in enumerate(groups)]
    perm = sorted(range(len(rewards)), key=lambda i: (rank[i], groups[i]))  # round robin over groups
    assert perm != sorted(perm)
    interleaved = group_advantages([rewards[i] for i in perm], torch.tensor([groups[i] for i in perm]))
    assert interleaved.tolist() == [want[i] for i in perm]


def test_by_hand_and_edge_cases():
    std = math.sqrt(4 * 0.25 / 3)  # unbiased std of [1, 0, 0, 1]
    a = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([5, 5, 5, 5]))
    assert torch.allclose(a, torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=F64) / (std + 1e-6), rtol=0, atol=1e-15)
    assert group_advantages([2.5], [0]).tolist() == [0.0]  # a group of one: std 0, centred 0
    assert group_advantages([1.0, 1.0, 1.0], [1, 1, 1]).tolist() == [0.0, 0.0, 0.0]
    # equal rewards whose mean rounds: the formula's own tiny value, not a special case
    assert group_advantages([0.7] * 3, [1] * 3).tolist() == per_group_reference([0.7] * 3)
    assert group_advantages([1.0, 3.0], [0, 0], eps=1.0).tolist() == pytest.approx(
        [-1 / (math.sqrt(2) + 1), 1 / (math.sqrt(2) + 1)]
    )
    dr = group_advantages([1.0, 0.0, 0.0, 1.0, 3.0, 5.0], [0, 0, 0, 0, 1, 1], norm="none")
    assert dr.tolist() == [0.5, -0.5, -0.5, 0.5, -1.0, 1.0]
    assert group_advantages([], [], norm="none").shape == (0,)


@pytest.mark.parametrize(
    "args,kw,match",
    [
        (([1.0, 2.0], [0, 0]), {"norm": "batch"}, "norm must be one of group-std, none"),
        (([1.0, 2.0], [0]), {}, "groups must have the shape"),
        (([[1.0, 2.0]], [[0, 0]]), {}, "rewards must have shape"),
        (([1.0, math.nan], [0, 0]), {}, "rewards must be finite"),
        (([1.0, 2.0], [0.0, 1.0]), {}, "groups must be integer"),
    ],
)
def test_bad_input_names_the_argument(args, kw, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(*args, **kw)


def test_every_method_has_adv_norm_and_method_advantages_uses_it():
    rewards, groups = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0], [0, 0, 0, 1, 1, 1]
    std_adv = group_advantages(rewards, groups)
    none_adv = group_advantages(rewards, groups, norm="none")
    assert not torch.equal(std_adv, none_adv)
    for name in method_names():
        m = get_method(name)
        assert torch.equal(m.advantages(make_params(name), rewards, groups), std_adv), name
        assert torch.equal(m.advantages(make_params(name, adv_norm="none"), rewards, groups), none_adv), name
        with pytest.raises(ValueError, match="method.adv_norm"):
            make_params(name, adv_norm="std")
    sis = make_params("sis", base="dapo", adv_norm="none")
    assert sis.base_params.adv_norm == "none" and sis.advantage_norm == "none"
    with pytest.raises(ValueError, match="DAPOParams"):
        get_method("dapo").advantages(make_params("grpo"), rewards, groups)
