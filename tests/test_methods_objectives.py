"""Per-token losses and their gradients (docs/METHODS.md §0, §2-6), limit cases, aggregation (§8), invalid tokens."""

from __future__ import annotations

import math

import pytest
import torch

from masktrl.methods import (
    TokenBatch,
    aggregate,
    aggregate_denominator,
    get_method,
    make_params,
    overlong_penalty,
    token_losses,
)
from tests.test_methods_reference import (
    F64,
    NEG_INF,
    batch_from_logits,
    ddot_kl_plain,
    ddot_tv_plain,
    kl_plain,
    random_rows,
    ref_bracket,
    ref_genuine,
    ref_support,
    ref_tails,
    tv_plain,
)

V, K_LIST, SEQ_LEN = 8, 3, 6

VARIANTS = [
    ("grpo", {}),
    ("grpo", {"dual_clip": 1.2}),
    ("dapo", {}),
    ("dapo", {"dual_clip": 1.5}),
    ("gspo", {}),
    ("gspo", {"eps_low": 0.1, "eps_high": 0.1}),
    *[("dppo", {"divergence": d}) for d in ("binary-tv", "binary-kl", "topk-tv", "topk-kl")],
    ("dppo", {"divergence": "topk-tv", "rule": "replace_last", "ratio_cap": 1.3}),
    ("dppo", {"divergence": "topk-kl", "delta_pos": 0.02, "delta_neg": 0.2}),
    *[("pdm", {"divergence": d, "tail": t}) for d in ("kl", "tv") for t in ("agg", "uniform")],
    ("pdm", {"tail": "bracket"}),
    ("pdm", {"tail": "bracket", "uncertain": "mask", "delta_pos": 0.05, "delta_neg": 0.3}),
    *[("sis", {"base": b}) for b in ("grpo", "dapo", "gspo")],
    ("sis", {"base": "gspo", "eps_low": 0.1, "eps_high": 0.1}),
    ("sis", {"base": "grpo", "dual_clip": 1.2}),
    ("cispo", {}),
    ("cispo", {"eps_low": 0.2, "eps_high": 0.28}),
]


# --------------------------------------------------------------------------- plain reference


def ref_div(r, kind: str, rule: str, k_slots: int) -> float:
    mk, pk = math.exp(float(r.mu_lp[r.k])), math.exp(float(r.pi_lp[r.k]))
    if kind == "binary-tv":
        return abs(pk - mk)
    if kind == "binary-kl":
        return kl_plain([mk, 1 - mk], [pk, 1 - pk])
    atoms = ref_support(r, rule, k_slots)
    mu_t, pi_t, _ = ref_tails(atoms, V)
    mu = [math.exp(a) for _, a, _ in atoms] + [mu_t]
    pi = [math.exp(b) for _, _, b in atoms] + [pi_t]
    return kl_plain(mu, pi, floor_last=True) if kind.endswith("kl") else tv_plain(mu, pi)


def ref_ddot(r, kind: str, tail: str) -> float:
    atoms = ref_support(r)
    mu_t, pi_t, m = ref_tails(atoms, V)
    mu = [math.exp(a) for _, a, _ in atoms]
    pi = [math.exp(b) for _, _, b in atoms]
    mult = [1.0] * len(atoms)
    if m:
        mu, pi, mult = mu + [mu_t], pi + [pi_t], mult + [float(m) if tail == "uniform" else 1.0]
    k_idx = [a for a, _, _ in atoms].index(r.k)
    return (ddot_kl_plain if kind == "kl" else ddot_tv_plain)(mu, pi, k_idx, mult)


def ref_accept(r, u: float) -> bool:
    g = [(i, a, b) for i, a, b in ref_genuine(r) if a > NEG_INF]
    if r.k not in [i for i, _, _ in g]:
        return False
    log_m = max(b - a for _, a, b in g)
    log_r = float(r.pi_lp[r.k] - r.mu_lp[r.k])
    return u < math.exp(min(0.0, log_r - log_m))


def ppo_ref(w: float, a: float, el: float, eh: float, c: float | None = None) -> tuple[float, float, bool]:
    """(loss, grad_coef w.r.t. log w, mask) of §2 written per case; c: the dual clip (verl's
    min(max(-A w, -A clip(w)), -A c) for A < 0)."""
    mask = (a > 0 and w > 1 + eh) or (a < 0 and w < 1 - el)
    loss = -min(w * a, min(max(w, 1 - el), 1 + eh) * a)
    if c is not None and a < 0:
        mask = mask or w > c
        loss = min(loss, -a * c)
    return loss, (0.0 if mask else -a * w), mask


