"""Divergences D(mu||pi) and their directional derivatives Ddot (docs/METHODS.md §3, §4).

* ``divergence(batch, kind, rule=...)``: binary TV/KL over {k, not k}, and top-K TV/KL over the
  support S plus one aggregated tail bucket (DPPO, arXiv 2602.04879).
* ``divergence_rate(batch, kind, tail)``: Ddot = dD(mu||softmax(z))/dz · v along the
  policy-gradient direction v = e_k - pi, from top-K lists ("atoms with multiplicity", §4.2;
  predictive divergence mask, arXiv 2607.10848). Unnormalised.
* ``ddot_kl_bracket(batch)``: the certified interval of §4.4 for the exact full-vocabulary Ddot_KL.
* ``ddot_topk_exact(batch, pi_sq_sum)``: the exact derivative of the mask's own top-K KL along v,
  from the lists plus one number per token from the full training distribution, sum_V pi_j^2 (§4.7).
* ``divergence_full`` / ``divergence_rate_full``: the exact full-vocabulary D and Ddot from
  [N, V] log-probabilities (§4.1, §4.5), the reference the top-K estimators approximate.

All outputs are stop-gradient, shape [N], in the batch dtype. Values on invalid tokens
(``behavior_logp = -inf``) are unspecified.
"""

from __future__ import annotations

import torch
from torch import Tensor

from masktrl.methods.batch import Support, TokenBatch, check_choice, support

DIVERGENCE_KINDS = ("binary-tv", "binary-kl", "topk-tv", "topk-kl")
RATE_KINDS = ("kl", "tv")
TAILS = ("agg", "uniform")
TAIL_FLOOR = 1e-12  # floor of the training tail inside the KL log (§3)


def kl_term(p_lp: Tensor, q_lp: Tensor) -> Tensor:
    """p (log p - log q) elementwise, with 0 log 0 = 0 and +inf where p > 0 = q.

    "p > 0" is tested on the log-probability (``p_lp > -inf``), never on ``exp(p_lp)``.
    """
    inf = torch.full_like(p_lp, float("inf"))
    term = p_lp.exp() * (p_lp - q_lp)
    term = torch.where(q_lp == float("-inf"), inf, term)
    return torch.where(p_lp == float("-inf"), torch.zeros_like(p_lp), term)


def log1mexp(lp: Tensor) -> Tensor:
    """log(1 - exp(lp)) for lp <= 0 (values above 0 from rounding are treated as 0), stable."""
    lp = lp.clamp_max(0.0)
    small = lp > -0.6931471805599453  # -log 2
    a = torch.log(-torch.expm1(torch.where(small, lp, torch.full_like(lp, -1.0))))
    b = torch.log1p(-torch.exp(torch.where(small, torch.full_like(lp, -1.0), lp)))
    return torch.where(small, a, b)


def divergence(batch: TokenBatch, kind: str, *, rule: str = "union") -> Tensor:
    """[N] D(mu||pi) of ``kind`` ("binary-tv" | "binary-kl" | "topk-tv" | "topk-kl").

    ``rule`` ("union" | "replace_last") chooses the support of the top-K kinds (§1); the binary
    kinds use only (mu_k, pi_k).
    """
    check_choice("kind", kind, DIVERGENCE_KINDS)
    check_choice("rule", rule, ("union", "replace_last"))
    dt = batch.dtype
    mu_lp = batch.behavior_logp.detach().to(dt).clamp_max(0.0)  # [N]
    pi_lp = batch.logp.detach().to(dt).clamp_max(0.0)  # [N]
    if kind == "binary-tv":
        return (pi_lp.exp() - mu_lp.exp()).abs()
    if kind == "binary-kl":
        return kl_term(mu_lp, pi_lp) + kl_term(log1mexp(mu_lp), log1mexp(pi_lp))
    s = support(batch, rule)
    if kind == "topk-kl":
        return topk_kl(s)
    return topk_tv(s)


