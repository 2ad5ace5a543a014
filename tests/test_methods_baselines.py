"""The 2025-26 baselines (docs/METHODS.md §16) against transcriptions of their anchors' code, in
float64, with their gradients and limit cases.

Each ``*_anchor`` function below transcribes the anchor's own per-token loss in its padded
[B, T] layout (file and line at the commit the docs cite); masktrl's kernel runs on the same
tokens flattened.
"""

from __future__ import annotations

import math

import pytest
import torch

from masktrl.analysis.conformance import build, random_case, sampled_logp
from masktrl.methods import get_method, make_params, token_losses

F64 = torch.float64


def run(name: str, case, u=None, **params):
    """(loss [N], mask [N], grad d sum(l)/d log pi [N]) of method ``name`` on ``case``."""
    leaf = sampled_logp(case)
    batch = build(case, logp=leaf)
    m = get_method(name)
    p = m.make_params(**params)
    out = m.token_losses(batch, case.adv, p, u=case.u if m.needs_u(p) else None)
    (g,) = torch.autograd.grad(out.loss.sum(), leaf, allow_unused=True)
    g = torch.zeros_like(leaf) if g is None else g
    return out.loss.detach(), out.mask, g.detach(), batch


def padded(case, values: torch.Tensor) -> torch.Tensor:
    """[N] per-token values -> [B, T] rows per sequence, padding 0."""
    counts = torch.bincount(case.seq_ids)
    out = torch.zeros(counts.numel(), int(counts.max()), dtype=values.dtype)
    for s in range(counts.numel()):
        tok = torch.nonzero(case.seq_ids == s).flatten()
        out[s, : tok.numel()] = values[tok]
    return out


def unpad(case, rows: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [N] in the case's token order."""
    out = torch.zeros(case.n, dtype=rows.dtype)
    for s in range(rows.shape[0]):
        tok = torch.nonzero(case.seq_ids == s).flatten()
        out[tok] = rows[s, : tok.numel()]
    return out


def anchor_grad(case, fn):
    """(per-token loss, d sum(loss)/d log pi) of an anchor transcription ``fn(log_prob, old_log_prob,
    advantages, response_mask) -> [B, T] per-token loss``, on the case's valid tokens."""
    logp = padded(case, torch.log_softmax(case.z, -1).gather(1, case.sampled[:, None]).squeeze(1)).requires_grad_(True)
    mu = torch.log_softmax(case.z_mu, -1).gather(1, case.sampled[:, None]).squeeze(1)
    old = padded(case, torch.where(case.valid, mu, torch.zeros_like(mu)))
    adv = padded(case, case.adv)
    mask = padded(case, case.valid.to(F64))
    loss = fn(logp, old, adv, mask) * mask
    (g,) = torch.autograd.grad(loss.sum(), logp)
    return unpad(case, loss.detach()), unpad(case, g)


CASES = [random_case(s) for s in range(4)] + [random_case(50 + s, extreme=True) for s in range(2)]


# --------------------------------------------------------------------------- SAPO (§16.1)


def sapo_verl(log_prob, old_log_prob, advantages, response_mask, tau_pos=1.0, tau_neg=1.05):
    """verl b178a3cd, verl/trainer/ppo/core_algos.py:1329-1411 (compute_policy_loss_sapo):
    gate_function = sigmoid(tau (x - 1)) * (4 / tau); log ratio clamped to [-20, 20];
    taus = where(advantages > 0, tau_pos, tau_neg); pg_losses = -gates * advantages."""
    tau_pos = torch.as_tensor(tau_pos, dtype=advantages.dtype)
    tau_neg = torch.as_tensor(tau_neg, dtype=advantages.dtype)
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    return -gates * advantages


def sapo_trl(log_prob, old_log_prob, advantages, response_mask, pos=1.0, neg=1.05):
    """TRL f2cd5771, trl/trainer/grpo_trainer.py:3092-3095 (loss_type == "sapo"):
    temperatures = where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg);
    soft_coef_1 = sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures; no clamp of log r."""
    coef_1 = torch.exp(log_prob - old_log_prob)
    temperatures = torch.where(
        advantages > 0, torch.tensor(pos, dtype=F64), torch.tensor(neg, dtype=F64)
    )  # float64 here
    soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
    return -soft_coef_1 * advantages


@pytest.mark.parametrize("i", range(len(CASES)))
@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.3, 4.0)])
def test_sapo_matches_verl_and_trl(i, taus):
    case = CASES[i]
    loss, mask, g, _ = run("sapo", case, tau_pos=taus[0], tau_neg=taus[1])
    ref_loss, ref_g = anchor_grad(case, lambda *a: sapo_verl(*a, *taus))
    v = case.valid
    torch.testing.assert_close(loss[v], ref_loss[v], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g[v], ref_g[v], rtol=1e-10, atol=1e-12)
    assert bool(mask.eq(~v).all())  # nothing is blocked
    lr = (torch.log_softmax(case.z, -1) - torch.log_softmax(case.z_mu, -1)).gather(1, case.sampled[:, None]).squeeze(1)
    inside = v & (lr.abs() < 20)  # TRL does not clamp log r; inside the clamp the two anchors agree
    trl_loss, trl_g = anchor_grad(case, lambda *a: sapo_trl(*a, *taus))
    torch.testing.assert_close(loss[inside], trl_loss[inside], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g[inside], trl_g[inside], rtol=1e-10, atol=1e-12)