def reference(name: str, kw: dict, rows, adv, u, k_slots: int):
    """Per-token (loss, grad_coef, mask) lists from the formulas of docs/METHODS.md, token by token."""
    p = make_params(name, **kw)
    n = len(rows)
    log_r = [float(r.pi_lp[r.k] - r.mu_lp[r.k]) for r in rows]
    out = []
    if name in ("grpo", "dapo"):
        return [ppo_ref(math.exp(lr), a, p.eps_low, p.eps_high, p.dual_clip) for lr, a in zip(log_r, adv)]
    if name == "cispo":  # l = -A sg(clip(r)) log pi: value -A clip(r), nothing blocked (§14)
        return [
            (-a * min(max(math.exp(lr), 1 - p.eps_low), 1 + p.eps_high),) * 2 + (False,) for lr, a in zip(log_r, adv)
        ]
    if name in ("dppo", "pdm"):
        dpos, dneg = p.deltas
        for i, r in enumerate(rows):
            a = adv[i]
            if name == "dppo":
                d, direction = ref_div(r, p.divergence, p.rule, k_slots), log_r[i]
            elif p.tail != "bracket":
                d, direction = ref_div(r, "topk-" + p.divergence, "union", k_slots), ref_ddot(r, p.divergence, p.tail)
            else:  # certified sign: keep decides by the bound nearer 0, mask by the farther one
                d = ref_div(r, "topk-kl", "union", k_slots)
                lo, hi = ref_bracket(r, V)
                up, down = (lo, hi) if p.uncertain in (None, "keep") else (hi, lo)
                direction = up if a > 0 else down
            mask = d > (dpos if a > 0 else dneg) and a * direction > 0
            w = math.exp(log_r[i]) if p.ratio_cap is None else min(math.exp(log_r[i]), p.ratio_cap)
            coef = 0.0 if mask else -a * w
            out.append((coef, coef, mask))
        return out
    base = p.base_params if name == "sis" else p
    acc = [ref_accept(r, float(u[i])) if name == "sis" else False for i, r in enumerate(rows)]
    log_w = [0.0 if acc[i] else log_r[i] for i in range(n)]
    if name == "sis" and p.base != "gspo":
        for i in range(n):
            if acc[i]:
                out.append((-adv[i], -adv[i], False))
            else:
                out.append(ppo_ref(math.exp(log_w[i]), adv[i], base.eps_low, base.eps_high, base.dual_clip))
        return out
    for i in range(n):  # gspo
        seq = i // SEQ_LEN
        s = math.exp(sum(log_w[seq * SEQ_LEN : (seq + 1) * SEQ_LEN]) / SEQ_LEN)
        loss, coef, mask = ppo_ref(s, adv[i], base.eps_low, base.eps_high)
        out.append((loss, coef, mask))
    return out


def setup(seed: int, n_seq: int = 8):
    rows = random_rows(seed, n_seq * SEQ_LEN, V, K_LIST)
    gen = torch.Generator().manual_seed(seed)
    adv_seq = torch.randn(n_seq, generator=gen, dtype=F64)
    adv_seq[0] = 0.0  # A = 0
    adv = adv_seq.repeat_interleave(SEQ_LEN)
    u = torch.rand(len(rows), generator=gen, dtype=F64)
    seq = torch.arange(len(rows)) // SEQ_LEN
    return rows, adv, u, seq


@pytest.mark.parametrize("name,kw", VARIANTS)
def test_token_gradient_is_grad_coef_times_ek_minus_pi(name, kw):
    rows, adv, u, seq = setup(100)
    z = torch.stack([r.z for r in rows]).clone().requires_grad_(True)  # [N, V]
    batch = batch_from_logits(rows, z, V, seq)
    out = token_losses(name, batch, adv, u=u, **kw)
    (g,) = torch.autograd.grad(out.loss.sum(), z)
    ref = reference(name, kw, rows, adv.tolist(), u, batch.k)
    pi = torch.softmax(z.detach(), -1)
    vals = out.loss.detach()
    for i, r in enumerate(rows):
        loss, coef, mask = ref[i]
        v_dir = -pi[i]
        v_dir[r.k] += 1.0
        assert torch.allclose(g[i], coef * v_dir, atol=1e-10, rtol=1e-9), (name, kw, i)
        assert abs(float(vals[i]) - loss) <= 1e-10 * max(1.0, abs(loss)), (name, i)
        if adv[i] != 0:
            assert bool(out.mask[i]) == mask, (name, kw, i)
        else:
            assert float(vals[i]) == 0.0 and not bool(out.mask[i])
    live = adv != 0
    assert 0 < int(out.mask[live].sum()) < int(live.sum()) or name in ("sis", "cispo"), (
        "variant should mask some tokens"
    )
    if kw.get("dual_clip") is not None:  # the dual clip decides some tokens here (A < 0, w > c)
        w = [math.exp(float(r.pi_lp[r.k] - r.mu_lp[r.k])) for r in rows]
        assert any(a < 0 and wi > kw["dual_clip"] and bool(m) for a, wi, m in zip(adv.tolist(), w, out.mask)), kw


