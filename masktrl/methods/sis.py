"""Selective importance sampling: the accept/reject test of docs/METHODS.md §6 ("Turning Off-Policy Tokens
On-Policy", arXiv 2607.04728).

Per token, with the behaviour's genuine top-K list T_K (padding dropped, duplicates removed,
no appended k) and its zero-mass entries excluded:

    log M = max_{i in T_K, mu_i > 0} (log pi_i - log mu_i)          top-K envelope
    a     = exp(min(0, log r - log M)) = min(1, r / M)             only if k in T_K and mu_k > 0
    accepted = u < a                                               (strict: a = 0 never accepts)
    log w = 0 if accepted else log r

An accepted token is an exact sample from pi restricted to T_K; the trainer then gives it
weight pi_k / sg(pi_k) (value 1). Where there is no test, ``accept_prob`` is nan.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from masktrl.methods.batch import TokenBatch, list_logps, log_ratio


class SISDecision(NamedTuple):
    accepted: Tensor  # [N] bool
    accept_prob: Tensor  # [N] a = min(1, r/M); nan where no test is made (k outside T_K, invalid)
    log_w: Tensor  # [N] 0 if accepted else log r (+inf on invalid tokens); detached


def check_uniforms(u, n: int) -> None:
    """ValueError naming ``u`` unless it is a float tensor of shape [n] without NaN."""
    if not isinstance(u, Tensor):
        raise ValueError(f"u must be a tensor of uniforms with shape [{n}], got {type(u).__name__}")
    if u.shape != (n,):
        raise ValueError(f"u must have shape [N] = [{n}], got {list(u.shape)}")
    if not u.is_floating_point():
        raise ValueError(f"u must be a floating tensor, got {u.dtype}")
    if bool(torch.isnan(u).any()):
        raise ValueError("u contains NaN")


def sis_envelope(batch: TokenBatch) -> tuple[Tensor, Tensor]:
    """log M [N] over the zero-mass-free genuine list, and k_in [N] (k in T_K)."""
    genuine, k_pos, mu_lp, pi_lp = list_logps(batch)  # [N, K]
    usable = genuine & (mu_lp > float("-inf"))  # [N, K]
    diff = torch.where(usable, pi_lp - mu_lp, torch.full_like(mu_lp, float("-inf")))  # [N, K]
    return diff.amax(dim=1), k_pos.any(dim=1)


def sis_accept(batch: TokenBatch, u: Tensor) -> SISDecision:
    """The SIS decision per token; ``u`` [N] uniforms in [0, 1) from a seeded generator.

    ``u[t]`` is read only where k_t is in the genuine list and mu_k > 0. If pi_k = 0 (log r =
    -inf), a = 0 (also when the envelope is 0 and r/M would be 0/0).
    """
    check_uniforms(u, batch.n)
    dt = batch.dtype
    log_m, k_in = sis_envelope(batch)  # [N], [N]
    lr = log_ratio(batch)  # [N], +inf on invalid
    tested = k_in & batch.valid  # [N]
    gap = torch.where(tested & (lr > float("-inf")), lr - log_m, torch.full_like(lr, float("-inf")))
    a = gap.clamp_max(0.0).exp()  # [N]; exp(-inf) = 0
    accept_prob = torch.where(tested, a, torch.full_like(a, float("nan")))
    accepted = tested & (u.to(a.device, dt) < a)  # u may be drawn on the CPU (a seeded stream)
    log_w = torch.where(accepted, torch.zeros_like(lr), lr)
    return SISDecision(accepted, accept_prob, log_w)