def topk_kl(s: Support) -> Tensor:
    """[N] sum_{S, mu_i>0} mu_i log(mu_i/pi_i) + [mu_T>0] mu_T log(mu_T / max(pi_T, 1e-12))."""
    atoms = kl_term(s.mu_lp, s.pi_lp).sum(dim=1)  # [N]
    mu_t, pi_t = s.mu_tail, s.pi_tail
    pos = mu_t > 0
    safe_mu = torch.where(pos, mu_t, torch.ones_like(mu_t))
    tail = mu_t * (safe_mu.log() - pi_t.clamp_min(TAIL_FLOOR).log())  # [N]
    return atoms + torch.where(pos, tail, torch.zeros_like(tail))


def topk_tv(s: Support) -> Tensor:
    """[N] 1/2 (sum_S |mu_i - pi_i| + |mu_T - pi_T|)."""
    atoms = (s.mu_lp.exp() - s.pi_lp.exp()).abs().sum(dim=1)  # [N]
    return 0.5 * (atoms + (s.mu_tail - s.pi_tail).abs())


def divergence_rate(batch: TokenBatch, kind: str, tail: str) -> Tensor:
    """[N] Ddot along v = e_k - pi on the union support, §4.2.

    kind "kl": Ddot = (pi_k - mu_k) - sum_S pi_i (pi_i - mu_i) - pi_T (pi_T - mu_T) / n_T
    kind "tv": Ddot = -1/2 [sum_S s_i pi_i (1[i=k] - pi_i - vbar) + s_T pi_T (-pi_T/n_T - vbar)]
    with vbar = pi_k - sum_a pi_a^2 / n_a and s = sign(mu - pi).
    tail "agg": n_T = 1 (no vocab size needed); "uniform": n_T = m = |V| - |S| (needs vocab_size).
    """
    check_choice("kind", kind, RATE_KINDS)
    check_choice("tail", tail, TAILS)
    if tail == "uniform" and batch.vocab_size is None:
        raise ValueError('vocab_size is required for tail="uniform" (TokenBatch.vocab_size is None)')
    return rate_on_support(support(batch, "union"), kind, tail)


def rate_on_support(s: Support, kind: str, tail: str) -> Tensor:
    """[N] Ddot of ``divergence_rate`` from an already computed union support."""
    if tail == "uniform":  # n_T = m; the tail atom is dropped when m = 0
        m = s.m.to(s.pi_tail.dtype)
        share = torch.where(m > 0, s.pi_tail / m.clamp_min(1.0), torch.zeros_like(m))  # [N] pi_T / n_T
    else:
        share = s.pi_tail  # aggregated: n_T = 1 (tails are exactly 0 when m == 0)
    mu, pi = s.mu_lp.exp(), s.pi_lp.exp()  # [N, K+1]
    pi_t, mu_t = s.pi_tail, s.mu_tail  # [N]
    pi_k = (pi * s.is_k).sum(dim=1)  # [N]
    if kind == "kl":
        mu_k = (mu * s.is_k).sum(dim=1)  # [N]
        return (pi_k - mu_k) - (pi * (pi - mu)).sum(dim=1) - share * (pi_t - mu_t)
    vbar = pi_k - (pi * pi).sum(dim=1) - pi_t * share  # [N]
    v = s.is_k.to(pi.dtype) - pi  # [N, K+1]
    sgn = torch.sign(mu - pi)  # [N, K+1]
    atoms = (sgn * pi * (v - vbar[:, None])).sum(dim=1)  # [N]
    tail_term = torch.sign(mu_t - pi_t) * pi_t * (-share - vbar)  # [N]
    return -0.5 * (atoms + tail_term)


def ddot_kl_bracket(batch: TokenBatch) -> tuple[Tensor, Tensor]:
    """[N], [N] the certified bracket [lo, hi] of §4.4 containing the exact Ddot_KL.

    lo = base - pi_T^2,  hi = base - pi_T^2/m + pi_T min(mu_cap, mu_T),
    base = (pi_k - mu_k) - sum_S pi_i (pi_i - mu_i). Assumes the list is the behaviour's true
    top list. m = 0 gives lo = hi = exact. Without vocab_size, m -> inf is used (still certified).
    """
    return bracket_on_support(support(batch, "union"))