def test_gspo_token_form_gradient_equals_sequence_objective():
    rows, adv, _, seq = setup(200, n_seq=12)
    for eps in (3e-4, 0.05):
        logp = torch.stack([r.pi_lp[r.k] for r in rows]).clone().requires_grad_(True)
        base = batch_from_logits(rows, torch.stack([r.z for r in rows]), V, seq)
        b = TokenBatch(
            logp, base.behavior_logp, base.sampled_ids, base.topk_ids, base.topk_behavior_logp, base.topk_logp, seq, V
        )
        out = token_losses("gspo", b, adv, eps_low=eps, eps_high=eps)
        (g_tok,) = torch.autograd.grad(aggregate(out.loss, b, "seq-mean-token-mean"), logp)
        lr = (logp - b.behavior_logp).reshape(-1, SEQ_LEN)  # [G, L]
        s = lr.mean(dim=1).exp()
        a = adv.reshape(-1, SEQ_LEN)[:, 0]
        direct = torch.maximum(-a * s, -a * s.clamp(1 - eps, 1 + eps)).mean()
        (g_dir,) = torch.autograd.grad(direct, logp)
        assert torch.allclose(g_tok, g_dir, atol=1e-12)
        assert abs(float(aggregate(out.loss, b, "seq-mean-token-mean").detach()) - float(direct.detach())) < 1e-12


# --------------------------------------------------------------------------- limit cases


@pytest.mark.parametrize("kind", ["binary-tv", "binary-kl", "topk-tv", "topk-kl"])
def test_dppo_with_infinite_delta_is_importance_weighted_pg(kind):
    rows, adv, _, seq = setup(300)
    z = torch.stack([r.z for r in rows]).clone().requires_grad_(True)
    b = batch_from_logits(rows, z, V, seq)
    out = token_losses("dppo", b, adv, divergence=kind, delta_pos=math.inf, delta_neg=math.inf)
    assert not bool(out.mask.any())
    r = (b.logp - b.behavior_logp).exp()
    (g,) = torch.autograd.grad(out.loss.sum(), z, retain_graph=True)
    (g_ref,) = torch.autograd.grad((-adv * r.detach() * b.logp).sum(), z)  # -A sg(r) log pi
    assert torch.allclose(out.loss, -adv * r.detach(), atol=1e-12)
    assert torch.allclose(g, g_ref, atol=1e-12)


def test_pdm_on_singleton_support_follows_dppo_direction_rule():
    rows = random_rows(400, 60, V, 1, outside=False, padding=False, duplicates=False)
    for r in rows:  # the list holds only k: S = {k}
        r.ids, r.mu_list, r.pi_list = [r.k], [float(r.mu_lp[r.k])], [float(r.pi_lp[r.k])]
    gen = torch.Generator().manual_seed(4)
    adv = torch.randn(len(rows), generator=gen, dtype=F64)
    b = batch_from_logits(rows, torch.stack([r.z for r in rows]), None, torch.arange(len(rows)))
    for kind in ("kl", "tv"):
        for dp in (0.0, 0.01, 0.05):
            pdm = token_losses("pdm", b, adv, divergence=kind, delta_pos=dp, delta_neg=dp)
            dppo = token_losses("dppo", b, adv, divergence="binary-" + kind, delta_pos=dp, delta_neg=dp)
            assert torch.equal(pdm.mask, dppo.mask)
            assert torch.allclose(pdm.divergence, dppo.divergence, atol=1e-12)


