"""Off-policy corrections (docs/METHODS.md §14) and CISPO (§15): a float64 loop reference for every
kind in both modes, hand-computed values, the limit cases (plain GRPO bit for bit), decoupled =
bypass when pi_old = pi, the anchors' own formulas (verl, TRL, OpenRLHF) and bad parameters."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from masktrl.methods import (
    TokenBatch,
    aggregate,
    corrected_token_losses,
    correction_weights,
    get_method,
    make_correction,
    make_params,
    token_losses,
)
from masktrl.methods.corrections import RS_STATS, CorrectionParams, correction_diagnostics, decoupled_batch
from tests.test_methods_reference import F64, NEG_INF, batch_from_logits, random_rows

V, K_LIST, SEQ_LEN = 8, 3, 5

RS_HI = {"token": (0.03, 1.5), "seq_sum": (0.3, 1.5), "seq_mean": (0.03, 1.1), "seq_max": (0.15, None)}  # (k2/k3, k1)
KINDS = [
    ("none", {}),
    ("token-tis", {}),
    ("token-tis", {"cap": 1.3, "floor": 0.7}),
    ("seq-tis", {}),
    ("seq-tis", {"cap": 1.5, "floor": 0.2}),
    ("token-mis", {}),
    ("token-mis", {"lo": 0.6, "hi": 1.4}),
    ("seq-mis", {}),
    ("seq-mis", {"lo": 0.9, "hi": 1.15, "stat": "geometric"}),
    ("seq-mis", {"lo": 0.3, "hi": 3.0, "weight": "sequence"}),
    ("icepop", {}),
    ("icepop", {"lo": 0.8, "hi": 1.25}),
    *[("rs", {"stat": s, "hi": RS_HI[s.split("_k")[0]][s.endswith("k1")]}) for s in RS_STATS],
    ("rs", {"stat": "token_k1", "lo": 0.9, "hi": 1.6}),
    ("opsm", {}),
    ("opsm", {"delta": 0.0}),
]


# --------------------------------------------------------------------------- float64 loop reference


def ref_correction(kind: str, kw: dict, mode: str, mu, ref, cur, seq, adv):
    """Per-token (factor, keep, weight) of §14.2-13.3, one token and one sequence at a time."""
    r = make_correction({"kind": kind, **kw}).resolved
    n = len(mu)
    valid = [m > NEG_INF for m in mu]
    lr = [ref[i] - mu[i] if valid[i] else 0.0 for i in range(n)]
    rho = [math.exp(x) for x in lr]
    members = {s: [i for i in range(n) if seq[i] == s and valid[i]] for s in set(seq)}
    out = []
    for i in range(n):
        if not valid[i]:
            out.append((1.0, True, 1.0))
            continue
        toks = members[seq[i]]
        f, keep = rho[i], True
        if kind in ("token-tis", "seq-tis"):
            base = rho[i] if kind == "token-tis" else math.exp(sum(lr[j] for j in toks))
            f = min(base, r["cap"])
            if r["floor"] is not None:
                f = max(f, r["floor"])
        elif kind in ("token-mis", "icepop"):
            keep = r["lo"] <= rho[i] <= r["hi"]
        elif kind == "seq-mis":
            s = sum(lr[j] for j in toks)
            if r["stat"] == "geometric":
                s /= len(toks)
            keep = r["lo"] <= math.exp(s) <= r["hi"]
            if r["weight"] == "sequence":
                f = math.exp(s)
        elif kind == "rs":

            def kstat(j):
                x = min(max(lr[j], -20.0), 20.0)
                return {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[r["stat"][-2:]]

            vals = [kstat(j) for j in toks]
            st = r["stat"]
            s = (
                kstat(i)
                if st.startswith("token")
                else sum(vals)
                if "sum" in st
                else sum(vals) / len(vals)
                if "mean" in st
                else max(vals)
            )
            keep = (math.log(r["lo"]) <= s <= math.log(r["hi"])) if st.endswith("k1") else s <= r["hi"]
        elif kind == "opsm":
            kl = sum(mu[j] - cur[j] for j in toks) / len(toks)
            keep = not (adv[i] < 0 and kl > r["delta"])
        weight = f if keep else 0.0
        if mode == "decoupled":
            factor = weight
        else:
            factor = (1.0 if f == rho[i] else f / rho[i]) if keep else 0.0
        out.append((factor, keep, weight))
    return out


def random_case(seed: int, n_seq: int = 6, spread: float = 0.5):
    """log mu, log pi_ref, log pi (current), noncontiguous seq ids, advantages, some invalid tokens."""
    gen = torch.Generator().manual_seed(seed)
    n = n_seq * SEQ_LEN
    mu = torch.log(torch.rand(n, generator=gen, dtype=F64) * 0.9 + 0.05)
    ref = (mu + spread * torch.randn(n, generator=gen, dtype=F64)).clamp_max(0.0)
    cur = (ref + 0.1 * torch.randn(n, generator=gen, dtype=F64)).clamp_max(0.0)
    mu[[3, 11]] = NEG_INF
    seq = torch.randperm(n, generator=gen) % n_seq
    adv_seq = torch.randn(n_seq, generator=gen, dtype=F64)
    adv_seq[0] = 0.0
    return mu, ref, cur, seq, adv_seq[seq]


@pytest.mark.parametrize("mode", ["bypass", "decoupled"])
@pytest.mark.parametrize("kind,kw", KINDS)
def test_every_kind_matches_the_float64_reference(kind, kw, mode):
    mu, ref, cur, seq, adv = random_case(7)
    p = make_correction({"kind": kind, "mode": mode, **kw})
    got = correction_weights(p, mu, ref, seq, adv, current_logp=cur)
    want = ref_correction(kind, kw, mode, mu.tolist(), ref.tolist(), cur.tolist(), seq.tolist(), adv.tolist())
    for i, (factor, keep, weight) in enumerate(want):
        assert bool(got.keep[i]) == keep, (kind, kw, i)
        assert abs(float(got.factor[i]) - factor) <= 1e-12 * max(1.0, abs(factor)), (kind, kw, mode, i)
        assert abs(float(got.weight[i]) - weight) <= 1e-12 * max(1.0, abs(weight)), (kind, kw, i)
    if kind not in ("none", "token-tis", "seq-tis") and kw and kw.get("hi", 0.0) < 2.5:  # the case exercises the rule
        valid = mu > NEG_INF
        assert 0 < int((~got.keep & valid).sum()) < int(valid.sum()), (kind, kw)


def test_hand_computed_values():
    # sequence 0: rho = 1.6, 0.5; sequence 1: rho = 0.4 (A < 0), 1.25
    mu = torch.tensor([math.log(0.5), math.log(0.4), math.log(0.5), math.log(0.4)], dtype=F64)
    ref = torch.tensor([math.log(0.8), math.log(0.2), math.log(0.2), math.log(0.5)], dtype=F64)
    seq = torch.tensor([0, 0, 1, 1])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=F64)

    def run(kind, mode="bypass", **kw):
        return correction_weights(make_correction({"kind": kind, "mode": mode, **kw}), mu, ref, seq, adv)

    c = run("token-tis", cap=1.5)
    assert torch.allclose(c.weight, torch.tensor([1.5, 0.5, 0.4, 1.25], dtype=F64))
    assert torch.allclose(c.factor, torch.tensor([1.5 / 1.6, 1.0, 1.0, 1.0], dtype=F64))
    assert c.factor[1:].tolist() == [1.0, 1.0, 1.0]  # untruncated: exactly 1
    c = run("seq-tis", cap=1.5, mode="decoupled")  # products 0.8 and 0.5
    assert torch.allclose(c.factor, torch.tensor([0.8, 0.8, 0.5, 0.5], dtype=F64))
    c = run("seq-tis", cap=1.5)  # bypass: the sequence weight replaces rho_t
    assert torch.allclose(c.factor, torch.tensor([0.5, 1.6, 1.25, 0.4], dtype=F64))
    c = run("icepop", mode="decoupled")  # [0.5, 5]: 0.4 is out, 0.5 is in (inclusive)
    assert c.keep.tolist() == [True, True, False, True]
    assert torch.allclose(c.factor, torch.tensor([1.6, 0.5, 0.0, 1.25], dtype=F64))
    assert run("icepop").factor.tolist() == [1.0, 1.0, 0.0, 1.0]
    c = run("seq-mis", hi=0.6)  # products 0.8 (out), 0.5 (in)
    assert c.keep.tolist() == [False, False, True, True]
    c = run("seq-mis", lo=0.8, hi=1.0, stat="geometric")  # geometric means sqrt(0.8), sqrt(0.5)
    assert c.keep.tolist() == [True, True, False, False]
    # opsm: mean log(mu/pi) = (log(0.5/0.8) + log(0.4/0.2))/2 = 0.1116 (A > 0: kept anyway),
    # (log(0.5/0.2) + log(0.4/0.5))/2 = 0.3466 with A < 0: masked at delta 0.3, kept at 0.4
    assert run("opsm", delta=0.3).keep.tolist() == [True, True, False, False]
    assert run("opsm", delta=0.4).keep.tolist() == [True, True, True, True]
    # verl seq_mean_k3: mean of rho - 1 - log rho; sequence 0: (0.1300 + 0.1931)/2 = 0.1616
    k3 = lambda x: x - 1 - math.log(x)  # noqa: E731
    assert abs((k3(1.6) + k3(0.5)) / 2 - 0.16157) < 1e-4
    assert run("rs", stat="seq_mean_k3", hi=0.16).keep.tolist() == [False, False, False, False]
    assert run("rs", stat="seq_mean_k3", hi=0.17).keep.tolist() == [True, True, False, False]
    # token_k1: -log rho in [log(1/2), log 2] <=> rho in [0.5, 2]
    assert run("rs", stat="token_k1", hi=2.0).keep.tolist() == [True, True, False, True]
    d = correction_diagnostics(run("icepop", mode="decoupled"), _batch(mu, ref, seq))
    assert d["corr_keep_frac"] == 0.75 and abs(d["corr_weight_mean"] - (1.6 + 0.5 + 1.25) / 4) < 1e-12


def _batch(mu, logp, seq):
    n = mu.shape[0]
    ids = torch.arange(n) % V
    return TokenBatch(logp, mu, ids, ids[:, None], mu[:, None], logp.detach()[:, None], seq, V)


# --------------------------------------------------------------------------- limits and modes


LIMITS = [
    ("none", {}),
    ("token-tis", {"cap": math.inf}),
    ("token-mis", {"lo": 0.0, "hi": math.inf}),
    ("seq-mis", {"lo": 0.0, "hi": math.inf}),
    ("seq-mis", {"lo": 0.0, "hi": math.inf, "stat": "geometric"}),
    ("icepop", {"lo": 0.0, "hi": math.inf}),
    *[
        ("rs", {"stat": s, "lo": 0.0, "hi": math.inf} if s.endswith("k1") else {"stat": s, "hi": math.inf})
        for s in RS_STATS
    ],
    ("opsm", {"delta": math.inf}),
]


def logits_case(seed: int):
    rows = random_rows(seed, 6 * SEQ_LEN, V, K_LIST)
    gen = torch.Generator().manual_seed(seed)
    adv = torch.randn(6, generator=gen, dtype=F64).repeat_interleave(SEQ_LEN)
    seq = torch.arange(len(rows)) // SEQ_LEN
    return rows, adv, seq


def loss_and_grad(name, kw, rows, adv, seq, correction=None, old=None):
    z = torch.stack([r.z for r in rows]).clone().requires_grad_(True)
    batch = batch_from_logits(rows, z, V, seq)
    m, p = get_method(name), make_params(name, **kw)
    if correction is None:
        out = m.token_losses(batch, adv, p)
    else:
        old_lp, old_top = (old or _pi_old_is_pi)(batch)  # one minibatch: pi_old is the policy's values
        out, _, _ = corrected_token_losses(
            m, batch, adv, p, make_correction(correction), old_logp=old_lp, old_topk_logp=old_top
        )
    loss = m.aggregate(p, out.loss, batch, horizon=SEQ_LEN)
    (g,) = torch.autograd.grad(loss, z)
    return out, loss, g


@pytest.mark.parametrize(
    "name,kw",
    [
        ("grpo", {}),
        ("dapo", {}),
        ("dppo", {"divergence": "topk-tv"}),
        ("pdm", {}),
        ("cispo", {}),
        ("gspo", {"eps_low": 0.1, "eps_high": 0.1}),
    ],
)
@pytest.mark.parametrize("kind,ckw", LIMITS)
def test_every_correction_at_its_limit_is_the_plain_method_bit_for_bit(kind, ckw, name, kw):
    rows, adv, seq = logits_case(11)
    plain, lp, gp = loss_and_grad(name, kw, rows, adv, seq)
    out, lc, gc = loss_and_grad(name, kw, rows, adv, seq, {"kind": kind, **ckw})
    assert torch.equal(out.loss, plain.loss) and torch.equal(out.mask, plain.mask)
    assert torch.equal(lc, lp) and torch.equal(gc, gp), (kind, ckw, name)


@pytest.mark.parametrize(
    "kind,ckw", [("seq-tis", {"cap": math.inf}), ("seq-mis", {"lo": 0.0, "hi": math.inf, "weight": "sequence"})]
)
def test_sequence_weights_are_plain_grpo_on_policy_and_sequence_is_off_policy(kind, ckw):
    """The sequence-weighted kinds at C = inf are sequence IS, not the token ratio: they equal plain
    GRPO exactly where mu = pi, and carry prod(rho) / rho_t otherwise."""
    rows, adv, seq = logits_case(12)
    for r in rows:  # on-policy: mu = pi at every token
        r.z_mu = r.z.clone()
        r.mu_list = list(r.pi_list)
    plain, lp, gp = loss_and_grad("grpo", {}, rows, adv, seq)
    out, lc, gc = loss_and_grad("grpo", {}, rows, adv, seq, {"kind": kind, **ckw})
    assert torch.equal(lc, lp) and torch.equal(gc, gp)
    rows, adv, seq = logits_case(12)
    out, lc, gc = loss_and_grad("grpo", {}, rows, adv, seq, {"kind": kind, **ckw})
    plain, lp, _ = loss_and_grad("grpo", {}, rows, adv, seq)
    assert not torch.equal(lc, lp)


def _pi_old_is_pi(batch):
    return batch.logp.detach().clone(), batch.topk_logp.detach().clone()


@pytest.mark.parametrize("name", ["grpo", "dapo"])
@pytest.mark.parametrize("kind,kw", KINDS)
def test_decoupled_with_pi_old_equal_to_pi_is_bypass_bit_for_bit(kind, kw, name):
    """One minibatch: pi_old is the policy itself, so the decoupled update (trust region on
    pi/pi_old = 1, weight f(pi_old/mu)) is the bypass update (ratio pi/mu, factor f/rho) to the bit,
    while rho stays inside the clip range (mu close to pi, as with float32 rollouts)."""
    rows, adv, seq = logits_case(13)
    gen = torch.Generator().manual_seed(3)
    for r in rows:  # mu = pi perturbed by ~1e-3: no token is clipped
        r.z_mu = r.z + 1e-3 * torch.randn(V, generator=gen, dtype=F64)
        lp = torch.log_softmax(r.z_mu, -1)
        r.mu_list = [float(lp[i]) if i >= 0 else x for i, x in zip(r.ids, r.mu_list)]
    cb, lb, gb = loss_and_grad(name, {}, rows, adv, seq, {"kind": kind, **kw})
    cd, ld, gd = loss_and_grad(name, {}, rows, adv, seq, {"kind": kind, "mode": "decoupled", **kw}, old=_pi_old_is_pi)
    if kind == "seq-tis" or kw.get("weight") == "sequence":  # W / rho_t in bypass: equal up to rounding
        assert torch.allclose(ld, lb, rtol=1e-14) and torch.allclose(gd, gb, rtol=1e-12, atol=1e-16)
        return
    assert torch.equal(cd.loss, cb.loss) and torch.equal(cd.mask, cb.mask)
    assert torch.equal(ld, lb) and torch.equal(gd, gb), (kind, kw)


@pytest.mark.parametrize(
    "kind,kw",
    [("none", {}), ("token-tis", {"cap": 1.2}), ("icepop", {"lo": 0.8, "hi": 1.25}), ("seq-tis", {"cap": 1.5})],
)
def test_decoupled_trust_region_is_on_pi_over_pi_old_and_the_weight_on_pi_old_over_mu(kind, kw):
    """pi_old != pi: l_t = c_t * (PPO clip of pi/pi_old), gradient c_t * grad_coef * (e_k - pi)."""
    rows, adv, seq = logits_case(14)
    gen = torch.Generator().manual_seed(4)
    z = torch.stack([r.z for r in rows]).clone().requires_grad_(True)
    batch = batch_from_logits(rows, z, V, seq)
    old_lp = (batch.logp.detach() + 0.3 * torch.randn(batch.n, generator=gen, dtype=F64)).clamp_max(0.0)
    old_top = batch.topk_logp.detach()
    m, p = get_method("grpo"), make_params("grpo")
    corr = make_correction({"kind": kind, "mode": "decoupled", **kw})
    out, c, kb = corrected_token_losses(m, batch, adv, p, corr, old_logp=old_lp, old_topk_logp=old_top)
    (g,) = torch.autograd.grad(out.loss.sum(), z)
    want = ref_correction(
        kind,
        kw,
        "decoupled",
        batch.behavior_logp.tolist(),
        old_lp.tolist(),
        batch.logp.tolist(),
        seq.tolist(),
        adv.tolist(),
    )
    pi = torch.softmax(z.detach(), -1)
    for i, r in enumerate(rows):
        w = math.exp(float(batch.logp[i].detach()) - float(old_lp[i]))
        a = float(adv[i])
        mask = (a > 0 and w > 1.28) or (a < 0 and w < 0.8)
        loss = -min(w * a, min(max(w, 0.8), 1.28) * a) * want[i][0]
        coef = 0.0 if mask else -a * w * want[i][0]
        v = -pi[i]
        v[r.k] += 1.0
        assert abs(float(out.loss[i].detach()) - loss) <= 1e-12 * max(1.0, abs(loss)), i
        assert torch.allclose(g[i], coef * v, atol=1e-12, rtol=1e-10), i
    assert torch.equal(kb.behavior_logp, torch.where(batch.valid, old_lp, batch.behavior_logp))
    assert int(((out.mask & ~c.keep) | out.mask).sum()) > 0


def test_decoupled_batch_keeps_invalid_tokens_invalid_and_checks_shapes():
    mu = torch.tensor([math.log(0.5), NEG_INF, math.log(0.2)], dtype=F64)
    logp = torch.tensor([math.log(0.4), math.log(0.3), math.log(0.1)], dtype=F64)
    b = _batch(mu, logp, torch.tensor([0, 0, 1]))
    old = torch.tensor([math.log(0.45), math.log(0.35), math.log(0.15)], dtype=F64)
    d = decoupled_batch(b, old, old[:, None])
    assert d.valid.tolist() == [True, False, True] and float(d.behavior_logp[2]) == float(old[2])
    with pytest.raises(ValueError, match="pi_old"):
        decoupled_batch(b, old[:2], old[:, None])
    with pytest.raises(ValueError, match="decoupled needs pi_old"):
        corrected_token_losses(
            get_method("grpo"),
            b,
            torch.ones(3, dtype=F64),
            make_params("grpo"),
            make_correction({"kind": "token-tis", "mode": "decoupled"}),
        )


# --------------------------------------------------------------------------- the anchors' own formulas


def padded(seed: int):
    """[B, T] right-padded tensors in the anchors' layout, and the flat tokens masktrl sees."""
    gen = torch.Generator().manual_seed(seed)
    b, t = 6, 7
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(F64)  # response_mask
    rollout = torch.log(torch.rand(b, t, generator=gen, dtype=F64) * 0.9 + 0.05)  # log mu
    old = (rollout + 0.4 * torch.randn(b, t, generator=gen, dtype=F64)).clamp_max(0.0)  # log pi_old / pi
    adv = torch.randn(b, 1, generator=gen, dtype=F64).expand(b, t)
    flat = mask.bool()
    seq = torch.arange(b)[:, None].expand(b, t)[flat]
    return mask, rollout, old, adv, flat, seq


