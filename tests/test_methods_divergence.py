"""D and Ddot (docs/METHODS.md §1, §3, §4) against plain float64 references and autograd on full logits."""

from __future__ import annotations

import math

import pytest
import torch

from masktrl.methods import TokenBatch, ddot_kl_bracket, divergence, divergence_rate, support
from tests.test_methods_reference import (
    F64,
    NEG_INF,
    Row,
    autograd_ddot,
    bucketed_div,
    ddot_kl_plain,
    ddot_tv_plain,
    full_div,
    kl_plain,
    make_batch,
    random_rows,
    ref_support,
    ref_tails,
    tv_plain,
)

TOL = 1e-9


def close(a: float, b: float, tol: float = TOL) -> bool:
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= tol * max(1.0, abs(b))


# --------------------------------------------------------------------------- K >= V: exact


@pytest.mark.parametrize("k_list", [6, 8, 5])  # K >= V, and K = V - 1 with k possibly appended
@pytest.mark.parametrize("known_v", [True, False])
def test_topk_estimators_equal_full_vocab_when_support_is_everything(k_list, known_v):
    v = 6
    rows = random_rows(1 + k_list, 40, v, k_list, outside=True)
    rows = [r for r in rows if len(ref_support(r)) == v]  # |S| = V (K = V-1 keeps rows where k was appended)
    assert len(rows) >= 10
    batch = make_batch(rows, v if known_v else None)
    tails = ["agg", "uniform"] if known_v else ["agg"]
    d_kl, d_tv = divergence(batch, "topk-kl"), divergence(batch, "topk-tv")
    rates = {(kind, tail): divergence_rate(batch, kind, tail) for kind in ("kl", "tv") for tail in tails}
    for i, r in enumerate(rows):
        assert close(float(d_kl[i]), float(full_div(r.mu_lp, r.z, "kl")))
        assert close(float(d_tv[i]), float(full_div(r.mu_lp, r.z, "tv")))
        for (kind, _), val in rates.items():
            assert close(float(val[i]), autograd_ddot(r.mu_lp, r.z, r.k, kind)), (kind, i)


def test_aggregated_rate_is_exact_when_tail_has_one_token():
    v = 7
    rows = [r for r in random_rows(3, 60, v, v - 1, outside=False) if r.k in r.top and len(r.top) == v - 1]
    assert len(rows) >= 20
    batch = make_batch(rows, None)
    for kind in ("kl", "tv"):
        rate = divergence_rate(batch, kind, "agg")
        for i, r in enumerate(rows):
            assert close(float(rate[i]), autograd_ddot(r.mu_lp, r.z, r.k, kind))


# --------------------------------------------------------------------------- partial lists


@pytest.mark.parametrize("k_list", [1, 2, 4])
@pytest.mark.parametrize("known_v", [True, False])
def test_aggregated_rate_is_autograd_of_bucketed_divergence_along_v_agg(k_list, known_v):
    v = 9
    rows = random_rows(10 + k_list, 60, v, k_list)
    batch = make_batch(rows, v if known_v else None)
    for kind in ("kl", "tv"):
        rate = divergence_rate(batch, kind, "agg")
        for i, r in enumerate(rows):
            s_ids = [a for a, _, _ in ref_support(r)]
            pi = torch.softmax(r.z, -1)
            pi_t = float(pi[[j for j in range(v) if j not in s_ids]].sum())
            v_agg = torch.full((v,), -pi_t, dtype=F64)
            v_agg[s_ids] = -pi[s_ids]
            v_agg[r.k] += 1.0
            z = r.z.clone().requires_grad_(True)
            (g,) = torch.autograd.grad(bucketed_div(r.mu_lp, z, s_ids, kind), z)
            assert close(float(rate[i]), float((g * v_agg).sum())), (kind, i)
            if kind == "kl":  # along v_agg the full KL has the same derivative
                assert close(float(rate[i]), autograd_ddot(r.mu_lp, r.z, r.k, "kl", direction=v_agg))


@pytest.mark.parametrize("k_list", [1, 3, 5])
def test_uniform_rate_is_full_formula_on_spread_surrogates(k_list):
    v = 10
    rows = random_rows(20 + k_list, 60, v, k_list)
    batch = make_batch(rows, v)
    rates = {kind: divergence_rate(batch, kind, "uniform") for kind in ("kl", "tv")}
    for i, r in enumerate(rows):
        atoms = ref_support(r)
        mu_t, pi_t, m = ref_tails(atoms, v)
        ids = [a for a, _, _ in atoms]
        mu_s = [math.exp(a) for _, a, _ in atoms] + [mu_t / m] * m if m else [math.exp(a) for _, a, _ in atoms]
        pi_s = [math.exp(b) for _, _, b in atoms] + [pi_t / m] * m if m else [math.exp(b) for _, _, b in atoms]
        k_idx = ids.index(r.k)
        assert close(float(rates["kl"][i]), ddot_kl_plain(mu_s, pi_s, k_idx))
        assert close(float(rates["tv"][i]), ddot_tv_plain(mu_s, pi_s, k_idx))


