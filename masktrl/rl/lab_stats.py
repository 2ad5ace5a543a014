"""Whether a run can tell the trust-region methods apart, measured on the run itself
(``train.lab_stats``; docs/LAB.md).

Two sources, reported per step in ``metrics.jsonl`` (keys ``lab/...``) and summarised in
``summary.json`` (``lab_stats``):

* the **rollout batch** (what the behaviour policy mu recorded), ``behaviour_stats``: the
  residual mass ``1 - mu(top-K list)`` of each response token (quantiles, fraction >= 0.01)
  and the fraction of sampled tokens outside the list. With a list that covers the whole
  vocabulary both are 0: every tail estimator is exact and SIS never meets an unlisted token.
* the **update** (the forward pass each minibatch trains on), ``LabStats`` as a
  ``policy_update`` ``before`` hook: tokens with D > delta (top-K KL, delta 0.15, A != 0), among
  them those where the ratio rule sign(A (r - 1)) and the predictive rule sign(A Ddot_KL) with
  the aggregated or the uniform tail do not all make the same keep/mask decision (the
  disagreement tokens of ``masktrl analyze disagreement``), and the tokens where the two tails'
  Ddot have different signs. With one on-policy minibatch pi = mu and all are 0.
"""

from __future__ import annotations

import torch

from masktrl.methods import divergence, divergence_rate
from masktrl.methods.batch import log_ratio, outside_list, residual_mass
from masktrl.methods.diagnostics import keep_decisions
from masktrl.rollout.base import behaviour_lists

LAB_DELTA = 0.15  # the papers' trust-region radius for the top-K KL
RESIDUAL_MIN = 0.01  # "residual mass >= 0.01": the tail is not negligible
QUANTILES = (0.1, 0.5, 0.9)
COUNTS = ("over_delta", "disagree", "disagree_ratio_agg", "tails_differ")


def behaviour_stats(samples, vocab_size: int | None) -> dict[str, float]:
    """Residual mass and unlisted sampled tokens of a rollout batch (its response tokens)."""
    sampled, ids, lps = behaviour_lists(samples)  # [N], [N, K], [N, K]
    if not len(sampled):
        return {}
    resid = residual_mass(lps, ids, vocab_size)  # [N]
    q = torch.quantile(resid, torch.tensor(QUANTILES, dtype=torch.float64))
    return {
        **{f"lab/resid_p{round(p * 100):02d}": float(v) for p, v in zip(QUANTILES, q)},
        "lab/resid_ge_0.01_frac": float((resid >= RESIDUAL_MIN).double().mean()),
        "lab/outside_topk_frac": float(outside_list(sampled, ids).double().mean()),
    }


@torch.no_grad()
def update_counts(batch, advantages: torch.Tensor, delta: float = LAB_DELTA) -> dict[str, int]:
    """Counts over the valid tokens of one minibatch's ``TokenBatch``:

    over_delta: D > delta (top-K KL), D finite, A != 0; disagree: of those, the keep decisions of
    sign(A log r) and sign(A Ddot_KL) with both tails are not unanimous; disagree_ratio_agg: of
    those, ratio vs the aggregated tail alone; tails_differ: sign(Ddot agg) != sign(Ddot uniform)
    (every valid token). Without ``batch.vocab_size`` the uniform tail is unknown: disagree is
    then ratio vs agg and tails_differ 0.
    """
    adv = advantages.detach().to(torch.float64)
    d = divergence(batch, "topk-kl").detach().to(torch.float64)  # [N]
    agg = divergence_rate(batch, "kl", "agg").detach()  # [N]
    uni = divergence_rate(batch, "kl", "uniform").detach() if batch.vocab_size is not None else agg
    keep = keep_decisions(adv, log_ratio(batch).detach().to(torch.float64), agg, uni)
    over = batch.valid & torch.isfinite(d) & (d > delta) & (adv != 0)
    ratio_agg = keep["ratio"] != keep["ddot_agg"]
    split = ratio_agg | (keep["ratio"] != keep["ddot_uniform"])
    return {
        "over_delta": int(over.sum()),
        "disagree": int((over & split).sum()),
        "disagree_ratio_agg": int((over & ratio_agg).sum()),
        "tails_differ": int((batch.valid & (torch.sign(agg) != torch.sign(uni))).sum()),
    }


class LabStats:
    """A run's lab statistics: as the ``policy_update(before=...)`` hook it sums ``update_counts``
    over one step's minibatches; ``row(samples, dist)`` gives the step's ``lab/...`` entries (the
    batch's ``behaviour_stats``, the counts summed over the processes of a multi-process run) and
    starts the next step from zero; ``lab/over_delta_first_mb`` is the first minibatch's
    over-delta count alone (with rollout.staleness > 0 that one is already off-policy, otherwise
    it is 0). ``summary(rows)`` is summary.json's ``lab_stats``.
    """

    def __init__(self, vocab_size: int | None, topk: int, delta: float = LAB_DELTA):
        self.vocab_size, self.topk, self.delta = vocab_size, topk, delta
        self._totals = dict.fromkeys(COUNTS, 0)
        self._first = 0

    def __call__(self, mb, idx, out, losses, u) -> None:
        counts = update_counts(out.batch, out.advantages, self.delta)
        if mb == 0:
            self._first += counts["over_delta"]
        for key, value in counts.items():
            self._totals[key] += value

    def row(self, samples, dist=None) -> dict[str, float]:
        values = [*self._totals.values(), self._first]
        if dist is not None:
            values = dist.sum(values)
        self._totals, self._first = dict.fromkeys(COUNTS, 0), 0
        counts = {f"lab/{k}": float(v) for k, v in zip((*COUNTS, "over_delta_first_mb"), values)}
        return {**behaviour_stats(samples, self.vocab_size), **counts}

    def summary(self, rows: list[dict]) -> dict:
        return lab_summary(rows, self.vocab_size, self.topk, self.delta)


def lab_summary(rows: list[dict], vocab_size: int, topk: int, delta: float = LAB_DELTA) -> dict:
    """summary.json's ``lab_stats``: the per-step ``lab/...`` values over the run's steps
    (mean, and min/max or first/last where a worst case or a trend matters)."""

    def series(key):
        return [r[key] for r in rows if r.get(key) is not None]

    def mean(key):
        v = series(key)
        return sum(v) / len(v) if v else None

    out = {"vocab_size": vocab_size, "topk": topk, "delta": delta, "steps": len(rows)}
    for p in QUANTILES:
        out[f"resid_p{round(p * 100):02d}_mean"] = mean(f"lab/resid_p{round(p * 100):02d}")
    frac = series("lab/resid_ge_0.01_frac")
    out["resid_ge_0.01_frac"] = {
        "mean": mean("lab/resid_ge_0.01_frac"),
        "min": min(frac, default=None),
        "first": frac[0] if frac else None,
        "last": frac[-1] if frac else None,
    }
    out["outside_topk_frac_mean"] = mean("lab/outside_topk_frac")
    for key in (*COUNTS, "over_delta_first_mb"):
        v = series(f"lab/{key}")
        out[f"{key}_per_step"] = {"mean": mean(f"lab/{key}"), "min": min(v, default=None), "max": max(v, default=None)}
    return out
