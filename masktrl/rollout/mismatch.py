"""The training-inference mismatch of a rollout batch: how far the engine's behaviour mu is
from the trainer's pi_old at the same weights (docs/ROLLOUTS.md, "The mismatch, measured").

A real engine samples from its own copy of the weights (bfloat16, FP8, other kernels), so even
right after a weight sync log mu(k) != log pi_old(k). Measured on the sampled tokens k ~ mu,
with ``d = log mu(k) - log pi_old(k)`` and ``r = exp(-d) = pi_old(k) / mu(k)``:

* ``mismatch/logp_abs_mean``, ``mismatch/logp_abs_p99``: mean and 99th percentile (linear
  interpolation, ``torch.quantile``'s default) of ``|d|``;
* ``mismatch/kl_k3``: the k3 estimator of KL(mu || pi_old), the mean of ``(r - 1) - log r`` =
  ``expm1(-d) + d`` (Schulman's k3: unbiased since E_mu[r] = 1, and >= 0 for every token;
  verl's ``kl_penalty="low_var_kl"`` (``verl/trainer/ppo/core_algos.py``) uses the same form);
* ``mismatch/frac_gt_0.5``: the fraction of tokens with ``|d| > 0.5``;
* ``mismatch/tokens``: how many tokens these are over (both log-probabilities finite; a
  token with log mu = -inf is invalid anyway, docs/METHODS.md §7).
"""

from __future__ import annotations

import torch
from torch import Tensor

BIG_GAP = 0.5  # |d| beyond this counts in mismatch/frac_gt_0.5
KEYS = ("mismatch/logp_abs_mean", "mismatch/logp_abs_p99", "mismatch/kl_k3", "mismatch/frac_gt_0.5", "mismatch/tokens")


def mismatch_stats(behavior_logp: Tensor, policy_logp: Tensor) -> dict[str, float]:
    """The mismatch statistics of tokens with recorded ``behavior_logp`` = log mu(k) [N] and the
    trainer's ``policy_logp`` = log pi_old(k) [N] at the weights that sampled them. Computed in
    float64; NaN for every statistic (and 0 tokens) when no token has both finite."""
    mu = behavior_logp.detach().double().reshape(-1)  # [N]
    pi = policy_logp.detach().double().reshape(-1)  # [N]
    if mu.shape != pi.shape:
        raise ValueError(
            f"behavior_logp and policy_logp must have the same number of tokens, got {mu.numel()} and {pi.numel()}"
        )
    ok = torch.isfinite(mu) & torch.isfinite(pi)
    d = (mu - pi)[ok]  # [M] log mu - log pi_old
    if d.numel() == 0:
        nan = float("nan")
        return {
            "mismatch/logp_abs_mean": nan,
            "mismatch/logp_abs_p99": nan,
            "mismatch/kl_k3": nan,
            "mismatch/frac_gt_0.5": nan,
            "mismatch/tokens": 0,
        }
    a = d.abs()
    return {
        "mismatch/logp_abs_mean": a.mean().item(),
        "mismatch/logp_abs_p99": torch.quantile(a, 0.99).item(),
        "mismatch/kl_k3": (torch.expm1(-d) + d).mean().item(),  # (r - 1) - log r, r = exp(-d)
        "mismatch/frac_gt_0.5": (a > BIG_GAP).double().mean().item(),
        "mismatch/tokens": int(d.numel()),
    }