def test_sapo_gradient_is_the_gate_slope():
    """grad_coef = -A 4 s (1 - s) r (§16.1): slope 1 at r = 1, so the on-policy gradient is plain PG."""
    case = CASES[0]
    loss, _, g, batch = run("sapo", case)
    lr = batch.logp.detach() - batch.behavior_logp
    r = lr.exp()
    tau = torch.where(case.adv > 0, torch.tensor(1.0, dtype=F64), torch.tensor(1.05, dtype=F64))
    s = torch.sigmoid(tau * (r - 1))
    want = -case.adv * 4 * s * (1 - s) * r
    v = case.valid
    torch.testing.assert_close(g[v], want[v], rtol=1e-10, atol=1e-14)
    on = random_case(3, on_policy=True)
    _, _, g_on, _ = run("sapo", on)
    torch.testing.assert_close(g_on, -on.adv, rtol=1e-12, atol=1e-14)


def test_sapo_limits_small_and_large_tau():
    """tau -> 0: the gate's slope -> r, SAPO's gradient -> the unclipped importance-weighted PG
    (grpo with eps = inf). tau -> inf: the weight 4 s (1 - s) r vanishes for every r != 1 (a hard
    trust region of width ~1/tau on both sides) and stays 1 at r = 1."""
    case = CASES[1]
    _, _, g_small, batch = run("sapo", case, tau_pos=1e-7, tau_neg=1e-7)
    _, _, g_pg, _ = run("grpo", case, eps_low=1.0, eps_high=math.inf)
    v = case.valid
    torch.testing.assert_close(g_small[v], g_pg[v], rtol=1e-5, atol=1e-12)
    _, _, g_big, _ = run("sapo", case, tau_pos=1e4, tau_neg=1e4)
    r = (batch.logp.detach() - batch.behavior_logp).exp()
    far = v & ((r - 1).abs() > 0.01)  # |r - 1| tau > 100: weight < 4 r e^-100
    assert bool((g_big[far].abs() <= 1e-30 * (1 + r[far])).all())
    on = random_case(4, on_policy=True)
    _, _, g_on, _ = run("sapo", on, tau_pos=1e4, tau_neg=1e4)
    torch.testing.assert_close(g_on, -on.adv, rtol=1e-9, atol=1e-14)  # r = 1: the hard region's inside