def bracket_on_support(s: Support) -> tuple[Tensor, Tensor]:
    """[N], [N] ``ddot_kl_bracket`` from an already computed union support."""
    mu, pi = s.mu_lp.exp(), s.pi_lp.exp()  # [N, K+1]
    pi_k, mu_k = (pi * s.is_k).sum(dim=1), (mu * s.is_k).sum(dim=1)  # [N]
    base = (pi_k - mu_k) - (pi * (pi - mu)).sum(dim=1)  # [N]
    pi_t = s.pi_tail
    lo = base - pi_t * pi_t
    if s.m is None:
        quad = torch.zeros_like(pi_t)
    else:
        m = s.m.to(pi_t.dtype)
        quad = torch.where(m > 0, pi_t * pi_t / m.clamp_min(1.0), torch.zeros_like(pi_t))
    hi = base - quad + pi_t * torch.minimum(s.mu_cap, s.mu_tail)
    return lo, hi


# --------------------------------------------------------------------------- exact derivative of the top-K KL (§4.7)


def ddot_topk_exact(batch: TokenBatch, pi_sq_sum: Tensor) -> Tensor:
    """[N] the exact directional derivative of the top-K KL D_K(mu || softmax(z)) (§3, union
    support) along v = e_k - pi, §4.7.

    ``pi_sq_sum`` [N]: sum over the whole vocabulary of pi_j^2 (the training distribution; see
    ``square_mass`` for computing it from log-probabilities). With Q = sum_{j not in S} pi_j^2 =
    pi_sq_sum - sum_S pi_i^2 and vbar = pi_k - pi_sq_sum:

        Ddot_K = -mu_k + sum_S mu_i pi_i + vbar (mu(S) + mu_T) + mu_T Q / pi_T
               = base - (Q / pi_T) (pi_T - mu_T)           (when mu(S) + mu_T = 1, no clamp)

    base = (pi_k - mu_k) - sum_S pi_i (pi_i - mu_i). Q / pi_T lies in [pi_T / m, pi_T], so the
    value lies between the uniform-tail (Q = pi_T^2 / m) and aggregated-tail (Q = pi_T^2)
    estimates of §4.2, which are this formula with Q replaced by its two extremes. Q is clamped to
    that interval (rounding of the subtraction). The tail derivative uses the unfloored pi_T
    (pi_T = 0 gives Q = 0 and no tail term). m = 0 (the list covers V): equals §4.1.
    """
    if not isinstance(pi_sq_sum, Tensor) or pi_sq_sum.shape != (batch.n,):
        raise ValueError(
            f"pi_sq_sum must be a tensor of shape [N] = [{batch.n}], got "
            f"{getattr(pi_sq_sum, 'shape', type(pi_sq_sum).__name__)}"
        )
    s = support(batch, "union")
    return rate_topk_exact_on_support(s, pi_sq_sum.detach().to(device=s.pi_tail.device, dtype=s.pi_tail.dtype))


def rate_topk_exact_on_support(s: Support, pi_sq_sum: Tensor) -> Tensor:
    """[N] ``ddot_topk_exact`` from an already computed union support."""
    mu, pi = s.mu_lp.exp(), s.pi_lp.exp()  # [N, K+1]
    pi_k, mu_k = (pi * s.is_k).sum(dim=1), (mu * s.is_k).sum(dim=1)  # [N]
    pi_t, mu_t = s.pi_tail, s.mu_tail  # [N]
    q_hi = pi_t * pi_t
    if s.m is None:
        q_lo = torch.zeros_like(pi_t)
    else:
        m = s.m.to(pi_t.dtype)
        q_lo = torch.where(m > 0, q_hi / m.clamp_min(1.0), torch.zeros_like(pi_t))
    q = torch.minimum(torch.maximum(pi_sq_sum - (pi * pi).sum(dim=1), q_lo), q_hi)  # [N] sum of pi_j^2 off S
    ratio = torch.where(pi_t > 0, q / pi_t.clamp_min(torch.finfo(pi_t.dtype).tiny), torch.zeros_like(pi_t))  # Q / pi_T
    vbar = pi_k - pi_sq_sum  # [N] sum_j pi_j v_j
    mu_s = mu.sum(dim=1)  # [N]
    return -mu_k + (mu * pi).sum(dim=1) + vbar * (mu_s + mu_t) + mu_t * ratio