def test_uniform_rate_is_exact_when_both_policies_are_uniform_on_unseen_tokens():
    gen = torch.Generator().manual_seed(5)
    v, k_list, rows = 8, 3, []
    for _ in range(30):
        z_mu = torch.randn(v, generator=gen, dtype=F64) + 3.0
        z = z_mu + 0.8 * torch.randn(v, generator=gen, dtype=F64)
        top = sorted(range(v), key=lambda i: -float(z_mu[i]))[:k_list]
        rest = [j for j in range(v) if j not in top]
        z_mu[rest], z[rest] = -1.0, float(torch.randn(1, generator=gen)) - 1.0  # flat on the unseen tokens
        mu_lp, pi_lp = torch.log_softmax(z_mu, -1), torch.log_softmax(z, -1)
        k = int(torch.multinomial(mu_lp.exp(), 1, generator=gen))
        rows.append(Row(z_mu, z, k, top, [float(mu_lp[j]) for j in top], [float(pi_lp[j]) for j in top], top))
    batch = make_batch(rows, v)
    for kind in ("kl", "tv"):
        rate = divergence_rate(batch, kind, "uniform")
        for i, r in enumerate(rows):
            assert close(float(rate[i]), autograd_ddot(r.mu_lp, r.z, r.k, kind))


@pytest.mark.parametrize("rule", ["union", "replace_last"])
@pytest.mark.parametrize("known_v", [True, False])
@pytest.mark.parametrize("clean", [True, False])  # clean: full-width lists, so replace_last drops entries
def test_topk_divergences_match_atom_formulas(rule, known_v, clean):
    v = 9
    rows = random_rows(30, 80, v, 3, **({"padding": False, "duplicates": False} if clean else {}))
    batch = make_batch(rows, v if known_v else None)
    d_kl, d_tv = divergence(batch, "topk-kl", rule=rule), divergence(batch, "topk-tv", rule=rule)
    b_kl, b_tv = divergence(batch, "binary-kl", rule=rule), divergence(batch, "binary-tv", rule=rule)
    for i, r in enumerate(rows):
        atoms = ref_support(r, rule, k_slots=batch.k)
        mu_t, pi_t, _ = ref_tails(atoms, v if known_v else None)
        mu = [math.exp(a) for _, a, _ in atoms] + [mu_t]
        pi = [math.exp(b) for _, _, b in atoms] + [pi_t]
        assert close(float(d_kl[i]), kl_plain(mu, pi, floor_last=True))
        assert close(float(d_tv[i]), tv_plain(mu, pi))
        mk, pk = float(r.mu_lp[r.k].exp()), float(r.pi_lp[r.k].exp())
        assert close(float(b_kl[i]), kl_plain([mk, 1 - mk], [pk, 1 - pk]), 1e-8)
        assert close(float(b_tv[i]), abs(pk - mk))


@pytest.mark.parametrize("rule", ["union", "replace_last"])
def test_binary_le_topk_le_full(rule):
    v = 8
    rows = random_rows(40, 100, v, 3, peaked=False)
    batch = make_batch(rows, v)
    for kind in ("kl", "tv"):
        binary = divergence(batch, "binary-" + kind, rule=rule)
        topk = divergence(batch, "topk-" + kind, rule=rule)
        for i, r in enumerate(rows):
            full = float(full_div(r.mu_lp, r.z, kind))
            assert float(binary[i]) <= float(topk[i]) + 1e-12
            assert float(topk[i]) <= full + 1e-12


def test_replace_last_support_by_hand():
    # list [0, 1, 2] (K = 3), k = 3 outside: union S = {0,1,2,3}, replace_last S = {0,1,3}
    mu = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=F64)
    pi = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=F64)
    ids = torch.tensor([[0, 1, 2], [0, -1, -1]])
    b = TokenBatch(
        pi[[3, 3]].log(),
        mu[[3, 3]].log(),
        torch.tensor([3, 3]),
        ids,
        mu[ids.clamp_min(0)].log(),
        pi[ids.clamp_min(0)].log(),
        torch.tensor([0, 1]),
        None,
    )
    union = divergence(b, "topk-tv", rule="union")
    repl = divergence(b, "topk-tv", rule="replace_last")
    assert close(float(union[0]), 0.5 * (0.3 + 0.1 + 0.1 + 0.3 + 0.0))
    assert close(float(repl[0]), 0.5 * (0.3 + 0.1 + 0.3 + abs(0.2 - 0.3)))
    # the padded row has only one genuine entry: k takes a padding slot, nothing is dropped
    assert close(float(repl[1]), float(union[1]))
    assert close(float(union[1]), 0.5 * (0.3 + 0.3 + abs(0.5 - 0.5)))


