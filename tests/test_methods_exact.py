"""Exact full-vocabulary D and Ddot (docs/METHODS.md §4.5) against forward-mode autograd in float64,
the re-cut of top-K lists (§1.1), and the top-K estimators and bracket against the exact Ddot."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import jvp

from masktrl.methods import (
    TokenBatch,
    ddot_kl_bracket,
    divergence,
    divergence_full,
    divergence_rate,
    divergence_rate_full,
    truncate_topk,
)
from tests.test_methods_reference import (
    F64,
    NEG_INF,
    Row,
    full_div,
    kl_plain,
    make_batch,
    make_row,
    random_rows,
    ref_support,
    tv_plain,
)


def full_logps(rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mu_logp [N, V], pi_logp [N, V], sampled [N] of the rows."""
    return (
        torch.stack([r.mu_lp for r in rows]),
        torch.stack([r.pi_lp for r in rows]),
        torch.tensor([r.k for r in rows]),
    )


def jvp_ddot(r: Row, kind: str) -> float:
    """d/dt D(mu || softmax(z + t v)) at t = 0 with v = e_k - pi, by forward-mode autograd."""
    v = -torch.softmax(r.z, -1)
    v[r.k] += 1.0
    _, tangent = jvp(lambda z: full_div(r.mu_lp, z, kind), (r.z,), (v,))
    return float(tangent)


def close(a: float, b: float, tol: float = 1e-9) -> bool:
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= tol * max(1.0, abs(b))


# --------------------------------------------------------------------------- exact D and Ddot


@pytest.mark.parametrize("v", [2, 5, 40])
def test_exact_rate_equals_forward_mode_autograd(v):
    gen = torch.Generator().manual_seed(v)
    rows = [make_row(gen, v, 3, zero_mass=i % 3 == 0, peaked=i % 5 == 1, outside=i % 4 == 2) for i in range(60)]
    mu, pi, k = full_logps(rows)
    assert bool((mu == NEG_INF).any())  # zero-mass behaviour tokens are part of the check
    for kind in ("kl", "tv"):
        rate = divergence_rate_full(mu, pi, k, kind)
        assert rate.dtype == F64 and rate.shape == (60,)
        for i, r in enumerate(rows):
            assert close(float(rate[i]), jvp_ddot(r, kind), 1e-10), (kind, i)


def test_exact_divergence_equals_plain_sums_and_handles_zero_mass():
    gen = torch.Generator().manual_seed(3)
    rows = [make_row(gen, 9, 2, zero_mass=i % 2 == 0) for i in range(30)]
    mu, pi, _ = full_logps(rows)
    kl, tv = divergence_full(mu, pi, "kl"), divergence_full(mu, pi, "tv")
    for i, r in enumerate(rows):
        m, p = r.mu_lp.exp().tolist(), r.pi_lp.exp().tolist()
        assert close(float(kl[i]), kl_plain(m, p))
        assert close(float(tv[i]), tv_plain(m, p))
    # pi = 0 where mu > 0: KL = +inf; mu = pi = 0 on a token adds nothing (0 log 0 = 0)
    mu2 = torch.tensor([[0.5, 0.5, 0.0]], dtype=F64).log()
    pi2 = torch.tensor([[1.0, 0.0, 0.0]], dtype=F64).log()
    assert divergence_full(mu2, pi2, "kl")[0] == math.inf
    assert close(float(divergence_full(mu2, pi2, "tv")[0]), 0.5)
    pi3 = torch.tensor([[0.25, 0.75, 0.0]], dtype=F64).log()
    assert close(float(divergence_full(mu2, pi3, "kl")[0]), 0.5 * math.log(2) + 0.5 * math.log(2 / 3))
    # pi = e_k: v = 0, Ddot = 0 for both kinds
    pi_k = torch.tensor([[0.0, NEG_INF, NEG_INF]], dtype=F64)
    for kind in ("kl", "tv"):
        assert float(divergence_rate_full(mu2, pi_k, torch.tensor([0]), kind)[0]) == 0.0