def test_sapo_params_and_defaults():
    p = make_params("sapo")
    assert (p.tau_pos, p.tau_neg, p.loss_agg) == (1.0, 1.05, "seq-mean-token-mean")
    for bad in ({"tau_pos": 0}, {"tau_neg": -1.0}, {"tau_pos": math.inf}, {"tau_neg": "x"}):
        with pytest.raises(ValueError, match="method.tau_"):
            make_params("sapo", **bad)
    out = token_losses("sapo", build(CASES[0]), CASES[0].adv)
    assert out.divergence is None and out.log_w is not None


# --------------------------------------------------------------------------- GMPO (§16.2)


def gmpo_verl(log_prob, old_log_prob, advantages, response_mask, clip_low=0.4, clip_high=0.4):
    """verl b178a3cd, verl/trainer/ppo/core_algos.py:1635-1718 (compute_policy_loss_geo_mean):
    the clipped log ratio on the advantage's side (line 1686), ratio = exp(masked mean) and
    pg_losses = -advantage * ratio per sequence (line 1695), pg_loss = mean over sequences."""
    negative_approx_kl = log_prob - old_log_prob
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -clip_low, clip_high)
    negative_approx_kl_min = torch.min(sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp)
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    return torch.mean(-advantage * ratio)


@pytest.mark.parametrize("i", range(4))
def test_gmpo_matches_verl_geo_mean(i):
    case = CASES[i]
    leaf = sampled_logp(case)
    batch = build(case, logp=leaf)
    m, p = get_method("gmpo"), make_params("gmpo")
    ours = m.aggregate(p, m.token_losses(batch, case.adv, p).loss, batch, horizon=8)
    (g,) = torch.autograd.grad(ours, leaf)
    logp = padded(case, leaf.detach()).requires_grad_(True)
    mu = torch.log_softmax(case.z_mu, -1).gather(1, case.sampled[:, None]).squeeze(1)
    old = padded(case, torch.where(case.valid, mu, torch.zeros_like(mu)))
    ref = gmpo_verl(logp, old, padded(case, case.adv), padded(case, case.valid.to(F64)))
    (rg,) = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-7, atol=1e-10)  # verl's 1e-8 in the means
    v = case.valid
    torch.testing.assert_close(g[v], unpad(case, rg)[v], rtol=1e-7, atol=1e-10)


def test_gmpo_limit_one_token_sequences_are_grpo_in_log_space():
    """Sequences of one token: GMPO is PPO's clip with the bounds exp(-clip_low), exp(clip_high)."""
    case = random_case(9, max_len=1)
    _, _, g, _ = run("gmpo", case)
    _, _, g_ppo, _ = run("grpo", case, eps_low=1 - math.exp(-0.4), eps_high=math.exp(0.4) - 1)
    v = case.valid
    torch.testing.assert_close(g[v], g_ppo[v], rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- Clip-Cov, KL-Cov (§16.3, §16.4)


def clip_cov_verl_candidates(log_prob, old_log_prob, advantages, response_mask, eps=0.2, ratio=0.0002, lb=1.0, ub=5.0):
    """verl b178a3cd, verl/trainer/ppo/core_algos.py:1450-1552 (compute_policy_loss_clip_cov), up to
    the random draw: (max(pg_losses1, pg_losses2), the candidate tokens, clip_num). verl then zeroes
    the loss of clip_num candidates drawn with an unseeded torch.randperm (line 1535)."""
    ratio_t = torch.exp(log_prob - old_log_prob)
    pg_losses1 = -advantages * ratio_t
    pg_losses2 = -advantages * torch.clamp(ratio_t, 1 - eps, 1 + eps)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    mean_a = (advantages * response_mask).sum() / response_mask.sum()
    mean_lp = (log_prob.detach() * response_mask).sum() / response_mask.sum()
    cov_all = (advantages - mean_a) * (log_prob - mean_lp)
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(ratio * response_mask.sum().item()), 1)
    cand = (cov_all < ub) & (cov_all > lb) & (response_mask > 0)
    return torch.maximum(pg_losses1, pg_losses2), cand, clip_num