def test_support_is_computed_once_per_batch_and_rule():
    """support() keeps its result on the batch: a second call returns the first one's tensors,
    each rule its own, equal to a fresh computation; a batch made with dataclasses.replace (new
    log pi) computes its own."""
    import dataclasses

    from masktrl.methods.batch import _support

    mu = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=F64)
    pi = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=F64)
    ids = torch.tensor([[0, 1, 2], [0, -1, -1]])
    b = TokenBatch(
        pi[[3, 3]].log(), mu[[3, 3]].log(), torch.tensor([3, 3]), ids,
        mu[ids.clamp_min(0)].log(), pi[ids.clamp_min(0)].log(), torch.tensor([0, 1]), 4,
    )  # fmt: skip
    union, repl = support(b, "union"), support(b, "replace_last")
    assert support(b, "union") is union and support(b) is union and support(b, "replace_last") is repl
    for memo, rule in ((union, "union"), (repl, "replace_last")):
        fresh = _support(b, rule)
        for a, c in zip(memo, fresh):
            assert a is None and c is None or torch.equal(a, c)
    moved = dataclasses.replace(b, logp=pi[[2, 2]].log())
    assert support(moved) is not union
    assert not torch.equal(support(moved).pi_lp.nan_to_num(), union.pi_lp.nan_to_num())


# --------------------------------------------------------------------------- bracket, signs, reductions


def test_bracket_contains_exact_and_uniform():
    v = 10
    outside_agg = 0
    for k_list in (1, 2, 4, 7):
        rows = random_rows(50 + k_list, 80, v, k_list, padding=False, duplicates=False)
        batch = make_batch(rows, v)
        lo, hi = ddot_kl_bracket(batch)
        uni = divergence_rate(batch, "kl", "uniform")
        agg = divergence_rate(batch, "kl", "agg")
        for i, r in enumerate(rows):
            exact = autograd_ddot(r.mu_lp, r.z, r.k, "kl")
            assert float(lo[i]) - 1e-12 <= exact <= float(hi[i]) + 1e-12
            assert float(lo[i]) - 1e-12 <= float(uni[i]) <= float(hi[i]) + 1e-12
            outside_agg += not (float(lo[i]) <= float(agg[i]) <= float(hi[i]))
    assert outside_agg > 0  # the aggregated estimate is not always inside (§4.4)
    rows = random_rows(59, 20, 6, 6)
    lo, hi = ddot_kl_bracket(make_batch(rows, 6))  # m = 0: lo = hi = exact
    for i, r in enumerate(rows):
        assert close(float(lo[i]), autograd_ddot(r.mu_lp, r.z, r.k, "kl"))
        assert close(float(hi[i]), float(lo[i]))


@pytest.mark.parametrize("kind", ["kl", "tv"])
def test_sign_of_a_ddot_predicts_realised_change(kind):
    v, eta = 6, 1e-6
    rows = random_rows(70, 80, v, v)
    batch = make_batch(rows, v)
    rate = divergence_rate(batch, kind, "agg")
    gen = torch.Generator().manual_seed(1)
    checked = 0
    for i, r in enumerate(rows):
        a = float(torch.randn(1, generator=gen))
        pi = torch.softmax(r.z, -1)
        step = -pi
        step[r.k] += 1.0
        change = float(full_div(r.mu_lp, r.z + eta * a * step, kind) - full_div(r.mu_lp, r.z, kind))
        pred = a * float(rate[i])
        if abs(pred) * eta > 1e-11:
            assert math.copysign(1, pred) == math.copysign(1, change)
            assert abs(change - eta * pred) <= 1e-3 * abs(eta * pred)
            checked += 1
    assert checked > 50


@pytest.mark.parametrize("empty_list", [False, True])
def test_binary_reduction_when_support_is_only_k(empty_list):
    gen = torch.Generator().manual_seed(8)
    n = 30
    mu_k = torch.rand(n, generator=gen, dtype=F64) * 0.98 + 0.01
    pi_k = torch.rand(n, generator=gen, dtype=F64) * 0.98 + 0.01
    k = torch.arange(n) % 5
    ids = torch.full((n, 1), -1) if empty_list else k[:, None].clone()
    b = TokenBatch(
        pi_k.log(), mu_k.log(), k, ids, mu_k.log()[:, None], pi_k.log()[:, None], torch.zeros(n, dtype=torch.long)
    )
    kl, tv = divergence_rate(b, "kl", "agg"), divergence_rate(b, "tv", "agg")
    assert torch.allclose(kl, 2 * (1 - pi_k) * (pi_k - mu_k), atol=1e-12)
    assert torch.allclose(tv, 2 * pi_k * (1 - pi_k) ** 2 * torch.sign(pi_k - mu_k), atol=1e-12)
    assert torch.equal(torch.sign(kl), torch.sign(pi_k.log() - mu_k.log()))
    assert torch.allclose(divergence(b, "topk-kl"), divergence(b, "binary-kl"), atol=1e-12)
    assert torch.allclose(divergence(b, "topk-tv"), divergence(b, "binary-tv"), atol=1e-12)


