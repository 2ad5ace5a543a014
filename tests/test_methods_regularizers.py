"""Reference KL and entropy bonus (docs/METHODS.md §13): each KL estimator's value and gradient
against float64 formulas and autograd, the estimators' expectations over a whole small vocabulary
(on-policy and, with the importance weight, off-policy), the in-reward penalty, the loss terms,
their limit cases and the parameter validation of every method."""

from __future__ import annotations

import math

import pytest
import torch

from masktrl.methods import (
    KL_ESTIMATORS,
    RegularizerParams,
    TokenBatch,
    aggregate,
    get_method,
    kl_estimate,
    kl_reward_penalty,
    make_params,
    method_names,
    reference_kl,
    regularize,
)

F64 = torch.float64
NEG_INF = float("-inf")


def plain(x: float, estimator: str) -> float:
    """The anchors' definitions on one token, x = log pi - log pi_ref (verl kl_penalty_forward)."""
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x * x
    xc = x if estimator == "k3" else min(max(x, -20.0), 20.0)
    k3 = math.expm1(-xc) + xc  # exp(-x) - 1 + x without the cancellation near 0
    return k3 if estimator == "k3" else min(max(k3, -10.0), 10.0)


def plain_grad(x: float, estimator: str) -> float:
    """d estimate / d log pi."""
    if estimator == "k1":
        return 1.0
    if estimator == "k2":
        return x
    if estimator == "low_var_kl" and (abs(x) > 20 or math.expm1(-x) + x > 10):
        return 0.0
    return -math.expm1(-x)


XS = [-25.0, -3.0, -0.7, -1e-9, 0.0, 1e-9, 0.4, 2.5, 13.0, 30.0]


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_estimator_value_and_gradient_match_the_formulas(estimator):
    ref = torch.tensor([0.1 * i - 2.0 for i in range(len(XS))], dtype=F64)
    logp = (ref + torch.tensor(XS, dtype=F64)).requires_grad_(True)
    kl = kl_estimate(logp, ref, estimator)
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    for i, x in enumerate(XS):
        x = float(logp[i].detach() - ref[i])
        want = plain(x, estimator)
        assert math.isclose(float(kl[i].detach()), want, rel_tol=1e-12, abs_tol=1e-300), (x, float(kl[i]), want)
        assert math.isclose(float(grad[i]), plain_grad(x, estimator), rel_tol=1e-9, abs_tol=1e-12), x
    if estimator != "k1":
        assert bool((kl >= 0).all())  # k2, k3, low_var_kl are non-negative
    # near x = 0, k3 keeps its relative accuracy (expm1): x^2/2 - x^3/6
    tiny = kl_estimate(torch.tensor([1e-6], dtype=F64), torch.tensor([0.0], dtype=F64), "k3")
    assert math.isclose(float(tiny), 0.5e-12 - 1e-18 / 6, rel_tol=1e-9)


def test_low_var_kl_is_k3_clamped_and_k3_is_not():
    x = torch.tensor([-25.0, 13.0, 8.0, 0.3], dtype=F64)
    zero = torch.zeros(4, dtype=F64)
    low, k3 = kl_estimate(x, zero, "low_var_kl"), kl_estimate(x, zero, "k3")
    assert low.tolist()[:2] == [10.0, 10.0]  # k3(-20) = e^20 - 21 and k3(13) = 12 + e^-13, both clamped
    assert float(k3[0]) == pytest.approx(math.exp(25) - 26) and float(k3[1]) == pytest.approx(12 + math.exp(-13))
    assert torch.equal(low[2:], k3[2:])  # inside the clamps the two are the same


def token_batch(logp: torch.Tensor, mu: torch.Tensor, seq=None) -> TokenBatch:
    n = logp.shape[0]
    ids = torch.arange(n) % 5
    return TokenBatch(
        logp,
        mu,
        ids,
        ids[:, None].clone(),
        mu[:, None].clone(),
        logp.detach()[:, None].clone(),
        torch.zeros(n, dtype=torch.long) if seq is None else torch.as_tensor(seq),
        vocab_size=None,
    )


