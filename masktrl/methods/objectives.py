"""GRPO / DAPO / GSPO losses, the registered methods and ``token_losses`` (docs/METHODS.md §2-7).

Each ``@register_method`` kernel maps (batch, advantages [N], params, u) to ``TokenLosses``;
``registry.finalize`` then applies the invalid-token rule. Gradient convention (§0): every
loss depends on the logits only through log pi_k, and d loss / d logp = grad_coef.
Batch aggregation lives in ``aggregation`` (§8), group advantages in ``advantages`` (§11).
"""

from __future__ import annotations

import torch
from torch import Tensor

from masktrl.methods.batch import (
    TokenBatch,
    log_ratio,
    log_ratio_live,
    seq_index,
    support,
    truncate_topk,
    unit_ratio_log,
)
from masktrl.methods.divergence import (
    bracket_on_support,
    divergence,
    rate_on_support,
    rate_topk_exact_on_support,
    topk_kl,
    topk_tv,
)
from masktrl.methods.masks import bracket_mask, dppo_mask, masked_pg_loss, pdm_mask, ppo_clip_loss
from masktrl.methods.params import CISPOParams, DAPOParams, DPPOParams, GRPOParams, GSPOParams, PDMParams, SISParams
from masktrl.methods.registry import Method, TokenLosses, get_method, register_method
from masktrl.methods.sis import sis_accept

# --------------------------------------------------------------------------- shared pieces