# --------------------------------------------------------------------------- edge cases


def test_rounding_tails_are_clamped_to_zero():
    # float32-style lists summing to 1 + 1e-7 (all 5 tokens listed, V unknown): both tails 0
    mu = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=F64) * (1 + 1e-7)
    pi = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1], dtype=F64) * (1 + 1e-7)
    ids = torch.arange(5)[None]
    b = TokenBatch(
        pi[1:2].log(),
        mu[1:2].log(),
        torch.tensor([1]),
        ids,
        mu.log()[None],
        pi.log()[None],
        torch.zeros(1, dtype=torch.long),
    )
    s = support(b)
    assert float(s.mu_tail[0]) == 0.0 and float(s.pi_tail[0]) == 0.0
    d = divergence(b, "topk-kl")
    assert close(float(d[0]), kl_plain(mu.tolist(), pi.tolist()))
    assert torch.isfinite(divergence_rate(b, "tv", "agg")).all()


def test_zero_mass_and_infinite_kl_rules():
    mu = torch.tensor([0.6, 0.4, 0.0, 0.0], dtype=F64)
    pi = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=F64)
    # token 3: mu = pi = 0 listed (zero-mass atom, 0 log 0 = 0); k = 0
    ids = torch.tensor([[0, 1, 2, 3]])
    b = TokenBatch(
        pi[:1].log(),
        mu[:1].log(),
        torch.tensor([0]),
        ids,
        mu.log()[None],
        pi.log()[None],
        torch.zeros(1, dtype=torch.long),
        4,
    )
    assert close(float(divergence(b, "topk-kl")[0]), 0.6 * math.log(0.6 / 0.5) + 0.4 * math.log(0.4 / 0.3))
    assert close(float(divergence(b, "topk-tv")[0]), 0.5 * (0.1 + 0.1 + 0.2))
    # training -inf where mu > 0: KL = +inf (binary too, when it is the sampled token)
    pi2 = torch.tensor([0.0, 0.8, 0.2, 0.0], dtype=F64)
    b2 = TokenBatch(
        pi2[:1].log(),
        mu[:1].log(),
        torch.tensor([0]),
        ids,
        mu.log()[None],
        pi2.log()[None],
        torch.zeros(1, dtype=torch.long),
        4,
    )
    assert divergence(b2, "topk-kl")[0] == math.inf
    assert divergence(b2, "binary-kl")[0] == math.inf
    # pi_T = 0 < mu_T: the training tail is floored at 1e-12 inside the log
    mu3 = torch.tensor([0.5, 0.4], dtype=F64)
    pi3 = torch.tensor([0.7, 0.3], dtype=F64)
    b3 = TokenBatch(
        pi3[:1].log(),
        mu3[:1].log(),
        torch.tensor([0]),
        torch.tensor([[0, 1]]),
        mu3.log()[None],
        pi3.log()[None],
        torch.zeros(1, dtype=torch.long),
    )
    want = 0.5 * math.log(0.5 / 0.7) + 0.4 * math.log(0.4 / 0.3) + 0.1 * math.log(0.1 / 1e-12)
    assert close(float(divergence(b3, "topk-kl")[0]), want)


def test_all_listed_zero_mass_gives_tail_one():
    ids = torch.tensor([[1, 2]])
    lp = torch.full((1, 2), NEG_INF, dtype=F64)
    b = TokenBatch(
        torch.tensor([-1.0], dtype=F64),
        torch.tensor([NEG_INF], dtype=F64),
        torch.tensor([0]),
        ids,
        lp,
        lp,
        torch.zeros(1, dtype=torch.long),
    )
    s = support(b)
    assert float(s.mu_tail[0]) == 1.0  # invalid token: S = {k} with mu_k = 0, all listed entries -inf


def test_rows_do_not_interact():
    rows = random_rows(90, 12, 7, 3)
    batch = make_batch(rows, 7)
    for kind in ("topk-kl", "topk-tv", "binary-kl"):
        full = divergence(batch, kind)
        for i in (0, 5, 11):
            single = divergence(make_batch([rows[i]], 7), kind)
            assert close(float(full[i]), float(single[0]), 1e-12)
