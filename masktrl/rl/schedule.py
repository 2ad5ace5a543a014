"""The learning-rate schedule (a linear warm-up, then constant, linear or cosine decay) and the
schedule of rollout batch ages (``rollout.staleness``, below), and how AdamW is run
(``adamw_foreach``, ``adamw_kernels``).

``lr_factor`` gives the multiplier of ``train.lr`` for optimizer update ``u`` (0-based; the
scheduler steps once per optimizer update, so a run makes ``train.steps x train.minibatches``
of them). ``constant``: ``min(1, (u + 1) / warmup)``, then 1 (the warm start uses it too).
After the warm-up, ``linear`` and ``cosine`` decay from 1 at update ``warmup`` towards
``min_ratio`` at update ``total`` (one past the last update, as in transformers'
``get_linear_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup`` with a floor).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

from masktrl.seeding import stream_seed


def lr_factor(schedule: str, warmup: int, total: int, min_ratio: float = 0.0) -> Callable[[int], float]:
    """The multiplier of the base learning rate at optimizer update ``u``.

    ``warmup``: warm-up updates (0: none). ``total``: updates in the run (decay schedules only)."""
    if schedule == "constant":
        return lambda u: min(1.0, (u + 1) / warmup) if warmup else 1.0
    if schedule not in ("linear", "cosine"):
        raise ValueError(f"unknown learning-rate schedule {schedule!r}")
    span = max(1, total - warmup)

    def factor(u: int) -> float:
        if u < warmup:
            return (u + 1) / warmup
        progress = min(1.0, (u - warmup) / span)
        decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_ratio + (1.0 - min_ratio) * decay

    return factor


def adamw_foreach(params: list) -> bool | None:
    """AdamW's ``foreach`` argument: True for plain CPU tensors, where torch's default is the
    per-parameter Python loop and the multi-tensor kernels give the same bits with one call per
    operation instead of one per parameter (tests/test_lr_schedule.py); None (torch's own
    choice, already multi-tensor on a GPU) for anything else, e.g. FSDP2's sharded parameters."""
    plain = all(p.device.type == "cpu" and type(p.data) is torch.Tensor for p in params)
    return True if params and plain else None


def adamw_kernels(params: list, kernel: str = "foreach") -> dict:
    """AdamW's kernel arguments for ``train.adamw``: ``foreach`` (``adamw_foreach``: bit-identical
    to torch's per-parameter loop) or ``fused`` (torch's fused kernel: one pass over each
    parameter instead of one per operation; the same update up to float32 rounding,
    tests/test_lr_schedule.py)."""
    if kernel == "fused":
        return {"fused": True}
    return {"foreach": adamw_foreach(params)}