@pytest.mark.parametrize("base", ["grpo", "dapo", "gspo"])
@pytest.mark.parametrize("how", ["u_ge_1", "all_outside"])
def test_sis_that_never_accepts_is_its_base(base, how):
    rows, adv, u, seq = setup(500)
    if how == "all_outside":
        rows = random_rows(501, len(rows), V, K_LIST, outside=True, zero_mass=False, peaked=False)
        u = torch.zeros(len(rows), dtype=F64)
    else:
        u = 1.0 + torch.rand(len(rows), dtype=F64)
    z = torch.stack([r.z for r in rows]).clone().requires_grad_(True)
    b = batch_from_logits(rows, z, V, seq)
    if how == "all_outside":
        assert all(r.k not in r.top for r in rows)
    s_out = token_losses("sis", b, adv, u=u, base=base)
    b_out = token_losses(base, b, adv)
    assert not bool(s_out.accepted.any())
    (g_s,) = torch.autograd.grad(s_out.loss.sum(), z, retain_graph=True)
    (g_b,) = torch.autograd.grad(b_out.loss.sum(), z)
    assert torch.equal(s_out.loss.detach(), b_out.loss.detach())
    assert torch.equal(s_out.mask, b_out.mask) and torch.equal(s_out.log_w, b_out.log_w)
    assert torch.equal(g_s, g_b)


# --------------------------------------------------------------------------- hand-computed values


def tiny_batch(logp, blp, seq, k=None):
    n = len(logp)
    k = torch.zeros(n, dtype=torch.long) if k is None else k
    ids = torch.zeros(n, 1, dtype=torch.long)
    lp = torch.tensor(logp, dtype=F64, requires_grad=True)
    return TokenBatch(
        lp,
        torch.tensor(blp, dtype=F64),
        k,
        ids,
        torch.tensor(blp, dtype=F64)[:, None],
        lp.detach()[:, None],
        torch.tensor(seq),
    ), lp


def test_grpo_hand_computed_loss_and_gradient():
    # r = 1.5, 0.5 (A = +1), 0.7, 1.5 (A = -1), 1.0 (A = 0)
    ln = math.log
    b, lp = tiny_batch([ln(0.3), ln(0.1), ln(0.14), ln(0.3), ln(0.2)], [ln(0.2)] * 5, [0, 0, 1, 1, 2])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0], dtype=F64)
    out = token_losses("grpo", b, adv)
    want_loss = [-1.28, -0.5, 0.8, 1.5, 0.0]
    assert torch.allclose(out.loss, torch.tensor(want_loss, dtype=F64), atol=1e-12)
    assert out.mask.tolist() == [True, False, True, False, False]
    total = aggregate(out.loss, b, "seq-mean-token-mean")
    assert abs(total.item() - ((-1.28 - 0.5) / 2 + (0.8 + 1.5) / 2 + 0.0) / 3) < 1e-12
    (g,) = torch.autograd.grad(total, lp)
    assert torch.allclose(g, torch.tensor([0.0, -0.5 / 6, 0.0, 1.5 / 6, 0.0], dtype=F64), atol=1e-12)
    assert abs(aggregate(out.loss, b, "token-mean").item() - sum(want_loss) / 5) < 1e-12
    dr = aggregate(out.loss, b, "seq-mean-token-sum-norm", norm_len=4)
    assert abs(dr.item() - ((-1.28 - 0.5) / 4 + (0.8 + 1.5) / 4 + 0.0) / 3) < 1e-12


def test_dual_clip_hand_computed_and_its_limit():
    # r = 4.0, 2.0 (A = -1), 4.0 (A = +1), 0.5 (A = -1); c = 3
    ln = math.log
    b, lp = tiny_batch([ln(0.8), ln(0.4), ln(0.8), ln(0.1)], [ln(0.2)] * 4, [0, 0, 1, 1])
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0], dtype=F64)
    out = token_losses("grpo", b, adv, dual_clip=3.0)
    assert torch.allclose(out.loss, torch.tensor([3.0, 2.0, -1.28, 0.8], dtype=F64), atol=1e-12)
    assert out.mask.tolist() == [True, False, True, True]
    (g,) = torch.autograd.grad(out.loss.sum(), lp)
    assert torch.allclose(g, torch.tensor([0.0, 2.0, 0.0, 0.0], dtype=F64), atol=1e-12)
    plain = token_losses("grpo", b, adv)
    assert plain.mask.tolist() == [False, False, True, True] and float(plain.loss[0].detach()) == 4.0
    for c in (math.inf, 1e9):  # c = inf (or beyond every ratio) is plain GRPO, bit for bit
        lim = token_losses("grpo", b, adv, dual_clip=c)
        assert torch.equal(lim.loss, plain.loss) and torch.equal(lim.mask, plain.mask)