def gspo_loss(batch: TokenBatch, adv: Tensor, log_w: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """GSPO token form (§5); returns loss [N] and the per-sequence mask repeated on tokens [N].

    log s = mean of log w over the sequence's valid tokens; s_t = sg(s) pi_t/sg(pi_t);
    l_t = max(-A s_t, -A clip(s_t, 1-eps_low, 1+eps_high)). ``log_w`` [N] is detached.
    """
    valid = batch.valid
    inv, g = seq_index(batch)
    lw = torch.where(valid, log_w, torch.zeros_like(log_w))  # [N]
    total = torch.zeros(g, dtype=lw.dtype, device=lw.device).index_add_(0, inv, lw)  # [G]
    count = torch.zeros(g, dtype=lw.dtype, device=lw.device).index_add_(0, inv, valid.to(lw.dtype))  # [G]
    s = (total / count.clamp_min(1.0)).exp()[inv]  # [N] sequence ratio on each token
    mask = ((adv > 0) & (s > 1 + eps_high)) | ((adv < 0) & (s < 1 - eps_low))  # [N]
    coef = torch.where(mask | (adv == 0), torch.zeros_like(s), -adv * s)  # [N] grad_coef
    unmasked = coef * unit_ratio_log(batch).exp()  # value -A s, gradient -A s d log pi
    clipped = -adv * s.clamp(1 - eps_low, 1 + eps_high)  # value only
    loss = torch.where(mask, clipped, unmasked)
    return torch.where(adv == 0, torch.zeros_like(loss), loss), mask


# --------------------------------------------------------------------------- methods


@register_method("dapo", DAPOParams, "GRPO's token loss, token-mean, dynamic sampling, optional overlong shaping")
@register_method("grpo", GRPOParams, "PPO clip with clip-higher (eps_low 0.2, eps_high 0.28), seq-mean-token-mean")
def ppo_clip(batch: TokenBatch, adv: Tensor, p: GRPOParams | DAPOParams, u: Tensor | None) -> TokenLosses:
    """GRPO and DAPO: l = -min(r A, clip(r, 1-eps_low, 1+eps_high) A), optionally dual-clipped (§2). The two differ only
    in
    their params (aggregation, dynamic sampling, overlong shaping: §8), so one kernel serves both."""
    loss, mask = ppo_clip_loss(log_ratio_live(batch), adv, p.eps_low, p.eps_high, p.dual_clip)
    return TokenLosses(loss, mask, None, None, None, log_ratio(batch))


@register_method("gspo", GSPOParams, "sequence ratio exp(mean log r), sequence clip (eps 3e-4/4e-4)")
def gspo(batch: TokenBatch, adv: Tensor, p: GSPOParams, u: Tensor | None) -> TokenLosses:
    """GSPO (§5)."""
    lw = log_ratio(batch)
    loss, mask = gspo_loss(batch, adv, lw, p.eps_low, p.eps_high)
    return TokenLosses(loss, mask, None, None, None, lw)


@register_method("dppo", DPPOParams, "divergence mask D > delta and sign(A(r-1)) > 0 (binary/top-K TV/KL)")
def dppo(batch: TokenBatch, adv: Tensor, p: DPPOParams, u: Tensor | None) -> TokenLosses:
    """DPPO (§3): mask = D > delta(A) and sign(A (r-1)) > 0; l = -A (1-mask) sg(w) pi_k/sg(pi_k)."""
    d = divergence(batch, p.divergence, rule=p.rule)
    lw = log_ratio(batch)
    mask = dppo_mask(d, lw, adv, *p.deltas) | ~batch.valid  # invalid: masked, w = inf never used
    loss = masked_pg_loss(unit_ratio_log(batch), lw, adv, mask, p.ratio_cap)
    return TokenLosses(loss, mask, d, None, None, lw)


@register_method(
    "pdm",
    PDMParams,
    "predictive divergence mask D > delta and sign(A Ddot) > 0 (top-K KL/TV; "
    "tail=bracket: the full-KL Ddot's sign certified from the list; tail=exact: the "
    "top-K KL's exact Ddot)",
)
def pdm(batch: TokenBatch, adv: Tensor, p: PDMParams, u: Tensor | None) -> TokenLosses:
    """Predictive divergence mask (§4) on the union support; DPPO's loss form. tail=bracket: the
    certified-sign mask of §4.6 (kl only)."""
    if p.tail == "uniform" and batch.vocab_size is None:
        raise ValueError('vocab_size is required for tail="uniform" (TokenBatch.vocab_size is None)')
    s = support(batch, "union")  # shared by D and Ddot
    d = topk_kl(s) if p.divergence == "kl" else topk_tv(s)
    lw = log_ratio(batch)
    if p.tail == "bracket":
        lo, hi = bracket_on_support(s)  # [N], [N]
        mask = bracket_mask(d, lo, hi, adv, *p.deltas, p.uncertain_rule) | ~batch.valid
        loss = masked_pg_loss(unit_ratio_log(batch), lw, adv, mask, p.ratio_cap)
        return TokenLosses(loss, mask, d, None, None, lw, lo, hi)
    if p.tail == "exact":
        if batch.pi_sq_sum is None:
            raise ValueError(
                "method.tail=exact needs the training distribution's sum_V pi^2 "
                "(TokenBatch.pi_sq_sum), "
                "which only a trainer with the full pi can give"
            )
        ddot = rate_topk_exact_on_support(s, batch.pi_sq_sum.detach().to(s.pi_tail.dtype))
    else:
        ddot = rate_on_support(s, p.divergence, p.tail)
    mask = pdm_mask(d, ddot, adv, *p.deltas) | ~batch.valid
    loss = masked_pg_loss(unit_ratio_log(batch), lw, adv, mask, p.ratio_cap)
    return TokenLosses(loss, mask, d, ddot, None, lw)


@register_method("sis", SISParams, "selective importance sampling on grpo|dapo|gspo (needs u)")
def sis(batch: TokenBatch, adv: Tensor, p: SISParams, u: Tensor | None) -> TokenLosses:
    """SIS (§6): accepted tokens get w = pi_k/sg(pi_k) (value 1), others the base's r. With
    ``k``: the envelope and the test use the lists re-cut to k entries (§6.2)."""
    dec = sis_accept(truncate_topk(batch, p.k) if p.k is not None else batch, u)
    base = p.base_params
    if isinstance(base, GSPOParams):
        loss, mask = gspo_loss(batch, adv, dec.log_w, base.eps_low, base.eps_high)
    else:
        live = torch.where(dec.accepted, unit_ratio_log(batch), log_ratio_live(batch))  # [N]
        loss, mask = ppo_clip_loss(live, adv, base.eps_low, base.eps_high, base.dual_clip)
    return TokenLosses(loss, mask, None, None, dec.accepted, dec.log_w)


@register_method(
    "cispo", CISPOParams, "clipped IS weight sg(clip(r, 1-eps_low, 1+eps_high)) A log pi on every token (MiniMax-M1)"
)
def cispo(batch: TokenBatch, adv: Tensor, p: CISPOParams, u: Tensor | None) -> TokenLosses:
    """CISPO (§15): l = -A sg(clip(r, 1-eps_low, 1+eps_high)) pi_k/sg(pi_k); no token is blocked."""
    lw = log_ratio(batch)  # [N] detached; +inf on invalid tokens (zeroed by finalize)
    w = lw.exp().clamp(1 - p.eps_low, 1 + p.eps_high)  # [N] the clipped IS weight
    coef = torch.where(adv == 0, torch.zeros_like(w), -adv * w)  # [N] = grad_coef
    return TokenLosses(coef * unit_ratio_log(batch).exp(), ~batch.valid, None, None, None, lw)


# --------------------------------------------------------------------------- public entry points


def token_losses(
    method: str | Method, batch: TokenBatch, advantages: Tensor, *, u: Tensor | None = None, **params
) -> TokenLosses:
    """Per-token losses of ``method`` (a name or ``Method``) with params given as keywords.

    advantages [N]: the sequence advantage repeated on its tokens. ``u`` [N]: uniforms in
    [0, 1), required by ``sis`` and ignored otherwise. Unknown names/keys raise ValueError.
    """
    m = method if isinstance(method, Method) else get_method(method)
    return m.token_losses(batch, advantages, m.make_params(**params), u=u)