def make_scheduler(optimizer, train_cfg, total_updates: int):
    """``LambdaLR`` over ``optimizer`` for ``train_cfg`` (warmup_steps, lr_schedule, min_lr_ratio),
    stepped once per optimizer update; ``total_updates``: the run's number of updates."""
    t = train_cfg
    warmup = t.warmup_steps * t.minibatches
    fn = lr_factor(t.lr_schedule, warmup, total_updates, t.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


# --------------------------------------------------------------------------- batch ages (rollout.staleness)
#
# Step t trains on a batch of age a_t: sampled during step sigma(t) = max(1, t - a_t), right after
# that step's own batch, by the policy after step sigma(t) - 1 (the starting policy for
# sigma = 1). rollout.staleness = s (an integer) is a_t = s for every step: step 1 samples the
# batches of steps 2..1+s, step S > 1 the batch of step S+s. A distribution draws a_t per step
# from the stream (seed, "staleness", t): a pure function of the seed and the step, so a resumed
# run continues the same sequence and the same seed gives the same run. The effective age
# t - sigma(t) = min(a_t, t - 1) is what the metrics record (rollout_age).


def staleness_spec(value) -> dict:
    """rollout.staleness as {dist, min, max, p}: an integer s is {dist: fixed, max: s}."""
    if not isinstance(value, dict):
        return {"dist": "fixed", "min": int(value), "max": int(value), "p": 0.5}
    return {
        "dist": value["dist"],
        "min": int(value.get("min", 0)),
        "max": int(value["max"]),
        "p": float(value.get("p", 0.5)),
    }


def staleness_cap(value) -> int:
    """The largest age a batch can have under rollout.staleness = ``value`` (0: every batch on-policy)."""
    return staleness_spec(value)["max"]


def drawn_age(value, seed: int, step: int) -> int:
    """a_t: the age drawn for step ``step``'s batch (before the cut at the steps that exist)."""
    spec = staleness_spec(value)
    lo, hi = spec["min"], spec["max"]
    if spec["dist"] == "fixed" or lo == hi:
        return hi
    rng = random.Random(stream_seed(seed, "staleness", step))
    if spec["dist"] == "uniform":
        return rng.randint(lo, hi)
    p, a = spec["p"], lo  # geometric: failures before the first success, from min, cut at max
    while a < hi and rng.random() >= p:
        a += 1
    return a


def sampled_at(value, seed: int, step: int) -> int:
    """sigma(t): the step during which step ``step``'s batch is sampled (by the policy after sigma - 1)."""
    return max(1, step - drawn_age(value, seed, step))


def batch_age(value, seed: int, step: int) -> int:
    """The effective age of step ``step``'s batch: how many updates its sampling policy is behind
    the one trained at that step (t - sigma(t))."""
    return step - sampled_at(value, seed, step)


def sample_now(value, seed: int, step: int, last: int) -> list[int]:
    """The later steps (up to ``last``) whose batches are sampled during step ``step``, in order."""
    cap = staleness_cap(value)
    return [t for t in range(step + 1, min(step + cap, last) + 1) if sampled_at(value, seed, t) == step]


def age_metrics(value, seed: int, step: int) -> dict:
    """The metrics row's ``rollout_age`` (the batch's effective age) when rollout.staleness is a
    distribution; nothing for the integer form (its rows stay as they were)."""
    return {"rollout_age": batch_age(value, seed, step)} if isinstance(value, dict) else {}


# --------------------------------------------------------------------------- partial rollouts (rollout.partial)
#
# A batch sampled ahead (during step sigma(t) < t) starts with the policy after sigma - 1; with
# probability rollout.partial the weight sync after step sigma's update lands while it is being
# generated, at decode position k (uniform in 1..max_new_tokens-1): the tokens from position k on
# are sampled by the policy after step sigma, on the prefix recomputed (rollout/partial.py). Both
# draws come from the stream (seed, "partial", t): a pure function of the seed and the step.


def partial_at(partial: float | None, seed: int, step: int, max_new_tokens: int) -> int | None:
    """The decode position at which the weight sync lands during the generation of step
    ``step``'s batch (tokens 0..k-1 by the older policy, k.. by the newer), or None: no sync
    lands (rollout.partial null, or not drawn). Only batches sampled ahead have a newer policy."""
    if partial is None or max_new_tokens < 2:
        return None
    rng = random.Random(stream_seed(seed, "partial", step))
    if rng.random() >= partial:
        return None
    return rng.randint(1, max_new_tokens - 1)


def token_age_metrics(versions: list[list[int] | None], step: int) -> dict:
    """The metrics row's token ages when the batch records per-token policy versions (rollout.partial):
    the age of a token trained at step ``step`` is step - 1 - its version; the mean, the largest,
    the fraction of responses with tokens of more than one version, and ``rollout_token_age/a``,
    the number of tokens of age a. Nothing when no version is recorded (rows stay as they were)."""
    rows = [v for v in versions if v is not None]
    if not rows:
        return {}
    ages = [step - 1 - x for v in rows for x in v]
    counts: dict[int, int] = {}
    for a in ages:
        counts[a] = counts.get(a, 0) + 1
    out = {
        "rollout_token_age_mean": sum(ages) / len(ages) if ages else float("nan"),
        "rollout_token_age_max": max(ages, default=0),
        "rollout_partial_frac": sum(len(set(v)) > 1 for v in rows) / len(rows),
    }
    out.update({f"rollout_token_age/{a}": counts[a] for a in sorted(counts)})
    return out