def test_exact_functions_validate_inputs():
    mu = torch.zeros(2, 3, dtype=F64)
    with pytest.raises(ValueError, match="kind"):
        divergence_full(mu, mu, "js")
    with pytest.raises(ValueError, match="pi_logp"):
        divergence_full(mu, torch.zeros(3, dtype=F64), "kl")
    with pytest.raises(ValueError, match="same shape"):
        divergence_full(mu, torch.zeros(2, 4, dtype=F64), "tv")
    with pytest.raises(ValueError, match="sampled"):
        divergence_rate_full(mu, mu, torch.zeros(3, dtype=torch.long), "kl")
    with pytest.raises(ValueError, match="sampled"):
        divergence_rate_full(mu, mu, torch.zeros(2, dtype=F64), "kl")


@pytest.mark.parametrize("known_v", [True, False])
def test_estimators_equal_exact_when_support_is_the_vocabulary(known_v):
    v = 7
    rows = random_rows(11, 60, v, v) + random_rows(12, 60, v, v - 1, outside=True)
    rows = [r for r in rows if len(ref_support(r)) == v]  # K >= V, or K = V-1 with k appended
    assert len(rows) >= 40
    batch = make_batch(rows, v if known_v else None)
    mu, pi, k = full_logps(rows)
    for kind in ("kl", "tv"):
        exact = divergence_rate_full(mu, pi, k, kind)
        for tail in ("agg", "uniform") if known_v else ("agg",):
            assert torch.allclose(divergence_rate(batch, kind, tail), exact, rtol=1e-9, atol=1e-12), (kind, tail)
        d_exact = divergence_full(mu, pi, kind)
        assert torch.allclose(divergence(batch, "topk-" + kind), d_exact, rtol=1e-9, atol=1e-12)
    lo, hi = ddot_kl_bracket(batch)
    if known_v:  # m = 0: the bracket collapses onto the exact value
        exact = divergence_rate_full(mu, pi, k, "kl")
        assert torch.allclose(lo, exact, rtol=1e-9, atol=1e-12) and torch.allclose(hi, exact, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------- bracket vs exact


@pytest.mark.parametrize("known_v", [True, False])
@pytest.mark.parametrize("k_list", [1, 2, 4, 9])
def test_bracket_contains_exact_rate_on_real_topk_lists(k_list, known_v):
    v = 12  # K < V: real lists, with zero-mass atoms, k outside, peaked rows, padding and repeats
    rows = random_rows(100 + k_list, 150, v, k_list)
    batch = make_batch(rows, v if known_v else None)
    mu, pi, k = full_logps(rows)
    exact = divergence_rate_full(mu, pi, k, "kl")
    lo, hi = ddot_kl_bracket(batch)
    slack = 1e-12
    assert bool((lo - slack <= exact).all()) and bool((exact <= hi + slack).all())
    assert bool((lo < hi).any())  # a real tail: the bracket has width
    if known_v:  # the uniform estimate lies inside, the aggregated one not always
        uni = divergence_rate(batch, "kl", "uniform")
        assert bool((lo - slack <= uni).all()) and bool((uni <= hi + slack).all())


def test_bracket_contains_exact_rate_on_lists_recut_from_the_vocabulary():
    v = 10
    rows = random_rows(7, 120, v, v, padding=False, duplicates=False)  # full lists: K = V
    full = make_batch(rows, v)
    mu, pi, k = full_logps(rows)
    exact = divergence_rate_full(mu, pi, k, "kl")
    for k_new in (1, 2, 3, 5, 8):
        lo, hi = ddot_kl_bracket(truncate_topk(full, k_new))
        assert bool((lo - 1e-12 <= exact).all()) and bool((exact <= hi + 1e-12).all()), k_new


# --------------------------------------------------------------------------- truncate_topk


def recut_rows(rows: list[Row], k_new: int) -> list[Row]:
    """The rows as an engine asked for top-k_new would have recorded them (no junk)."""
    out = []
    for r in rows:
        seen, ids = set(), []
        for i in r.ids:
            if i >= 0 and i not in seen:
                seen.add(i)
                ids.append(i)
        ids = ids[:k_new]
        out.append(Row(r.z_mu, r.z, r.k, ids, [float(r.mu_lp[i]) for i in ids], [float(r.pi_lp[i]) for i in ids], ids))
    return out


@pytest.mark.parametrize("k_new", [1, 2, 3])
@pytest.mark.parametrize("rule", ["union", "replace_last"])
def test_truncate_topk_equals_a_list_recorded_at_the_smaller_k(k_new, rule):
    v = 9
    rows = random_rows(21, 120, v, 5)  # padding and repeated ids compact away first
    batch = make_batch(rows, v)
    cut = truncate_topk(batch, k_new)
    ref_rows = recut_rows(rows, k_new)
    ref = make_batch(ref_rows, v)
    ref = TokenBatch(
        ref.logp,
        ref.behavior_logp,
        ref.sampled_ids,
        torch.nn.functional.pad(ref.topk_ids, (0, k_new - ref.k), value=-1),
        torch.nn.functional.pad(ref.topk_behavior_logp, (0, k_new - ref.k), value=NEG_INF),
        torch.nn.functional.pad(ref.topk_logp, (0, k_new - ref.k), value=NEG_INF),
        ref.seq_ids,
        v,
    )
    assert cut.k == k_new and torch.equal(cut.topk_ids, ref.topk_ids)
    genuine = cut.topk_ids >= 0
    assert torch.equal(cut.topk_behavior_logp[genuine], ref.topk_behavior_logp[genuine])
    assert torch.equal(cut.topk_logp[genuine], ref.topk_logp[genuine])
    for kind in ("topk-kl", "topk-tv"):
        assert torch.equal(divergence(cut, kind, rule=rule), divergence(ref, kind, rule=rule))
    for kind in ("kl", "tv"):
        assert torch.equal(divergence_rate(cut, kind, "uniform"), divergence_rate(ref, kind, "uniform"))
    assert torch.equal(torch.stack(ddot_kl_bracket(cut)), torch.stack(ddot_kl_bracket(ref)))
    # the sampled token leaves the list when it ranked below k_new, and the rule then applies
    moved = [i for i, (r, rr) in enumerate(zip(rows, ref_rows)) if r.k in r.top and r.k not in rr.ids]
    assert moved and not bool((cut.topk_ids[moved] == cut.sampled_ids[moved, None]).any())


def test_truncate_topk_edge_cases():
    rows = random_rows(5, 10, 6, 3)
    b = make_batch(rows, 6)
    assert truncate_topk(b, b.k) is b and truncate_topk(b, 50) is b
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="k must be an int"):
            truncate_topk(b, bad)
    # an all-padding row stays all padding; zero-mass entries are real atoms and are kept
    ids = torch.tensor([[-1, -1, -1], [4, 2, 0]])
    mu = torch.tensor([[0.0, 0.0, 0.0], [math.log(0.9), NEG_INF, NEG_INF]], dtype=F64)
    pi = torch.tensor([[0.0, 0.0, 0.0], [math.log(0.5), math.log(0.2), math.log(0.1)]], dtype=F64)
    tb = TokenBatch(
        pi[:, 0], mu[:, 0].clone().fill_(math.log(0.9)), torch.tensor([1, 4]), ids, mu, pi, torch.arange(2), 6
    )
    cut = truncate_topk(tb, 2)
    assert cut.topk_ids.tolist() == [[-1, -1], [4, 2]]
    assert cut.topk_behavior_logp[1, 1] == NEG_INF
    # gradients through the listed training log-probabilities survive the re-cut
    lp = pi.clone().requires_grad_(True)
    tb2 = TokenBatch(tb.logp, tb.behavior_logp, tb.sampled_ids, ids, mu, lp, tb.seq_ids, 6)
    (g,) = torch.autograd.grad(truncate_topk(tb2, 2).topk_logp[1].sum(), lp)
    assert g[1].tolist() == [1.0, 1.0, 0.0]
