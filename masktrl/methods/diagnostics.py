"""Per-step token diagnostics shared by every method, so runs compare side by side.

Pure torch, no gradient; returns python floats over the *valid* tokens only
(``behavior_logp > -inf``). Keys whose denominator is empty are omitted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from masktrl.methods.batch import TokenBatch, genuine_entries, log_ratio, tail_mass
from masktrl.methods.divergence import divergence, divergence_rate
from masktrl.methods.masks import delta_of
from masktrl.methods.params import DELTA_KL
from masktrl.methods.registry import TokenLosses, check_advantages


def _mean(x: Tensor) -> float:
    return float(x.to(torch.float64).mean()) if x.numel() else float("nan")


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
    own thresholds for dppo/pdm), else the top-K KL default 0.05. delta(A) = delta_pos if A > 0
    else delta_neg, as in the masks.

    Keys (means over valid tokens):
      n_valid                  number of valid tokens
      mask_frac                fraction with ``out.mask`` (update blocked)
      D_mean, D_p95            D: the method's own divergence, else the top-K KL (union);
                               D_mean averages finite values, D_inf_frac counts D = +inf
      frac_D_over_delta        fraction with D > delta(A)
      ddot_ratio_disagree_frac among tokens with D > delta(A): fraction where
                               sign(Ddot_KL, aggregated tail) != sign(r - 1) (omitted if none)
      sis_accept_rate          accepted / valid (only when ``out.accepted`` is given)
      topk_residual_mass_mean  1 - pi(genuine top-K list)
      ratio_mean, ratio_max    r = pi_k / mu_k
      ppo_kl                   mean of (behavior_logp - logp): the k1 estimator of KL(mu||pi)
    """
    adv = check_advantages(advantages, batch)
    if delta_pos is None or delta_neg is None:
        dp, dn = params.diag_deltas if params is not None else (DELTA_KL, DELTA_KL)
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
    if out.accepted is not None:
        res["sis_accept_rate"] = _mean(out.accepted[valid].float())
    genuine = genuine_entries(batch.topk_ids)  # [N, K]
    pi_list = batch.topk_logp.detach().to(batch.dtype).masked_fill(~genuine, float("-inf"))  # [N, K]
    resid = tail_mass(pi_list)  # [N]
    if batch.vocab_size is not None:
        resid = torch.where(genuine.sum(dim=1) == batch.vocab_size, torch.zeros_like(resid), resid)
    res["topk_residual_mass_mean"] = _mean(resid[valid])
    r = lr.exp()
    res["ratio_mean"] = _mean(r)
    res["ratio_max"] = float(r.max())
    res["ppo_kl"] = _mean(-lr)
    return res
