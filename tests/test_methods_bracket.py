"""The certified-sign predictive mask, pdm with tail=bracket (docs/METHODS.md §4.6): hand-computed
cases, the sandwich keep ⊆ exact ⊆ mask against the exact Ddot, and its parameter checks."""

from __future__ import annotations

import math

import pytest
import torch

from masktrl.methods import TokenBatch, divergence, divergence_rate_full, make_params, token_losses
from tests.test_methods_reference import F64, make_batch, random_rows


def hand_batch(mu_v, pi_v, k, adv_list):
    """One copy of (mu, pi, list [0, 1], sampled k) per advantage; V = 4."""
    mu, pi = torch.tensor(mu_v, dtype=F64), torch.tensor(pi_v, dtype=F64)
    n = len(adv_list)
    ids = torch.tensor([[0, 1]] * n)
    b = TokenBatch(
        pi[[k] * n].log(), mu[[k] * n].log(), torch.full((n,), k), ids, mu[ids].log(), pi[ids].log(), torch.arange(n), 4
    )
    return b, torch.tensor(adv_list, dtype=F64)


def test_hand_computed_certified_case():
    # S = {0, 1}, k = 1: base = (0.4-0.3) - (0.3(0.3-0.5) + 0.4(0.4-0.3)) = 0.12; pi_T = 0.3, mu_T = 0.2,
    # m = 2, mu_cap = 0.3: lo = 0.12 - 0.09 = 0.03, hi = 0.12 - 0.045 + 0.3*0.2 = 0.135 (exact 0.105)
    b, adv = hand_batch([0.5, 0.3, 0.15, 0.05], [0.3, 0.4, 0.2, 0.1], 1, [1.0, -1.0, 0.0])
    d = 0.5 * math.log(0.5 / 0.3) + 0.3 * math.log(0.3 / 0.4) + 0.2 * math.log(0.2 / 0.3)  # 0.088
    for unc in ("keep", "mask"):
        out = token_losses("pdm", b, adv, tail="bracket", uncertain=unc, delta_pos=0.05, delta_neg=0.05)
        assert torch.allclose(out.ddot_lo, torch.full((3,), 0.03, dtype=F64), atol=1e-12)
        assert torch.allclose(out.ddot_hi, torch.full((3,), 0.135, dtype=F64), atol=1e-12)
        assert torch.allclose(out.divergence, torch.full((3,), d, dtype=F64), atol=1e-12)
        assert out.ddot is None
        assert out.mask.tolist() == [True, False, False]  # certified increase for A > 0 only
        r = 0.4 / 0.3
        assert torch.allclose(out.loss, torch.tensor([0.0, r, 0.0], dtype=F64), atol=1e-12)  # -A (1-mask) r
    # D = 0.088 is below the default delta 0.15: nothing is masked
    assert not bool(token_losses("pdm", b, adv, tail="bracket").mask.any())


def test_hand_computed_uncertain_case():
    # k = 0: base = -0.05 + 0.0425 = -0.0075; pi_T = 0.35, mu_T = 0.2, m = 2, mu_cap = 0.3:
    # lo = -0.0075 - 0.1225 = -0.13, hi = -0.0075 - 0.06125 + 0.07 = 0.00125 (exact -0.0775)
    b, adv = hand_batch([0.5, 0.3, 0.15, 0.05], [0.45, 0.2, 0.05, 0.3], 0, [1.0, -1.0])
    kw = {"tail": "bracket", "delta_pos": 0.05, "delta_neg": 0.05}  # D = 0.0624 > 0.05
    keep = token_losses("pdm", b, adv, **kw)
    mask = token_losses("pdm", b, adv, uncertain="mask", **kw)
    assert torch.allclose(keep.ddot_lo, torch.full((2,), -0.13, dtype=F64), atol=1e-12)
    assert torch.allclose(keep.ddot_hi, torch.full((2,), 0.00125, dtype=F64), atol=1e-12)
    assert keep.mask.tolist() == [False, False]  # the sign is not certified: kept
    assert mask.mask.tolist() == [True, True]  # not certified safe: masked
    exact = float(
        divergence_rate_full(
            torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=F64).log(),
            torch.tensor([[0.45, 0.2, 0.05, 0.3]], dtype=F64).log(),
            torch.tensor([0]),
            "kl",
        )[0]
    )
    assert abs(exact - (-0.0775)) < 1e-12  # so the exact rule masks A < 0 only


@pytest.mark.parametrize("known_v", [True, False])
def test_keep_within_exact_within_mask(known_v):
    v = 12
    rows = random_rows(31, 400, v, 3)
    batch = make_batch(rows, v if known_v else None)
    gen = torch.Generator().manual_seed(2)
    adv = torch.randn(len(rows), generator=gen, dtype=F64)
    adv[::17] = 0.0
    mu = torch.stack([r.mu_lp for r in rows])
    pi = torch.stack([r.pi_lp for r in rows])
    exact = divergence_rate_full(mu, pi, batch.sampled_ids, "kl")
    delta = 0.02
    over = divergence(batch, "topk-kl") > delta
    exact_mask = over & (adv * torch.sign(exact) > 0)
    kw = {"tail": "bracket", "delta_pos": delta, "delta_neg": delta}
    keep = token_losses("pdm", batch, adv, **kw)
    mask = token_losses("pdm", batch, adv, uncertain="mask", **kw)
    assert bool((keep.mask <= exact_mask).all())  # keep never masks a token the exact rule keeps
    assert bool((exact_mask <= mask.mask).all())  # mask never keeps a token the exact rule masks
    certified = (keep.ddot_lo > 0) | (keep.ddot_hi < 0)
    assert torch.equal(keep.mask[certified], exact_mask[certified])
    assert torch.equal(mask.mask[certified], exact_mask[certified])
    assert bool((keep.mask != mask.mask).any())  # the uncertain case occurs here
    assert not bool(keep.mask[adv == 0].any() | mask.mask[adv == 0].any())


def test_bracket_equals_exact_pdm_when_the_list_is_the_vocabulary():
    v = 6
    rows = random_rows(41, 100, v, v)
    batch = make_batch(rows, v)
    adv = torch.randn(len(rows), generator=torch.Generator().manual_seed(0), dtype=F64)
    kw = {"delta_pos": 0.01, "delta_neg": 0.01}
    ref = token_losses("pdm", batch, adv, tail="uniform", **kw).mask
    for unc in ("keep", "mask"):
        assert torch.equal(token_losses("pdm", batch, adv, tail="bracket", uncertain=unc, **kw).mask, ref)


@pytest.mark.parametrize(
    "kw,key",
    [
        ({"tail": "bracket", "divergence": "tv"}, "method.tail=bracket requires method.divergence=kl"),
        ({"tail": "agg", "uncertain": "keep"}, "method.uncertain applies only with method.tail=bracket"),
        ({"tail": "bracket", "uncertain": "maybe"}, "method.uncertain must be one of keep, mask"),
        ({"tail": "exactly"}, "method.tail must be one of agg, uniform, bracket, exact"),
    ],
)
def test_bracket_params_are_validated(kw, key):
    with pytest.raises(ValueError, match=key):
        make_params("pdm", **kw)


def test_bracket_defaults():
    p = make_params("pdm", tail="bracket")
    assert p.uncertain_rule == "keep" and p.deltas == (0.15, 0.15)
    assert make_params("pdm", tail="bracket", uncertain="mask").uncertain_rule == "mask"
