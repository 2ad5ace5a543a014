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
    """verl b178a3cd, verl/trainer/ppo/core_algos.py:1329-1394 (compute_policy_loss_sapo):
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
    temperatures = torch.where(advantages > 0, torch.tensor(pos, dtype=F64), torch.tensor(neg, dtype=F64))  # float64 here
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
    lr = (batch.logp.detach() - batch.behavior_logp)
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
