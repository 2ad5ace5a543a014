"""Clip-Cov and KL-Cov ("The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617),
verl's ``clip_cov`` and ``kl_cov`` losses (docs/METHODS.md §16.3, §16.4).

Both score each valid token of the batch by the centred covariance term

    cov_t = (A_t - mean A) (log pi_t - mean log pi)          means over the batch's valid tokens

* Clip-Cov: PPO clip (§2), and a random ``max(1, floor(ratio * n_valid))`` of the unclipped tokens
  with lb < cov_t < ub get loss 0 and no gradient (``mask``). verl draws them with ``torch.randperm``;
  masktrl draws them with the step's seeded uniforms ``u`` (the ones with the smallest u).
* KL-Cov: l = -A r on every token (no clip), plus ``ppo_kl_coef |log r|`` on the
  ``max(1, floor(ratio * n_valid))`` tokens with the largest cov_t.

Both read the whole batch the kernel sees (verl: the micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from masktrl.methods.batch import TokenBatch, log_ratio, log_ratio_live
from masktrl.methods.masks import ppo_clip_loss
from masktrl.methods.params import _common, _eps, _number, _Protocol
from masktrl.methods.registry import TokenLosses, register_method


def centred_cov(batch: TokenBatch, adv: Tensor) -> Tensor:
    """[N] (A - mean A)(log pi - mean log pi) over the valid tokens (detached); -inf on invalid."""
    valid = batch.valid
    lp = batch.logp.detach().to(batch.dtype)
    n = valid.sum().clamp_min(1).to(lp.dtype)
    a_mean = torch.where(valid, adv, torch.zeros_like(adv)).sum() / n
    lp_mean = torch.where(valid, lp, torch.zeros_like(lp)).sum() / n
    cov = (adv - a_mean) * (lp - lp_mean)
    return torch.where(valid, cov, torch.full_like(cov, float("-inf")))


def _count(ratio: float, valid: Tensor) -> int:
    return max(int(ratio * int(valid.sum())), 1)


@dataclass(frozen=True)
class ClipCovParams(_Protocol):
    """Clip-Cov: PPO clip plus a few high-covariance tokens detached (§16.3)."""

    eps_low: float = 0.2
    """PPO lower clip (verl clip_ratio_low, default 0.2)."""
    eps_high: float = 0.2
    """PPO upper clip (verl clip_ratio_high, default 0.2)."""
    clip_cov_ratio: float = 0.0002
    """Fraction of the valid tokens detached (verl policy_loss.clip_cov_ratio); at least one."""
    clip_cov_lb: float = 1.0
    """Only tokens with cov > lb are candidates (verl policy_loss.clip_cov_lb)."""
    clip_cov_ub: float = 5.0
    """Only tokens with cov < ub are candidates (verl policy_loss.clip_cov_ub)."""
    loss_agg: str = "token-mean"
    """Batch aggregation (§8); verl's default token-mean."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""

    def __post_init__(self) -> None:
        _eps(self)
        _number("clip_cov_ratio", self.clip_cov_ratio, lo=0, hi=1)
        if self.clip_cov_ratio <= 0:
            raise ValueError(f"method.clip_cov_ratio must be > 0, got {self.clip_cov_ratio!r}")
        _number("clip_cov_lb", self.clip_cov_lb, inf_ok=True)
        _number("clip_cov_ub", self.clip_cov_ub, inf_ok=True)
        _common(self)

    @property
    def uses_u(self) -> bool:
        return True


@register_method(
    "clip-cov",
    ClipCovParams,
    "PPO clip; a random few tokens with lb < cov(A, log pi) < ub detached (verl clip_cov; needs u)",
)
def clip_cov(batch: TokenBatch, adv: Tensor, p: ClipCovParams, u: Tensor | None) -> TokenLosses:
    """Clip-Cov (§16.3)."""
    loss, clip = ppo_clip_loss(log_ratio_live(batch), adv, p.eps_low, p.eps_high)
    cov = centred_cov(batch, adv)  # [N]
    cand = (cov > p.clip_cov_lb) & (cov < p.clip_cov_ub) & ~clip & batch.valid  # [N]
    key = torch.where(cand, u.to(cov.dtype), torch.full_like(cov, float("inf")))  # [N]
    take = min(_count(p.clip_cov_ratio, batch.valid), int(cand.sum()))
    chosen = torch.zeros_like(cand)
    if take:
        chosen[torch.topk(key, take, largest=False).indices] = True
    loss = torch.where(chosen, torch.zeros_like(loss), loss)  # verl: pg_losses * corr, corr = 0
    return TokenLosses(loss, clip | chosen, None, None, None, log_ratio(batch))


@dataclass(frozen=True)
class KLCovParams(_Protocol):
    """KL-Cov: l = -A r, plus ppo_kl_coef |log r| on the top-covariance tokens (§16.4)."""

    kl_cov_ratio: float = 0.0002
    """Fraction of the valid tokens penalised (verl policy_loss.kl_cov_ratio); at least one."""
    ppo_kl_coef: float = 0.1
    """Coefficient of |log r| on them (verl policy_loss.ppo_kl_coef, default 0.1 in actor.yaml)."""
    loss_agg: str = "token-mean"
    """Batch aggregation (§8); verl's default token-mean."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and refill the batch (DAPO)."""
    adv_norm: str = "group-std"
    """Advantages (§11, §13.4): group-std (GRPO) | none (Dr.GRPO) | rloo | batch-std | reinforce++[-baseline]."""

    def __post_init__(self) -> None:
        _number("kl_cov_ratio", self.kl_cov_ratio, lo=0, hi=1)
        if self.kl_cov_ratio <= 0:
            raise ValueError(f"method.kl_cov_ratio must be > 0, got {self.kl_cov_ratio!r}")
        _number("ppo_kl_coef", self.ppo_kl_coef, lo=0)
        _common(self)


@register_method(
    "kl-cov", KLCovParams, "-A r on every token, + ppo_kl_coef |log r| on the top-covariance tokens (verl kl_cov)"
)
def kl_cov(batch: TokenBatch, adv: Tensor, p: KLCovParams, u: Tensor | None) -> TokenLosses:
    """KL-Cov (§16.4)."""
    live = log_ratio_live(batch)  # [N]
    loss = -adv * live.exp()  # [N] no clip
    cov = centred_cov(batch, adv)
    n_valid = int(batch.valid.sum())
    top = torch.zeros_like(batch.valid)
    if n_valid:
        top[torch.topk(cov, _count(p.kl_cov_ratio, batch.valid)).indices] = True
        top &= batch.valid
    loss = torch.where(top, loss + p.ppo_kl_coef * live.abs(), loss)
    return TokenLosses(loss, ~batch.valid, None, None, None, log_ratio(batch))
