"""Per-step token diagnostics shared by every method, so runs compare side by side (docs/METHODS.md §12).

Pure torch, no gradient; returns python floats over the *valid* tokens only
(``behavior_logp > -inf``). Keys whose denominator is empty are omitted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from masktrl.methods.batch import TokenBatch, log_ratio, residual_mass, seq_index
from masktrl.methods.divergence import divergence, divergence_rate
from masktrl.methods.masks import delta_of
from masktrl.methods.params import DELTA_DIAG
from masktrl.methods.registry import TokenLosses, check_advantages


def _mean(x: Tensor) -> float:
    return float(x.to(torch.float64).mean()) if x.numel() else float("nan")


def log_importance_deviation(batch: TokenBatch, log_w: Tensor) -> float:
    """Mean over sequences (with a valid token) of D = sum_t |log w_t| over the sequence's valid
    tokens: the SIS paper's pathwise log-importance deviation (§6.1). Detached, float64."""
    valid = batch.valid  # [N]
    inv, g = seq_index(batch)
    dev = torch.where(valid, log_w.detach().to(torch.float64).abs(), torch.zeros((), dtype=torch.float64))  # [N]
    per_seq = torch.zeros(g, dtype=torch.float64, device=dev.device).index_add_(0, inv, dev)  # [G]
    has_valid = torch.zeros(g, dtype=torch.bool, device=dev.device).index_fill_(0, inv[valid], True)  # [G]
    return _mean(per_seq[has_valid])


@torch.no_grad()
def token_diagnostics(
    batch: TokenBatch,
    out: TokenLosses,
    advantages: Tensor,
    params=None,
    *,
    delta_pos: float | None = None,
    delta_neg: float | None = None,
) -> dict[str, float]:
    """Diagnostics of one method's ``token_losses`` output ``out`` on ``batch``.

    Thresholds: explicit ``delta_pos``/``delta_neg``, else ``params.diag_deltas`` (the method's
    own thresholds for dppo/pdm, 0.15 for the others), else 0.15. delta(A) = delta_pos if A > 0
    else delta_neg, as in the masks.

    Keys (means over valid tokens):
      n_valid                  number of valid tokens
      mask_frac                fraction with ``out.mask`` (update blocked)
      D_mean, D_p95            D: the method's own divergence, else the top-K KL (union);
                               D_mean averages finite values, D_inf_frac counts D = +inf
      frac_D_over_delta        fraction with D > delta(A)
      ddot_ratio_disagree_frac among tokens with D > delta(A): fraction where
                               sign(Ddot_KL, aggregated tail) != sign(r - 1) (omitted if none)
      ddot_uncertain_frac      among tokens with D > delta(A) and A != 0: fraction whose Ddot_KL
                               bracket does not fix the sign, lo <= 0 <= hi (pdm tail=bracket
                               only; omitted if none)
      sis_accept_rate          accepted / valid (only when ``out.accepted`` is given)
      log_r_dev                mean over sequences of sum_t |log r_t|: the SIS paper's log-
                               importance deviation D without SIS (every method)
      log_w_dev                the same with the SIS weights, sum_t |log w_t| (D_SIS; accepted
                               tokens add 0). Only when ``out.accepted`` is given (sis)
      topk_residual_mass_mean  1 - pi(genuine top-K list)
      ratio_mean, ratio_max    r = pi_k / mu_k
      ppo_kl                   mean of (behavior_logp - logp): the k1 estimator of KL(mu||pi)
    """
    adv = check_advantages(advantages, batch)
    if delta_pos is None or delta_neg is None:
        dp, dn = params.diag_deltas if params is not None else (DELTA_DIAG, DELTA_DIAG)
        delta_pos = dp if delta_pos is None else delta_pos
        delta_neg = dn if delta_neg is None else delta_neg
    valid = batch.valid  # [N]
    n_valid = int(valid.sum())
    res: dict[str, float] = {"n_valid": float(n_valid)}
    if n_valid == 0:
        return res
    d = out.divergence if out.divergence is not None else divergence(batch, "topk-kl")  # [N]
    d = d.detach()[valid]
    res["mask_frac"] = _mean(out.mask[valid].float())
    finite = torch.isfinite(d)
    res["D_mean"] = _mean(d[finite])
    res["D_inf_frac"] = _mean((~finite).float())
    res["D_p95"] = float(torch.quantile(d.to(torch.float64), 0.95, interpolation="higher"))
    over = d > delta_of(adv[valid], delta_pos, delta_neg)  # [n_valid]
    res["frac_D_over_delta"] = _mean(over.float())
    lr = log_ratio(batch)[valid]  # [n_valid]
    if bool(over.any()):
        ddot = divergence_rate(batch, "kl", "agg")[valid]
        res["ddot_ratio_disagree_frac"] = _mean((torch.sign(ddot[over]) != torch.sign(lr[over])).float())
    if out.ddot_lo is not None and out.ddot_hi is not None:
        sel = over & (adv[valid] != 0)
        if bool(sel.any()):
            lo, hi = out.ddot_lo[valid][sel], out.ddot_hi[valid][sel]
            res["ddot_uncertain_frac"] = _mean(((lo <= 0) & (hi >= 0)).float())
    if out.accepted is not None:
        res["sis_accept_rate"] = _mean(out.accepted[valid].float())
    res["log_r_dev"] = log_importance_deviation(batch, log_ratio(batch))
    if out.accepted is not None and out.log_w is not None:
        res["log_w_dev"] = log_importance_deviation(batch, out.log_w)
    resid = residual_mass(batch.topk_logp.detach().to(batch.dtype), batch.topk_ids, batch.vocab_size)  # [N]
    res["topk_residual_mass_mean"] = _mean(resid[valid])
    r = lr.exp()
    res["ratio_mean"] = _mean(r)
    res["ratio_max"] = float(r.max())
    res["ppo_kl"] = _mean(-lr)
    return res


def keep_decisions(
    adv: Tensor,
    log_r: Tensor,
    ddot_agg: Tensor,
    ddot_uniform: Tensor,
    lo: Tensor | None = None,
    hi: Tensor | None = None,
    ddot_exact: Tensor | None = None,
) -> dict[str, Tensor]:
    """[N] bool per criterion: the direction rule keeps the token's update (does not mask it).

    ratio: masks iff sign(A (r-1)) > 0 (DPPO, §3); ddot_*: masks iff sign(A Ḋ) > 0 (PDM, §4);
    bracket_keep / bracket_mask: PDM tail=bracket with uncertain=keep / mask (§4.6): masks iff
    the bracket certifies A Ḋ > 0 / unless it certifies A Ḋ <= 0.
    """
    out = {
        "ratio": ~(torch.sign(adv * log_r) > 0),  # sign(r - 1) = sign(log r)
        "ddot_agg": ~(torch.sign(adv * ddot_agg) > 0),
        "ddot_uniform": ~(torch.sign(adv * ddot_uniform) > 0),
    }
    if lo is not None and hi is not None:
        out["bracket_keep"] = ~(((adv > 0) & (lo > 0)) | ((adv < 0) & (hi < 0)))
        out["bracket_mask"] = ~(((adv > 0) & (hi > 0)) | ((adv < 0) & (lo < 0)))
    if ddot_exact is not None:
        out["ddot_exact"] = ~(torch.sign(adv * ddot_exact) > 0)
    return out