def test_aggregate_excludes_invalid_tokens_and_handles_noncontiguous_sequences():
    ln = math.log
    b, _ = tiny_batch([ln(0.5)] * 6, [ln(0.5), NEG_INF, ln(0.5), ln(0.5), NEG_INF, NEG_INF], [7, 3, 7, 3, 3, 9])
    loss = torch.tensor([1.0, 100.0, 3.0, 5.0, 100.0, 100.0], dtype=F64)
    # seq 7: tokens 0, 2 -> mean 2; seq 3: token 3 -> 5 (token 1, 4 invalid); seq 9: no valid token
    assert abs(float(aggregate(loss, b, "seq-mean-token-mean")) - (2 + 5) / 2) < 1e-12
    assert abs(float(aggregate(loss, b, "token-mean")) - 9 / 3) < 1e-12
    assert abs(float(aggregate(loss, b, "seq-mean-token-sum-norm", norm_len=10)) - (4 / 10 + 5 / 10) / 2) < 1e-12
    empty, _ = tiny_batch([0.0], [NEG_INF], [0])
    assert float(aggregate(torch.ones(1, dtype=F64), empty, "token-mean")) == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregate_denominator_recombines_parts_split_by_sequence(mode):
    """Processes (or micro-batches) holding whole sequences reproduce the whole batch's loss and
    gradient when each part is weighted by denominator(part) / denominator(whole)."""
    ln = math.log
    logp = [ln(0.3), ln(0.1), ln(0.14), ln(0.3), ln(0.2), ln(0.25), ln(0.4)]
    blp = [ln(0.2), NEG_INF, ln(0.2), ln(0.2), NEG_INF, ln(0.2), NEG_INF]
    seq = [0, 0, 1, 1, 2, 3, 4]  # seq 2 and 4: no valid token
    mult = torch.arange(1.0, 8.0, dtype=F64)  # a different loss per token: l_t = t * logp_t
    kw = {"norm_len": 4} if mode == "seq-mean-token-sum-norm" else {}
    whole, lp = tiny_batch(logp, blp, seq)
    want = aggregate(lp * mult, whole, mode, **kw)
    (want_grad,) = torch.autograd.grad(want, lp)
    total = aggregate_denominator(whole, mode)
    assert total == (4 if mode == "token-mean" else 3)  # valid tokens 0, 2, 3, 5; sequences 0, 1, 3
    got, grads = 0.0, []
    for idx in ([0, 1, 4], [2, 3, 5, 6]):  # sequences {0, 2} and {1, 3, 4}
        part, plp = tiny_batch([logp[i] for i in idx], [blp[i] for i in idx], [seq[i] for i in idx])
        value = aggregate(plp * mult[idx], part, mode, **kw) * aggregate_denominator(part, mode) / total
        got += value.item()
        grads.append(torch.autograd.grad(value, plp)[0])
    assert abs(got - want.item()) < 1e-12
    assert torch.allclose(torch.cat(grads), want_grad[[0, 1, 4, 2, 3, 5, 6]], atol=1e-12)
    assert aggregate_denominator(tiny_batch([0.0], [NEG_INF], [0])[0], mode) == 0


