"""token_diagnostics against per-token plain references; only valid tokens count."""

from __future__ import annotations

import math

import torch

from masktrl.methods import TokenBatch, make_params, token_losses
from masktrl.methods.diagnostics import token_diagnostics
from tests.test_methods_objectives import V, ref_ddot, ref_div
from tests.test_methods_reference import F64, NEG_INF, make_batch, random_rows, ref_genuine


def setup():
    rows = random_rows(700, 60, V, 3)
    b = make_batch(rows, V, seq_ids=torch.arange(60) // 6)
    gen = torch.Generator().manual_seed(7)
    adv = torch.randn(10, generator=gen, dtype=F64).repeat_interleave(6)
    bad = torch.zeros(60, dtype=torch.bool)
    bad[[3, 17, 40]] = True
    blp = b.behavior_logp.masked_fill(bad, NEG_INF)
    b = TokenBatch(b.logp, blp, b.sampled_ids, b.topk_ids, b.topk_behavior_logp, b.topk_logp, b.seq_ids, V)
    return rows, b, adv, ~bad, torch.rand(60, generator=gen, dtype=F64)


def check_common(res, rows, b, adv, keep, d_ref, dpos, dneg):
    idx = [i for i in range(len(rows)) if keep[i]]
    assert res["n_valid"] == len(idx)
    assert math.isclose(res["D_mean"], sum(d_ref[i] for i in idx) / len(idx), rel_tol=1e-9)
    over = [i for i in idx if d_ref[i] > (dpos if adv[i] > 0 else dneg)]
    assert math.isclose(res["frac_D_over_delta"], len(over) / len(idx), rel_tol=1e-12)
    ds = sorted(d_ref[i] for i in idx)
    assert math.isclose(res["D_p95"], ds[math.ceil(0.95 * (len(ds) - 1))], rel_tol=1e-9)
    log_r = {i: float(rows[i].pi_lp[rows[i].k] - rows[i].mu_lp[rows[i].k]) for i in idx}
    disagree = [i for i in over if math.copysign(1, ref_ddot(rows[i], "kl", "agg")) != math.copysign(1, log_r[i])]
    if over:
        assert math.isclose(res["ddot_ratio_disagree_frac"], len(disagree) / len(over), rel_tol=1e-12)
    resid = [1 - sum(math.exp(b_) for _, _, b_ in ref_genuine(rows[i])) for i in idx]
    assert math.isclose(res["topk_residual_mass_mean"], sum(resid) / len(idx), rel_tol=1e-9)
    ratios = [math.exp(log_r[i]) for i in idx]
    assert math.isclose(res["ratio_mean"], sum(ratios) / len(idx), rel_tol=1e-9)
    assert math.isclose(res["ratio_max"], max(ratios), rel_tol=1e-12)
    assert math.isclose(res["ppo_kl"], -sum(log_r.values()) / len(idx), rel_tol=1e-9)


def test_diagnostics_for_dppo_use_its_divergence_and_thresholds():
    rows, b, adv, keep, _ = setup()
    p = make_params("dppo", divergence="topk-tv", delta_neg=0.1)
    out = token_losses("dppo", b, adv, divergence="topk-tv", delta_neg=0.1)
    res = token_diagnostics(b, out, adv, p)
    d_ref = [ref_div(r, "topk-tv", "union", b.k) for r in rows]
    check_common(res, rows, b, adv, keep, d_ref, 0.15, 0.1)
    assert math.isclose(res["mask_frac"], float(out.mask[keep].double().mean()), rel_tol=1e-12)
    assert "sis_accept_rate" not in res
    assert all(isinstance(v, float) for v in res.values())


def test_diagnostics_for_grpo_and_sis_use_topk_kl():
    rows, b, adv, keep, u = setup()
    d_ref = [ref_div(r, "topk-kl", "union", b.k) for r in rows]
    out = token_losses("grpo", b, adv)
    res = token_diagnostics(b, out, adv, make_params("grpo"))
    check_common(res, rows, b, adv, keep, d_ref, 0.15, 0.15)  # default D > delta threshold without own deltas
    expected_mask = [bool(out.mask[i]) for i in range(60) if keep[i]]
    assert math.isclose(res["mask_frac"], sum(expected_mask) / len(expected_mask), rel_tol=1e-12)
    out = token_losses("sis", b, adv, u=u)
    res = token_diagnostics(b, out, adv, delta_pos=0.05, delta_neg=0.05)
    check_common(res, rows, b, adv, keep, d_ref, 0.05, 0.05)
    assert math.isclose(res["sis_accept_rate"], float(out.accepted[keep].double().mean()), rel_tol=1e-12)
    assert 0 < res["sis_accept_rate"] < 1


def test_diagnostics_of_an_all_invalid_batch():
    rows, b, adv, _, _ = setup()
    b = TokenBatch(
        b.logp,
        torch.full_like(b.behavior_logp, NEG_INF),
        b.sampled_ids,
        b.topk_ids,
        b.topk_behavior_logp,
        b.topk_logp,
        b.seq_ids,
        V,
    )
    assert token_diagnostics(b, token_losses("grpo", b, adv), adv) == {"n_valid": 0.0}


def ref_deviation(b, log_w, keep) -> float:
    """Mean over sequences with a valid token of sum_t |log w_t| (valid tokens), by plain loops."""
    per_seq: dict[int, float] = {}
    for i in range(b.n):
        if keep[i]:
            s = int(b.seq_ids[i])
            per_seq[s] = per_seq.get(s, 0.0) + abs(float(log_w[i]))
    return math.fsum(per_seq.values()) / len(per_seq)


def test_log_importance_deviation_with_and_without_sis():
    rows, b, adv, keep, u = setup()
    log_r = [float(rows[i].pi_lp[rows[i].k] - rows[i].mu_lp[rows[i].k]) for i in range(len(rows))]
    for name, kw in (("grpo", {}), ("dppo", {}), ("pdm", {"tail": "bracket"}), ("gspo", {})):
        res = token_diagnostics(b, token_losses(name, b, adv, **kw), adv)
        assert math.isclose(res["log_r_dev"], ref_deviation(b, log_r, keep), rel_tol=1e-12), name
        assert "log_w_dev" not in res
    for base in ("grpo", "gspo"):
        out = token_losses("sis", b, adv, u=u, base=base)
        res = token_diagnostics(b, out, adv, make_params("sis", base=base))
        log_w = [0.0 if bool(out.accepted[i]) else log_r[i] for i in range(len(rows))]
        assert math.isclose(res["log_w_dev"], ref_deviation(b, log_w, keep), rel_tol=1e-12)
        assert math.isclose(res["log_r_dev"], ref_deviation(b, log_r, keep), rel_tol=1e-12)
        assert 0 < res["log_w_dev"] < res["log_r_dev"]  # D_SIS <= D pathwise; strict once a token is accepted
    # SIS that accepts nothing has D_SIS = D
    out = token_losses("sis", b, adv, u=torch.ones_like(u))
    res = token_diagnostics(b, out, adv)
    assert res["log_w_dev"] == res["log_r_dev"]
    # a sequence without a valid token is not counted (sequence 0: all six tokens invalid)
    dead = keep.clone()
    dead[:6] = False
    b2 = TokenBatch(
        b.logp,
        b.behavior_logp.masked_fill(~dead, NEG_INF),
        b.sampled_ids,
        b.topk_ids,
        b.topk_behavior_logp,
        b.topk_logp,
        b.seq_ids,
        V,
    )
    res = token_diagnostics(b2, token_losses("grpo", b2, adv), adv)
    assert math.isclose(res["log_r_dev"], ref_deviation(b2, log_r, dead), rel_tol=1e-12)
    assert not math.isclose(res["log_r_dev"], ref_deviation(b, log_r, keep), rel_tol=1e-3)


def test_default_threshold_and_bracket_uncertainty():
    rows, b, adv, keep, _ = setup()
    d_ref = [ref_div(r, "topk-kl", "union", b.k) for r in rows]
    out = token_losses("pdm", b, adv, tail="bracket", delta_pos=0.05, delta_neg=0.05)
    res = token_diagnostics(b, out, adv, make_params("pdm", tail="bracket", delta_pos=0.05, delta_neg=0.05))
    over = [i for i in range(len(rows)) if keep[i] and d_ref[i] > 0.05 and adv[i] != 0]
    unsure = [i for i in over if float(out.ddot_lo[i]) <= 0 <= float(out.ddot_hi[i])]
    assert over and unsure
    assert math.isclose(res["ddot_uncertain_frac"], len(unsure) / len(over), rel_tol=1e-12)
    assert "ddot_uncertain_frac" not in token_diagnostics(b, token_losses("pdm", b, adv), adv)
    # without params (or a method without thresholds) D > delta uses 0.15
    res0 = token_diagnostics(b, token_losses("grpo", b, adv), adv)
    idx = [i for i in range(len(rows)) if keep[i]]
    assert math.isclose(res0["frac_D_over_delta"], sum(d_ref[i] > 0.15 for i in idx) / len(idx), rel_tol=1e-12)