def vocab_batch(z: torch.Tensor, mu_logits: torch.Tensor) -> TokenBatch:
    """One position, every vocabulary token as one 'sample': logp = log softmax(z)[k]."""
    v = z.shape[0]
    logp = torch.log_softmax(z, 0)
    mu = torch.log_softmax(mu_logits, 0)
    ids = torch.arange(v)
    return TokenBatch(
        logp,
        mu,
        ids,
        ids[:, None].clone(),
        mu[:, None].clone(),
        logp.detach()[:, None].clone(),
        torch.zeros(v, dtype=torch.long),
        vocab_size=v,
    )


def full_kl(z: torch.Tensor, ref_lp: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(z, 0)
    return (lp.exp() * (lp - ref_lp)).sum()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_expectations_over_a_whole_vocabulary(seed):
    """Sum over every token k weighted by the sampling distribution: the exact expectation of each
    estimator and of its gradient with respect to the logits, against KL(pi || ref) and autograd."""
    gen = torch.Generator().manual_seed(seed)
    v = 7
    z = torch.randn(v, generator=gen, dtype=F64).requires_grad_(True)
    ref_lp = torch.log_softmax(torch.randn(v, generator=gen, dtype=F64), 0)
    mu_logits = torch.randn(v, generator=gen, dtype=F64)
    (grad_kl,) = torch.autograd.grad(full_kl(z, ref_lp), z)
    kl_value = float(full_kl(z, ref_lp))

    def expect(sampling: torch.Tensor, estimator: str, is_correction: bool):
        b = vocab_batch(z, sampling if sampling is not None else z.detach())
        w = torch.softmax(sampling if sampling is not None else z.detach(), 0)  # the samples' distribution
        est = reference_kl(b, ref_lp, estimator, is_correction=is_correction)
        value = (w * est).sum()
        (g,) = torch.autograd.grad(value, z)
        return float(value), g

    # on-policy samples (mu = pi): k1 and k3 have the KL as expectation; k2's gradient is grad KL
    for est in ("k1", "k3"):
        value, _ = expect(None, est, False)
        assert math.isclose(value, kl_value, rel_tol=1e-12)
    _, g_k2 = expect(None, "k2", False)
    assert torch.allclose(g_k2, grad_kl, atol=1e-13)
    _, g_k3 = expect(None, "k3", False)
    assert not torch.allclose(g_k3, grad_kl, atol=1e-3)  # k3's gradient is biased even on-policy
    # off-policy samples (mu != pi): the weight pi/mu makes the value, and for k1 and k3 the gradient, unbiased
    for est in ("k1", "k3"):
        value, g = expect(mu_logits, est, True)
        assert math.isclose(value, kl_value, rel_tol=1e-12)
        assert torch.allclose(g, grad_kl, atol=1e-13), est
        biased, _ = expect(mu_logits, est, False)
        assert abs(biased - kl_value) > 1e-3  # without the weight the estimate is off
    value, _ = expect(mu_logits, "k2", True)
    k2_pi, _ = expect(None, "k2", False)
    assert math.isclose(value, k2_pi, rel_tol=1e-12)  # the weight turns E_mu into E_pi for any estimator


def test_is_correction_gradient_by_hand_and_low_var_clamps_after_the_weight():
    # d(r k)/d log pi = r (k + dk/dlogp);  r = exp(log pi - log mu)
    logp = torch.tensor([-0.5, -1.0, -2.0, -0.1], dtype=F64, requires_grad=True)
    mu = torch.tensor([-1.5, -0.2, -2.0, -9.0], dtype=F64)
    ref = torch.tensor([-0.9, -3.0, -1.0, -0.1], dtype=F64)
    b = token_batch(logp, mu)
    for est in ("k1", "k2", "k3"):
        out = reference_kl(b, ref, est, is_correction=True)
        (g,) = torch.autograd.grad(out.sum(), logp)
        for i in range(4):
            x, r = float(logp[i] - ref[i]), math.exp(float(logp[i] - mu[i]))
            assert math.isclose(float(out[i]), r * plain(x, est), rel_tol=1e-12, abs_tol=1e-15)
            assert math.isclose(float(g[i]), r * (plain(x, est) + plain_grad(x, est)), rel_tol=1e-12, abs_tol=1e-15)
    low = reference_kl(b, ref, "low_var_kl", is_correction=True)
    r3 = math.exp(-0.1 + 9.0)  # token 3: x = 0, k3 = 0, r huge -> 0; token 1: r k3 large -> clamped at 10
    assert float(low[3]) == 0.0 and r3 > 1e3
    raw1 = math.exp(-1.0 + 0.2) * plain(2.0, "k3")
    assert float(low[1]) == pytest.approx(min(raw1, 10.0), rel=1e-12)
    big = reference_kl(
        token_batch(torch.tensor([5.0], dtype=F64), torch.tensor([0.0], dtype=F64)),
        torch.tensor([-3.0], dtype=F64),
        "low_var_kl",
        is_correction=True,
    )
    assert float(big) == 10.0  # r = e^5, k3(8) ~ 7: the product is clamped, not the factor


def test_invalid_tokens_get_no_kl_and_no_gradient():
    logp = torch.tensor([-0.5, -1.0, -2.0], dtype=F64, requires_grad=True)
    mu = torch.tensor([-0.6, NEG_INF, -2.1], dtype=F64)
    ref = torch.tensor([-1.0, float("nan"), -2.0], dtype=F64)  # garbage where the token is invalid is ignored
    b = token_batch(logp, mu)
    for est in KL_ESTIMATORS:
        for corr in (False, True):
            out = reference_kl(b, ref, est, is_correction=corr)
            (g,) = torch.autograd.grad(out.sum(), logp)
            assert float(out[1]) == 0.0 and float(g[1]) == 0.0 and bool(torch.isfinite(g).all())
    with pytest.raises(ValueError, match="ref_logp contains NaN"):
        reference_kl(b, torch.tensor([float("nan"), -1.0, -2.0], dtype=F64), "k3")
    with pytest.raises(ValueError, match="ref_logp must have shape"):
        reference_kl(b, ref[:2], "k3")
    with pytest.raises(ValueError, match="estimator must be one of"):
        kl_estimate(logp, ref, "k4")


def test_kl_reward_penalty_is_verl_apply_kl_penalty_for_an_outcome_reward():
    mu = torch.tensor([-0.5, -1.0, NEG_INF, -2.0, -0.3], dtype=F64)
    ref = torch.tensor([-0.7, -0.4, -1.0, -2.5, -0.3], dtype=F64)
    seq = torch.tensor([4, 4, 4, 1, 1])  # sorted by id: sequence 1 first
    for est in KL_ESTIMATORS:
        got = kl_reward_penalty(mu, ref, seq, est, 0.05)
        s4 = plain(0.2, est) + plain(-0.6, est)  # the invalid token is left out
        s1 = plain(0.5, est) + plain(0.0, est)
        assert got.dtype == F64 and got.tolist() == pytest.approx([0.05 * s1, 0.05 * s4], rel=1e-12)
    assert kl_reward_penalty(mu, ref, seq, "k3", 0.0).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="method.kl_coef must be >= 0"):
        kl_reward_penalty(mu, ref, seq, "k3", -0.1)