@pytest.mark.parametrize("name,kw", VARIANTS)
def test_invalid_tokens_are_masked_zero_and_excluded(name, kw):
    rows, adv, u, seq = setup(600, n_seq=4)
    z = torch.stack([r.z for r in rows]).clone().requires_grad_(True)
    ref = batch_from_logits(rows, z, V, seq)
    bad = torch.zeros(len(rows), dtype=torch.bool)
    bad[[1, 7, 8, 20]] = True
    blp = ref.behavior_logp.masked_fill(bad, NEG_INF)
    tb = ref.topk_behavior_logp.masked_fill(bad[:, None] & (ref.topk_ids == ref.sampled_ids[:, None]), NEG_INF)
    b = TokenBatch(ref.logp, blp, ref.sampled_ids, ref.topk_ids, tb, ref.topk_logp, seq, V)
    out = token_losses(name, b, adv, u=u, **kw)
    (g,) = torch.autograd.grad(aggregate(out.loss, b, "seq-mean-token-mean"), z)
    assert torch.isfinite(g).all() and torch.isfinite(out.loss).all()
    assert bool(out.mask[bad].all()) and out.loss[bad].abs().sum().item() == 0.0
    assert float(g[bad].abs().sum()) == 0.0
    assert torch.isinf(out.log_w[bad]).all() and (out.log_w[bad] > 0).all()
    if out.accepted is not None:
        assert not bool(out.accepted[bad].any())
    # the valid tokens see exactly what a batch without the invalid ones gives (GSPO length too)
    keep = ~bad
    sub = TokenBatch(
        ref.logp[keep],
        ref.behavior_logp[keep],
        ref.sampled_ids[keep],
        ref.topk_ids[keep],
        ref.topk_behavior_logp[keep],
        ref.topk_logp[keep],
        seq[keep],
        V,
    )
    out_sub = token_losses(name, sub, adv[keep], u=u[keep], **kw)
    assert torch.allclose(out.loss[keep], out_sub.loss, rtol=1e-12, atol=1e-14)
    assert torch.equal(out.mask[keep], out_sub.mask)
    agg_full = aggregate(out.loss, b, "seq-mean-token-mean").item()
    agg_sub = aggregate(out_sub.loss, sub, "seq-mean-token-mean").item()
    assert abs(agg_full - agg_sub) <= 1e-12 * max(1.0, abs(agg_sub))


def test_zero_training_probability_gives_zero_ratio_without_nan():
    b, lp = tiny_batch([NEG_INF, NEG_INF], [math.log(0.3)] * 2, [0, 1])
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    for name in ("grpo", "gspo", "dppo", "pdm", "sis", "cispo"):
        out = token_losses(name, b, adv, u=torch.zeros(2, dtype=F64))
        (g,) = torch.autograd.grad(out.loss.sum(), lp)
        assert torch.isfinite(out.loss).all() and torch.equal(g, torch.zeros(2, dtype=F64)), name
    out = token_losses("grpo", b, adv)
    assert out.mask.tolist() == [False, True]  # PPO: r = 0 is masked iff A < 0


# --------------------------------------------------------------------------- registry behaviour


def test_registry_defaults_and_dapo_shaping():
    grpo, dapo, sis = get_method("grpo"), get_method("dapo"), get_method("sis")
    assert grpo.aggregation(make_params("grpo")) == "seq-mean-token-mean"
    assert dapo.aggregation(make_params("dapo")) == "token-mean"
    assert get_method("gspo").aggregation(make_params("gspo")) == "seq-mean-token-mean"
    assert get_method("dppo").aggregation(make_params("dppo")) == "token-mean"
    assert sis.aggregation(make_params("sis", base="dapo")) == "token-mean"
    assert sis.aggregation(make_params("sis", base="gspo", loss_agg="token-mean")) == "token-mean"
    assert dapo.dynamic_sampling(make_params("dapo")) and not grpo.dynamic_sampling(make_params("grpo"))
    assert sis.dynamic_sampling(make_params("sis", base="dapo"))
    assert sis.needs_u(make_params("sis")) and not grpo.needs_u(make_params("grpo"))
    assert make_params("dppo", divergence="binary-tv").deltas == (0.15, 0.15)
    assert make_params("dppo").deltas == (0.15, 0.15)  # top-K KL: the predictive-mask paper's main delta
    assert make_params("dppo", divergence="binary-kl").deltas == (0.05, 0.05)
    assert make_params("pdm").deltas == (0.15, 0.15)
    assert make_params("pdm", divergence="tv", delta_neg=0.3).deltas == (0.15, 0.3)
    assert make_params("sis", base="gspo").base_params.eps_low == 3e-4
    # soft overlong punishment: 0 up to max-buffer, linear in the buffer, -penalty beyond
    assert overlong_penalty(80, 100, 20, 1.0) == 0.0
    assert overlong_penalty(90, 100, 20, 1.0) == -0.5
    assert overlong_penalty(130, 100, 20, 0.5) == -0.5
    assert torch.allclose(
        overlong_penalty(torch.tensor([80, 95, 100]), 100, 20, 1.0), torch.tensor([0.0, -0.75, -1.0], dtype=F64)
    )
    assert dapo.reward_delta(make_params("dapo", overlong_buffer=20), 90, 100) == -0.5
    assert dapo.reward_delta(make_params("dapo"), 100, 100) == 0.0
    assert grpo.reward_delta(make_params("grpo"), 100, 100) == 0.0