def _flat_factor(kind, kw, rollout, old, adv, flat, seq, mode="decoupled"):
    p = make_correction({"kind": kind, "mode": mode, **kw})
    return correction_weights(p, rollout[flat], old[flat], seq, adv[flat], current_logp=old[flat])


def masked_sum(x, m, dim=-1):
    return (x * m).sum(dim)


def masked_mean(x, m, dim=-1):
    return (x * m).sum(dim) / m.sum(dim).clamp_min(1e-8)


def test_verl_rollout_is_weights_token_and_sequence():
    """verl trainer/ppo/rollout_corr_helper.py, compute_rollout_correction_weights: token
    exp(clamp(log_ratio, -20, 20)).clamp(max=C); sequence exp(clamp(sum log_ratio, -20, 20)).clamp(max=C)."""
    mask, rollout, old, adv, flat, seq = padded(1)
    lr = old - rollout
    for c in (1.2, 2.0):
        token = (torch.exp(lr.clamp(-20, 20)) * mask).clamp(max=c)
        s = torch.exp(masked_sum(lr, mask).clamp(-20, 20))[:, None].expand_as(lr).clamp(max=c)
        assert torch.allclose(
            _flat_factor("token-tis", {"cap": c}, rollout, old, adv, flat, seq).factor, token[flat], rtol=1e-13
        )
        assert torch.allclose(
            _flat_factor("seq-tis", {"cap": c}, rollout, old, adv, flat, seq).factor, s[flat], rtol=1e-13
        )