def test_regularize_adds_the_terms_before_aggregation():
    gen = torch.Generator().manual_seed(3)
    n = 9
    logp = (-torch.rand(n, generator=gen, dtype=F64) * 3).requires_grad_(True)
    mu = -torch.rand(n, generator=gen, dtype=F64) * 3
    mu[4] = NEG_INF
    ref = -torch.rand(n, generator=gen, dtype=F64) * 3
    ent = (torch.rand(n, generator=gen, dtype=F64) * 2).requires_grad_(True)
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    b = token_batch(logp, mu, seq)
    adv = torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5, 0.3, 0.3, 0.3, 0.3], dtype=F64)
    for name in ("grpo", "dapo", "dppo", "sis"):
        method = get_method(name)
        p = make_params(name, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
        u = torch.rand(n, generator=gen, dtype=F64) if method.needs_u(p) else None
        losses = method.token_losses(b, adv, p, u=u)
        reg = method.regularize(p, losses.loss, b, ref_logp=ref, entropy=ent)
        kl = reference_kl(b, ref, "k3")
        valid = b.valid
        want = torch.where(valid, losses.loss + 0.1 * kl - 0.01 * ent, torch.zeros(n, dtype=F64))
        assert torch.allclose(reg.loss, want, atol=1e-15, rtol=0)
        assert torch.equal(reg.kl, kl) and float(reg.entropy[4]) == 0.0
        # aggregation is linear: the batch loss is the method's plus the two aggregated terms
        mode = method.aggregation(p)
        whole = method.aggregate(p, reg.loss, b, horizon=8)
        parts = (
            aggregate(losses.loss, b, mode, norm_len=8)
            + 0.1 * aggregate(kl, b, mode, norm_len=8)
            - 0.01 * aggregate(torch.where(valid, ent, torch.zeros_like(ent)), b, mode, norm_len=8)
        )
        assert torch.allclose(whole, parts, atol=1e-14, rtol=0)
        g_logp, g_ent = torch.autograd.grad(whole, [logp, ent])
        assert float(g_ent[4]) == 0.0 and float(g_logp[4]) == 0.0
        assert bool((g_ent[valid] < 0).all())  # the bonus pushes every valid token's entropy up


def test_limit_cases_return_the_methods_own_loss():
    logp = torch.tensor([-0.5, -1.0], dtype=F64, requires_grad=True)
    b = token_batch(logp, torch.tensor([-0.6, -0.9], dtype=F64))
    loss = -logp * 2.0
    for p in (make_params("grpo"), make_params("pdm", kl_coef=0.3, kl_in="reward"), RegularizerParams()):
        out = regularize(loss, b, p)  # no reference or entropy needed
        assert out.loss is loss and out.kl is None and out.entropy is None
    with pytest.raises(ValueError, match="ref_logp is required"):
        regularize(loss, b, make_params("grpo", kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy must have shape"):
        regularize(loss, b, make_params("grpo", entropy_coef=0.1))
    p = make_params("gspo", kl_coef=0.2)
    m = get_method("gspo")
    assert m.needs_reference(p) and not m.needs_entropy_grad(p)
    assert not m.needs_reference(make_params("gspo")) and m.needs_entropy_grad(make_params("gspo", entropy_coef=1e-3))
    q = make_params("gspo", kl_coef=0.2, kl_in="reward")
    assert q.kl_in_reward and not q.kl_in_loss and q.uses_reference


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "dppo", "pdm", "sis"])
@pytest.mark.parametrize(
    "kw,match",
    [
        ({"kl_estimator": "k4"}, "method.kl_estimator must be one of k1, k2, k3, low_var_kl; got 'k4'"),
        ({"kl_coef": -0.01}, "method.kl_coef must be >= 0, got -0.01"),
        ({"entropy_coef": -1}, "method.entropy_coef must be >= 0, got -1"),
        ({"kl_coef": float("nan")}, "method.kl_coef must be finite"),
        ({"kl_coef": True}, "method.kl_coef must be a number"),
        ({"kl_in": "advantage"}, "method.kl_in must be one of loss, reward; got 'advantage'"),
        ({"kl_is_correction": "yes"}, "method.kl_is_correction must be true or false"),
        ({"kl_is_correction": True, "kl_in": "reward"}, "kl_is_correction applies only with method.kl_in=loss"),
    ],
)
def test_bad_values_are_named_for_every_method(name, kw, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        make_params(name, **kw)


def test_every_method_takes_the_fields_with_off_defaults():
    for name in method_names():
        p = make_params(name)
        assert (p.kl_coef, p.kl_estimator, p.kl_in, p.kl_is_correction, p.entropy_coef) == (
            0.0,
            "low_var_kl",
            "loss",
            False,
            0.0,
        )
        q = make_params(name, kl_coef=0.01, kl_estimator="k2", entropy_coef=0.001, kl_is_correction=True)
        assert q.kl_in_loss and q.uses_entropy_grad and q.kl_estimator == "k2"
    sis = make_params("sis", base="dapo", kl_coef=0.02)
    assert sis.kl_coef == 0.02 and sis.base_params.kl_coef == 0.0  # the regularisers are sis's own