def square_mass(logp: Tensor) -> Tensor:
    """[N] sum_j p_j^2 from [N, V] normalised log-probabilities (the ``pi_sq_sum`` of
    ``ddot_topk_exact``), in their dtype."""
    return torch.logsumexp(2.0 * logp.detach(), dim=-1).exp()


# --------------------------------------------------------------------------- exact, from full log-probabilities


def _check_full(mu_logp: Tensor, pi_logp: Tensor) -> None:
    for name, t in (("mu_logp", mu_logp), ("pi_logp", pi_logp)):
        if not isinstance(t, Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise ValueError(
                f"{name} must be a floating tensor of shape [N, V], got {getattr(t, 'shape', type(t).__name__)}"
            )
    if mu_logp.shape != pi_logp.shape:
        raise ValueError(
            f"mu_logp and pi_logp must have the same shape [N, V], got {list(mu_logp.shape)} and {list(pi_logp.shape)}"
        )


def divergence_full(mu_logp: Tensor, pi_logp: Tensor, kind: str) -> Tensor:
    """[N] the exact D(mu||pi) over the whole vocabulary (§4.5), kind "kl" | "tv".

    ``mu_logp``, ``pi_logp`` [N, V]: normalised log-probabilities (``log_softmax`` of the logits);
    ``mu_logp`` may hold -inf (zero-mass tokens). KL = sum_{mu_i>0} mu_i (log mu_i - log pi_i),
    +inf where some mu_i > 0 has pi_i = 0; TV = 1/2 sum |mu_i - pi_i|. Detached, in the inputs'
    promoted dtype.
    """
    check_choice("kind", kind, RATE_KINDS)
    _check_full(mu_logp, pi_logp)
    dt = torch.promote_types(mu_logp.dtype, pi_logp.dtype)
    mu_lp, pi_lp = mu_logp.detach().to(dt), pi_logp.detach().to(dt)  # [N, V]
    if kind == "kl":
        return kl_term(mu_lp, pi_lp).sum(dim=1)
    return 0.5 * (mu_lp.exp() - pi_lp.exp()).abs().sum(dim=1)


def divergence_rate_full(mu_logp: Tensor, pi_logp: Tensor, sampled: Tensor, kind: str) -> Tensor:
    """[N] the exact Ddot of §4.1 along v = e_k - pi, from full log-probabilities (§4.5).

    KL: Ddot = (pi_k - mu_k) - sum_j pi_j (pi_j - mu_j)
    TV: Ddot = -1/2 sum_i s_i pi_i (v_i - vbar),  s_i = sign(mu_i - pi_i),  vbar = pi_k - sum_j pi_j^2
    ``sampled`` [N]: k (long). Inputs as in ``divergence_full``; -inf behaviour entries are
    zero-mass tokens. Detached, in the inputs' promoted dtype.
    """
    check_choice("kind", kind, RATE_KINDS)
    _check_full(mu_logp, pi_logp)
    if not isinstance(sampled, Tensor) or sampled.shape != mu_logp.shape[:1] or sampled.is_floating_point():
        raise ValueError(f"sampled must be an integer tensor of shape [N] = [{mu_logp.shape[0]}]")
    dt = torch.promote_types(mu_logp.dtype, pi_logp.dtype)
    mu, pi = mu_logp.detach().to(dt).exp(), pi_logp.detach().to(dt).exp()  # [N, V]
    k = sampled.to(device=pi.device, dtype=torch.long)[:, None]  # [N, 1]
    pi_k, mu_k = pi.gather(1, k).squeeze(1), mu.gather(1, k).squeeze(1)  # [N]
    if kind == "kl":
        return (pi_k - mu_k) - (pi * (pi - mu)).sum(dim=1)
    vbar = pi_k - (pi * pi).sum(dim=1)  # [N]
    v = torch.zeros_like(pi).scatter_(1, k, 1.0) - pi  # [N, V]
    return -0.5 * (torch.sign(mu - pi) * pi * (v - vbar[:, None])).sum(dim=1)