@pytest.mark.parametrize("stat", RS_STATS)
def test_verl_rejection_options(stat):
    """verl compute_rollout_rejection_mask: k1 = -l, k2 = l^2/2, k3 = exp(l) - 1 - l with
    l = clamp(log_ratio, -20, 20); seq_sum / seq_mean (masked_mean) / seq_max over the response;
    k1 kept iff log(lower) <= stat <= log(upper) (lower = 1/upper by default), others iff stat <= upper."""
    mask, rollout, old, adv, flat, seq = padded(2)
    lr = (old - rollout).clamp(-20, 20)
    k = {"k1": -lr, "k2": 0.5 * lr**2, "k3": torch.exp(lr) - 1.0 - lr}[stat[-2:]]
    if stat.startswith("token"):
        s = k
    elif stat.startswith("seq_sum"):
        s = masked_sum(k, mask)[:, None].expand_as(k)
    elif stat.startswith("seq_mean"):
        s = masked_mean(k, mask)[:, None].expand_as(k)
    else:
        s = k.masked_fill(~mask.bool(), float("-inf")).max(-1).values[:, None].expand_as(k)
    vals = torch.unique(s[flat].abs())  # sorted
    mid = float(vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2  # between two values: some tokens on either side
    upper = math.exp(mid) if stat.endswith("k1") else mid
    keep = ((s >= math.log(1 / upper)) & (s <= math.log(upper))) if stat.endswith("k1") else s <= upper
    got = _flat_factor("rs", {"stat": stat, "hi": upper}, rollout, old, adv, flat, seq)
    assert torch.equal(got.keep, keep[flat]), stat
    assert 0 < int((~got.keep).sum()) < got.keep.numel(), stat


@pytest.mark.parametrize("trl_mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_trl_vllm_importance_sampling_modes(trl_mode):
    """TRL trainer/grpo_trainer.py (_generate_and_score_completions): log-ratio (old - sampling) *
    mask, summed per sequence for sequence_*; exp; *_truncate clamps to [clip_min, clip_max],
    *_mask zeroes ratios outside it; the per-token loss is multiplied by the result. Default
    sequence_mask with clip_max = 3.0."""
    mask, rollout, old, adv, flat, seq = padded(3)
    diff = (old - rollout) * mask
    cmin, cmax = 0.5, 3.0
    ratio = torch.exp(diff.sum(-1, keepdim=True) if trl_mode.startswith("sequence") else diff).expand_as(diff)
    if trl_mode.endswith("truncate"):
        ratio = ratio.clamp(min=cmin, max=cmax)
    else:
        ratio = ratio.masked_fill((ratio < cmin) | (ratio > cmax), 0.0)
    ours = {
        "token_truncate": ("token-tis", {"cap": cmax, "floor": cmin}),
        "token_mask": ("token-mis", {"lo": cmin, "hi": cmax}),
        "sequence_truncate": ("seq-tis", {"cap": cmax, "floor": cmin}),
        "sequence_mask": ("seq-mis", {"lo": cmin, "hi": cmax, "weight": "sequence"}),
    }[trl_mode]
    got = _flat_factor(*ours, rollout, old, adv, flat, seq)
    assert torch.allclose(got.factor, ratio[flat], rtol=1e-13, atol=0), trl_mode
    default = make_correction({"kind": "seq-mis", "weight": "sequence"}).resolved
    assert (default["lo"], default["hi"], default["stat"]) == (0.0, 3.0, "product")  # TRL's default sequence_mask


def test_trl_off_policy_sequence_mask_is_opsm():
    """TRL GRPOTrainer.get_off_policy_mask (DeepSeek-V3.2 Eq. 9): mean over the response of
    sampling_logp - sg(logp); keep iff A >= 0 or that mean <= delta."""
    mask, rollout, _, adv, flat, seq = padded(4)
    gen = torch.Generator().manual_seed(9)
    cur = (rollout + 0.5 * torch.randn(rollout.shape, generator=gen, dtype=F64)).clamp_max(0.0)
    for delta in (0.05, 0.2):
        kl = ((rollout - cur) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
        keep = ((adv >= 0) | (kl <= delta)).expand_as(mask)
        got = correction_weights(
            make_correction({"kind": "opsm", "delta": delta}), rollout[flat], cur[flat], seq, adv[flat]
        )
        assert torch.equal(got.keep, keep[flat]) and torch.equal(got.factor, keep[flat].to(F64))


def test_openrlhf_tis_icepop_and_seq_mask_tis():
    """OpenRLHF models/loss.py PolicyLoss.forward: tis = exp(old - rollout).clamp(lo, hi); icepop =
    ratio * (lo <= ratio <= hi); seq-mask-tis = (lo <= exp(masked_mean(log ratio)) <= hi) * ratio;
    default thresholds [0.5, 5.0]."""
    mask, rollout, old, adv, flat, seq = padded(5)
    lr = old - rollout
    r = torch.exp(lr)
    lo, hi = 0.5, 5.0
    tis = r.clamp(min=lo, max=hi)
    icepop = r * ((r >= lo) & (r <= hi))
    geo = torch.exp(masked_mean(lr, mask))[:, None]
    seq_mask_tis = ((geo >= lo) & (geo <= hi)) * r
    f = lambda kind, kw: _flat_factor(kind, kw, rollout, old, adv, flat, seq).factor  # noqa: E731
    assert torch.allclose(f("token-tis", {"cap": hi, "floor": lo}), tis[flat], rtol=1e-13)
    assert torch.allclose(f("icepop", {}), icepop[flat], rtol=1e-13)
    assert torch.allclose(f("seq-mis", {"lo": lo, "hi": hi, "stat": "geometric"}), seq_mask_tis[flat], rtol=1e-13)
    assert make_correction({"kind": "icepop"}).resolved == {"lo": 0.5, "hi": 5.0}


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "block,field",
    [
        ({"kind": "tis"}, "kind"),
        ({"kind": "token-tis", "mode": "coupled"}, "mode"),
        ({"kind": "token-tis", "cap": 0}, "cap"),
        ({"kind": "seq-tis", "cap": -1.0}, "cap"),
        ({"kind": "token-tis", "cap": float("nan")}, "cap"),
        ({"kind": "token-tis", "cap": "big"}, "cap"),
        ({"kind": "token-tis", "cap": 2.0, "floor": 3.0}, "floor"),
        ({"kind": "token-mis", "lo": 2.0, "hi": 1.0}, "lo"),
        ({"kind": "icepop", "lo": 1.0, "hi": 1.0}, "lo"),
        ({"kind": "icepop", "lo": -0.1}, "lo"),
        ({"kind": "seq-mis", "hi": 0}, "hi"),
        ({"kind": "icepop", "cap": 2.0}, "cap"),
        ({"kind": "token-tis", "lo": 0.5}, "lo"),
        ({"kind": "none", "cap": 2.0}, "cap"),
        ({"kind": "opsm", "hi": 2.0}, "hi"),
        ({"kind": "seq-mis", "stat": "seq_mean_k1"}, "stat"),
        ({"kind": "seq-mis", "weight": "mean"}, "weight"),
        ({"kind": "rs", "stat": "seq_max_k1"}, "stat"),
        ({"kind": "rs", "stat": "seq_mean_k3", "lo": 0.5}, "lo"),
        ({"kind": "rs", "stat": "token_k1", "lo": 2.0, "hi": 1.5}, "lo"),
        ({"kind": "opsm", "delta": -1.0}, "delta"),
        ({"kind": "token-tis", "cutoff": 2.0}, "cutoff"),
    ],
)
def test_bad_correction_blocks_name_the_key(block, field):
    with pytest.raises(ValueError) as exc:
        make_correction(block)
    msg = str(exc.value)
    assert msg.startswith(f"method.correction.{field} ") and "\n" not in msg, msg


def test_params_are_frozen_defaults_and_limits_allowed():
    p = make_correction({"kind": "token-tis"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.cap = 3.0  # type: ignore[misc]
    assert p.resolved == {"cap": 2.0, "floor": None} and not p.decoupled and p.active
    assert not make_correction(None).active and make_correction({"mode": "decoupled"}).active
    assert make_correction({"kind": "rs", "stat": "seq_mean_k1"}).resolved == {
        "stat": "seq_mean_k1",
        "lo": 1 / 1.001,
        "hi": 1.001,
    }
    assert make_correction({"kind": "rs"}).resolved == {"stat": "seq_mean_k3", "lo": None, "hi": 0.01}
    for block in (
        {"kind": "token-tis", "cap": math.inf},
        {"kind": "icepop", "lo": 0.0, "hi": math.inf},
        {"kind": "opsm", "delta": math.inf},
    ):
        make_correction(block)
    assert isinstance(make_correction(p), CorrectionParams)
    with pytest.raises(ValueError, match="must be a mapping"):
        make_correction("token-tis")


# --------------------------------------------------------------------------- CISPO (§15)


def test_cispo_hand_computed_loss_and_gradient():
    """r = 2.0 (A = 1), 0.5 (A = -2), 8.0 (A = 1) with eps_low = 0.2, eps_high = 0.28 and the
    defaults (no lower bound, cap 5): l = -A clip(r), d l/d log pi = -A clip(r); nothing blocked."""
    mu = torch.tensor([math.log(0.2), math.log(0.4), math.log(0.1)], dtype=F64)
    logp = torch.tensor([math.log(0.4), math.log(0.2), math.log(0.8)], dtype=F64, requires_grad=True)
    b = _batch(mu, logp, torch.tensor([0, 1, 2]))
    adv = torch.tensor([1.0, -2.0, 1.0], dtype=F64)
    out = token_losses("cispo", b, adv, eps_low=0.2, eps_high=0.28)
    assert torch.allclose(out.loss, torch.tensor([-1.28, 2 * 0.8, -1.28], dtype=F64))
    (g,) = torch.autograd.grad(out.loss.sum(), logp)
    assert torch.allclose(g, torch.tensor([-1.28, 1.6, -1.28], dtype=F64))
    assert out.mask.tolist() == [False, False, False]  # the clip bounds the weight; no token is blocked
    out = token_losses("cispo", b, adv)  # defaults: [0, 5]
    assert torch.allclose(out.loss, torch.tensor([-2.0, 1.0, -5.0], dtype=F64))
    # GRPO blocks all three (r > 1.28 with A > 0, r < 0.8 with A < 0): CISPO still sends them a clipped gradient
    assert token_losses("grpo", b, adv).mask.tolist() == [True, True, True]
    assert get_method("cispo").aggregation(make_params("cispo")) == "token-mean"
    with pytest.raises(ValueError, match="method.eps_low"):
        make_params("cispo", eps_low=1.5)


def test_cispo_with_a_correction_in_decoupled_mode():
    mu = torch.tensor([math.log(0.2), math.log(0.4)], dtype=F64)
    logp = torch.tensor([math.log(0.4), math.log(0.2)], dtype=F64, requires_grad=True)
    b = _batch(mu, logp, torch.tensor([0, 0]))
    old = torch.tensor([math.log(0.25), math.log(0.3)], dtype=F64)  # rho = 1.25, 0.75
    out, c, _ = corrected_token_losses(
        get_method("cispo"),
        b,
        torch.ones(2, dtype=F64),
        make_params("cispo"),
        make_correction({"kind": "token-tis", "mode": "decoupled", "cap": 1.0}),
        old_logp=old,
        old_topk_logp=old[:, None],
    )
    # r = pi/pi_old = 1.6, 2/3 (inside [0, 5]); weights min(rho, 1) = 1, 0.75
    assert torch.allclose(out.loss, torch.tensor([-1.6, -0.75 * 2 / 3], dtype=F64))
    (g,) = torch.autograd.grad(aggregate(out.loss, b, "token-mean"), logp)
    assert torch.allclose(g, torch.tensor([-0.8, -0.25], dtype=F64))


@pytest.mark.parametrize(
    "name,kw",
    [
        ("grpo", {}),
        ("dapo", {}),
        ("gspo", {"eps_low": 0.1, "eps_high": 0.1}),
        ("dppo", {"divergence": "topk-kl"}),
        ("pdm", {"tail": "uniform"}),
        ("sis", {}),
        ("cispo", {}),
    ],
)
@pytest.mark.parametrize("mode", ["bypass", "decoupled"])
def test_scaling_the_gradient_at_log_pi_is_scaling_the_loss(name, kw, mode):
    """The factor is applied where the gradient enters log pi_t; for every method that equals
    multiplying each token's loss by c_t (each token's loss depends on log pi only through its
    own token), checked against autograd of sum_t c_t l_t."""
    rows, adv, seq = logits_case(21)
    gen = torch.Generator().manual_seed(5)
    z = torch.stack([r.z for r in rows]).clone().requires_grad_(True)
    batch = batch_from_logits(rows, z, V, seq)
    u = torch.rand(batch.n, generator=gen, dtype=F64)
    old_lp = (batch.logp.detach() + 0.2 * torch.randn(batch.n, generator=gen, dtype=F64)).clamp_max(0.0)
    old_top = (batch.topk_logp.detach() + 0.1).clamp_max(0.0)
    m, p = get_method(name), make_params(name, **kw)
    corr = make_correction({"kind": "token-tis", "cap": 1.1, "floor": 0.9, "mode": mode})
    out, c, kb = corrected_token_losses(m, batch, adv, p, corr, old_logp=old_lp, old_topk_logp=old_top, u=u)
    (g,) = torch.autograd.grad(out.loss.sum(), z)
    z2 = z.detach().clone().requires_grad_(True)
    b2 = batch_from_logits(rows, z2, V, seq)
    if mode == "decoupled":
        b2 = decoupled_batch(b2, old_lp, old_top)
    plain = m.token_losses(b2, adv, p, u=u)
    (g2,) = torch.autograd.grad((plain.loss * c.factor).sum(), z2)
    assert torch.allclose(out.loss.detach(), plain.loss.detach() * c.factor, rtol=1e-14, atol=0)
    assert torch.allclose(g, g2, rtol=1e-12, atol=1e-15)
    assert (c.factor != 1).any()