@pytest.mark.parametrize("ratio,lb", [(0.0002, 1.0), (0.2, 0.05), (0.5, -1e9)])
def test_clip_cov_zeroes_clip_num_of_verls_candidates(ratio, lb):
    """masktrl draws the clip_num tokens among verl's candidates with the smallest u (seeded)."""
    drawn = 0
    for case in CASES[:4]:
        loss, mask, g, batch = run("clip-cov", case, clip_cov_ratio=ratio, clip_cov_lb=lb)
        with torch.no_grad():
            ref, cand, clip_num = clip_cov_verl_candidates(
                padded(case, batch.logp.detach()),
                padded(case, torch.where(case.valid, batch.behavior_logp, torch.zeros_like(g))),
                padded(case, case.adv),
                padded(case, case.valid.to(F64)),
                ratio=ratio,
                lb=lb,
            )
        ref, cand = unpad(case, ref), unpad(case, cand.to(F64)).bool()
        v = case.valid
        _, pm, _, _ = run("grpo", case, eps_low=0.2, eps_high=0.2)
        chosen = mask & ~pm & v
        assert int(chosen.sum()) == min(clip_num, int(cand.sum()))
        assert bool((chosen <= cand).all())
        want = cand.nonzero().flatten()
        want = want[torch.argsort(case.u[want])[: int(chosen.sum())]]  # the smallest u among the candidates
        assert set(chosen.nonzero().flatten().tolist()) == set(want.tolist())
        assert bool((loss[chosen] == 0).all()) and bool((g[chosen] == 0).all())
        keep = v & ~chosen
        torch.testing.assert_close(loss[keep], ref[keep], rtol=1e-12, atol=1e-12)
        drawn += int(chosen.sum())
    assert drawn > 0 or lb >= 1.0  # the draw is exercised


def kl_cov_verl(log_prob, old_log_prob, advantages, response_mask, kl_cov_ratio=0.0002, ppo_kl_coef=0.1):
    """verl core_algos.py:1555-1632 (compute_policy_loss_kl_cov): pg_losses = -A r; on the
    top-k of (A - mean A)(log pi - mean log pi) over the valid tokens, -A r + coef |log r|."""
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl
    pg_losses = pg_losses1.clone()
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1)
    all_valid_logp = log_prob[all_valid].detach().reshape(-1)
    cov_lst_all = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
    k_percent_nums = max(1, int(len(cov_lst_all) * kl_cov_ratio))
    large_cov_idxs = all_valid_idx[torch.topk(cov_lst_all, k_percent_nums, largest=True).indices]
    w = advantages.shape[1]
    pg_losses[large_cov_idxs // w, large_cov_idxs % w] = pg_losses_kl[large_cov_idxs // w, large_cov_idxs % w]
    return pg_losses


@pytest.mark.parametrize("ratio", [0.0002, 0.3])
def test_kl_cov_matches_verl(ratio):
    for case in CASES:
        loss, _, g, _ = run("kl-cov", case, kl_cov_ratio=ratio)
        ref_loss, ref_g = anchor_grad(case, lambda *a: kl_cov_verl(*a, kl_cov_ratio=ratio))
        v = case.valid
        torch.testing.assert_close(loss[v], ref_loss[v], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g[v], ref_g[v], rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- TOPR (§16.5)


def topr_roll(log_prob, old_log_prob, advantages, response_mask, pos_w=1.0, neg_w=1.0):
    """ROLL 8eb27cc2, roll/pipeline/agentic/agentic_actor_pg_worker.py:260-349 (_compute_topr_loss):
    positive_loss = -A log pi (line 313), negative_loss = -sg(clamp(r, 0, 1)) A log pi (line 318).
    ROLL splits by the episode score > 0; here by A > 0 (the same split for {0,1} rewards)."""
    ratio = torch.exp(log_prob - old_log_prob)
    positive = (advantages > 0).to(F64)
    negative = 1.0 - positive
    clipped_ratio = torch.clamp(ratio, min=0.0, max=1.0).detach()
    return pos_w * (-advantages * log_prob * positive) + neg_w * (-clipped_ratio * advantages * log_prob * negative)


@pytest.mark.parametrize("weights", [(1.0, 1.0), (0.5, 2.0)])
def test_topr_gradient_matches_roll(weights):
    """The gradients agree; the values differ by design (ROLL's value is -c A log pi, masktrl's
    the §0 form -c A, as CISPO's)."""
    for case in CASES:
        _, _, g, _ = run("topr", case, positive_weight=weights[0], negative_weight=weights[1])
        _, ref_g = anchor_grad(case, lambda *a: topr_roll(*a, *weights))
        v = case.valid
        torch.testing.assert_close(g[v], ref_g[v], rtol=1e-12, atol=1e-14)


def test_topr_on_non_negative_advantages_is_reinforce():
    case = CASES[2]
    adv = case.adv.abs()
    leaf = sampled_logp(case)
    out = token_losses("topr", build(case, logp=leaf), adv)
    (g,) = torch.autograd.grad(out.loss.sum(), leaf)
    v = case.valid
    torch.testing.assert_close(g[v], -adv[v], rtol=0, atol=0)  # d(-A log pi)/d log pi, no importance weight


# --------------------------------------------------------------------------- M2PO (§16.6)


def m2po_areal_mask(old_logp, prox_logp, loss_mask, m2_threshold):
    """AReaL 4aef98d8, areal/trainer/ppo/actor.py:769-851 (_apply_m2po_masking, _get_m2po_loss_mask)."""
    delta = old_logp - prox_logp
    m2 = delta * delta
    mask_flat = loss_mask.view(-1)
    m2_selected = m2.view(-1)[mask_flat]
    sorted_m2, indices = torch.sort(m2_selected, descending=True)
    restored_indices = torch.argsort(indices)
    n = sorted_m2.numel()
    suffix_sums = sorted_m2.flip(0).cumsum(0).flip(0)
    counts = torch.arange(n, 0, -1, dtype=sorted_m2.dtype)
    below_threshold_indices = torch.where(suffix_sums / counts < m2_threshold)[0]
    num_to_mask = below_threshold_indices[0].item() if len(below_threshold_indices) > 0 else n - 1
    keep = torch.ones_like(sorted_m2, dtype=torch.bool)
    if num_to_mask > 0:
        keep[:num_to_mask] = False
    m2_full_flat = torch.zeros_like(mask_flat, dtype=torch.bool)
    m2_full_flat[mask_flat] = keep[restored_indices]
    return m2_full_flat.view_as(loss_mask)


@pytest.mark.parametrize("threshold", [0.04, 0.3, 1e9])
def test_m2po_mask_matches_areal_and_loss_is_masked_is(threshold):
    for case in CASES:
        loss, mask, g, batch = run("m2po", case, m2_threshold=threshold)
        v = case.valid
        lp = padded(case, batch.logp.detach())
        mu = torch.where(v, batch.behavior_logp, torch.zeros_like(batch.behavior_logp))
        keep = unpad(
            case, m2po_areal_mask(padded(case, mu), lp, padded(case, v.to(F64)).bool(), threshold).to(F64)
        ).bool()
        assert torch.equal(~mask[v], keep[v])
        r = (batch.logp.detach() - batch.behavior_logp).exp()
        want = torch.where(keep, -case.adv * r, torch.zeros_like(r))
        torch.testing.assert_close(g[v], want[v], rtol=1e-12, atol=0)
    on = random_case(5, on_policy=True)
    _, mask_on, g_on, _ = run("m2po", on)
    assert not bool(mask_on.any()) and torch.equal(g_on, -on.adv)  # mu = pi: M2 = 0, nothing masked


# --------------------------------------------------------------------------- prime-rl (§16.7, §16.8)


def prime_default(log_prob, old_log_prob, advantages, response_mask, low=0.2, high=0.2, adv_tau=1.0, kl_tau=1e-3):
    """prime-rl 559b4477, src/prime_rl/trainer/rl/loss.py:109-161 (default_loss_fn), per-token loss (line 146)."""
    log_importance_ratio = log_prob - old_log_prob
    importance_ratio = torch.exp(log_importance_ratio)
    probs_diff = torch.exp(log_prob) - torch.exp(old_log_prob)
    invalid = torch.where(advantages > 0, probs_diff > high, probs_diff < -low)
    keep_mask = response_mask.bool() & ~invalid
    pg_loss = keep_mask * (adv_tau * advantages) * importance_ratio
    kl_loss = response_mask * log_importance_ratio**2
    return -pg_loss + kl_tau * kl_loss


def prime_ipo(log_prob, old_log_prob, advantages, response_mask, threshold=0.1, adv_tau=1.0, kl_tau=1e-3):
    """prime-rl 559b4477, src/prime_rl/trainer/rl/loss.py:164-196 (ipo_loss_fn), per-token loss (line 185)."""
    log_importance_ratio = log_prob - old_log_prob
    importance_ratio = torch.exp(log_importance_ratio)
    keep_mask = response_mask.bool() & ~(torch.abs(torch.exp(log_prob) - torch.exp(old_log_prob)) > threshold)
    pg_loss = keep_mask * (adv_tau * advantages) * importance_ratio
    return -pg_loss + kl_tau * response_mask * log_importance_ratio**2


@pytest.mark.parametrize(
    "name,fn,kw",
    [
        ("prime-dppo", prime_default, {}),
        ("prime-dppo", prime_default, {"dppo_mask_low": 0.05, "dppo_mask_high": 0.3, "adv_tau": 0.5, "kl_tau": 0.1}),
        ("prime-ipo", prime_ipo, {}),
        ("prime-ipo", prime_ipo, {"ipo_threshold": 0.02, "kl_tau": 0.2}),
    ],
)
def test_prime_rl_losses_match(name, fn, kw):
    args = {
        "prime-dppo": ("dppo_mask_low", "dppo_mask_high", "adv_tau", "kl_tau"),
        "prime-ipo": ("ipo_threshold", "adv_tau", "kl_tau"),
    }[name]
    defaults = {"prime-dppo": (0.2, 0.2, 1.0, 1e-3), "prime-ipo": (0.1, 1.0, 1e-3)}[name]
    pos = [kw.get(a, d) for a, d in zip(args, defaults)]
    for case in CASES:
        loss, _, g, _ = run(name, case, **kw)
        ref_loss, ref_g = anchor_grad(case, lambda *a: fn(*a, *pos))
        v = case.valid
        torch.testing.assert_close(loss[v], ref_loss[v], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g[v], ref_g[v], rtol=1e-12, atol=1e-12)


def test_prime_dppo_limit_is_dppo_binary_tv_plus_the_kl_gradient():
    """kl_tau = 0: masktrl's dppo with divergence binary-tv and delta 0.2 (the same mask and weight)."""
    for case in CASES[:4]:
        _, m1, g1, _ = run("prime-dppo", case, kl_tau=0.0)
        _, m2, g2, _ = run("dppo", case, divergence="binary-tv", delta_pos=0.2, delta_neg=0.2)
        v = case.valid & (case.adv != 0)
        assert torch.equal(m1[v], m2[v])
        torch.testing.assert_close(g1[v], g2[v], rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- two-sided clip (§16.9)


def two_sided_trl(log_prob, old_log_prob, advantages, response_mask, eps=0.2, eps_high=0.2, delta=4.0):
    """TRL f2cd5771, trl/trainer/grpo_trainer.py:3083-3091: coef_2 = clamp(coef_1, 1 - eps, 1 + eps_high);
    coef_1 = clamp(coef_1, max=delta) (line 3087); -min(coef_1 A, coef_2 A)."""
    coef_1 = torch.exp(log_prob - old_log_prob)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps_high)
    coef_1 = torch.clamp(coef_1, max=delta)
    return -torch.min(coef_1 * advantages, coef_2 * advantages)


@pytest.mark.parametrize("delta", [4.0, 1.5])
def test_two_sided_matches_trl(delta):
    for case in CASES:
        loss, _, g, _ = run("two-sided", case, delta=delta)
        ref_loss, ref_g = anchor_grad(case, lambda *a: two_sided_trl(*a, delta=delta))
        v = case.valid
        torch.testing.assert_close(loss[v], ref_loss[v], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g[v], ref_g[v], rtol=1e-12, atol=1e-12)


def test_two_sided_with_infinite_delta_is_grpo():
    for case in CASES:
        a = run("two-sided", case, delta=math.inf)
        b = run("grpo", case, eps_low=0.2, eps_high=0.2)
        for x, y in zip(a[:3], b[:3]):
            assert torch.equal(x, y)
    with pytest.raises(ValueError, match="method.delta must be > 1 \\+ eps_high"):
        make_params("two-sided", delta=1.1)


# --------------------------------------------------------------------------- TRM (§16.10)


def trm_keep_verl(log_ratio, response_mask, threshold=0.01):
    """verl b178a3cd, verl/trainer/ppo/rollout_corr_helper.py:156-373 (compute_rollout_rejection_mask,
    option seq_max_k3, line 325): k3 of the clamped log ratio, the per-sequence max <= threshold keeps."""
    log_ratio_safe = torch.clamp(log_ratio, min=-20.0, max=20.0)
    token_k3 = torch.exp(log_ratio_safe) - 1.0 - log_ratio_safe
    masked = token_k3.masked_fill(~response_mask.bool(), float("-inf"))
    max_values = masked.max(dim=-1).values
    seq_stat = torch.where(max_values == float("-inf"), torch.zeros_like(max_values), max_values)
    return seq_stat <= threshold


@pytest.mark.parametrize("delta", [0.01, 0.5, math.inf])
def test_trm_masks_the_sequences_verl_rejects(delta):
    """TRM's paper (arXiv 2512.23075) was reachable only as its abstract, and no code of its own
    was read: the anchor transcribed here is verl's per-sequence maximum of k3, the estimator
    masktrl's trm uses by default (docs/METHODS.md §16.10)."""
    for case in CASES:
        loss, mask, g, batch = run("trm", case, delta=delta)
        v = case.valid
        lr = torch.where(v, batch.logp.detach() - batch.behavior_logp, torch.zeros_like(batch.logp))
        keep_seq = trm_keep_verl(padded(case, lr), padded(case, v.to(F64)), delta)
        keep = keep_seq[case.seq_ids]
        _, pm, pg, _ = run("grpo", case)
        assert torch.equal(mask[v], (pm | ~keep)[v])
        torch.testing.assert_close(g[v], torch.where(keep, pg, torch.zeros_like(pg))[v], rtol=0, atol=0)
    if math.isinf(delta):
        assert torch.equal(g, pg)  # delta = inf: grpo


def test_trm_topk_kl_uses_the_lists():
    case = CASES[0]
    _, mask, _, batch = run("trm", case, divergence="topk-kl", delta=0.05)
    from masktrl.methods import divergence

    d = divergence(batch, "topk-kl")
    for s in range(int(case.seq_ids.max()) + 1):
        tok = (case.seq_ids == s) & case.valid
        if bool(tok.any()) and float(d[tok].max()) > 0.05:
            assert bool(mask[tok].all())


# --------------------------------------------------------------------------- GPG (§16.11)


def gpg_verl(log_prob, old_log_prob, advantages, response_mask):
    """verl b178a3cd, verl/trainer/ppo/core_algos.py:1414-1447
    (compute_policy_loss_gpg): pg_losses = -log_prob * advantages."""
    return -log_prob * advantages


def test_gpg_gradient_matches_verl_and_is_topr_on_positive_advantages():
    for case in CASES:
        _, mask, g, _ = run("gpg", case)
        _, ref_g = anchor_grad(case, gpg_verl)
        v = case.valid
        torch.testing.assert_close(g[v], ref_g[v], rtol=0, atol=0)
        assert torch.equal(mask, ~v)
    case = CASES[0]
    adv = case.adv.abs()
    a = token_losses("gpg", build(case), adv).loss
    b = token_losses("topr", build(case), adv).loss
    assert torch.equal(a, b)
