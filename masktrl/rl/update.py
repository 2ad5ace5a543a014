"""One policy update on a rollout batch: N minibatch updates with any registered method.

``policy_update`` cuts the batch into ``minibatches`` (a seeded order), runs the policy forward
(``rl/policy.py``), asks the method for per-token losses, aggregates them, and steps
AdamW; under several processes each trains on its share of every minibatch with the same
result (see ``micro_batches`` and the loss scaling below). Nothing here knows which method
runs: the token losses, the aggregation and its denominator, and whether SIS uniforms are drawn
are the method's (``masktrl.methods``).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from masktrl.config import Config, TrainConfig
from masktrl.errors import MasktrlError
from masktrl.methods import BoundMethod
from masktrl.methods.corrections import correction_diagnostics, kept_batch
from masktrl.methods.diagnostics import token_diagnostics
from masktrl.methods.regularizers import mean_over_valid
from masktrl.models import packing
from masktrl.rl.distributed import Dist
from masktrl.rl.policy import (
    _distinct_prompts,
    base_model,
    behaviour_logp,
    can_share_prompts,
    policy_token_batch,
    shared_forward_calls,
)
from masktrl.rl.reference import Reference
from masktrl.rl.schedule import adamw_kernels, make_scheduler
from masktrl.rollout.base import Sample
from masktrl.seeding import stream_seed


@dataclass(frozen=True)
class UpdateSettings:
    """Everything an update reads besides the batch: the run's method bound to its params and
    correction, the ``train`` keys, the rollout's temperature (pi is computed at the temperature
    mu sampled at) and horizon, and the run's seed (minibatch order, SIS uniforms)."""

    minibatches: int
    grad_accum: int
    grad_clip: float
    logprob_chunk: int
    temperature: float
    horizon: int  # rollout.max_new_tokens: the longest possible response
    gradient_checkpointing: bool = False  # train.gradient_checkpointing: report which forward ran (shared_prompt_frac)
    mask_truncated: bool = False  # rollout.mask_truncated: responses cut at the length limit get no gradient
    packing: bool = False  # train.packing: the padding-free forward
    micro_batch_tokens: int | None = (
        None  # train.micro_batch_tokens: micro-batches by a token budget (None: grad_accum of them)
    )
    minibatch_groups: bool | int = False  # train.minibatch_groups: whole groups (true) or parts of g samples
    method: BoundMethod = field(kw_only=True)  # the method, its params and its correction (docs/METHODS.md §14)
    seed: int = field(default=0, kw_only=True)  # the run's seed

    @classmethod
    def from_config(cls, cfg: Config) -> UpdateSettings:
        t = cfg.train
        return cls(
            t.minibatches,
            t.grad_accum,
            t.grad_clip,
            t.logprob_chunk,
            cfg.rollout.temperature,
            cfg.rollout.max_new_tokens,
            t.gradient_checkpointing,
            cfg.rollout.mask_truncated,
            t.packing is True,  # a built Config holds true or false (auto is resolved then)
            t.micro_batch_tokens,
            t.minibatch_groups,
            method=cfg.method.bind(),
            seed=cfg.seed,
        )


class Learner(NamedTuple):
    """What an update changes: the policy (its training forward, wrapped for DDP / DeepSpeed when
    launched), its optimizer and its learning-rate schedule."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any


class Hooks(NamedTuple):
    """The analyses' view into an update (``policy_update``): ``before(mb, idx, out, losses, u)``
    sees each micro-batch's policy outputs and token losses before its backward; ``after(mb, idx)``
    runs after each optimizer step."""

    before: Callable | None = None
    after: Callable | None = None
    old: Callable | None = None  # old(idx, logp): each micro-batch's pi_old (the correction's forward)


@dataclass(frozen=True)
class StepBatch:
    """What every minibatch update of one step shares: the batch, the step, the processes, the
    hooks and the reference policy (None without a reference KL in the loss)."""

    samples: list[Sample]
    step: int
    dist: Dist
    hooks: Hooks = Hooks()
    reference: Reference | None = None


def make_optimizer(model, train_cfg: TrainConfig):
    """AdamW (its kernels: ``train.adamw``) and its learning-rate schedule (``rl/schedule.py``: warm-up, then constant,
    linear or cosine over ``train.steps x train.minibatches`` updates; stepped once per update)."""
    t = train_cfg
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    optimizer = torch.optim.AdamW(
        params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.999), **adamw_kernels(params, t.adamw)
    )
    return optimizer, make_scheduler(optimizer, t, total_updates=t.steps * t.minibatches)


def policy_update(
    learner: Learner,
    samples: list[Sample],
    settings: UpdateSettings,
    step: int,
    dist: Dist | None = None,
    *,
    hooks: Hooks = Hooks(),
    reference: Reference | None = None,
) -> dict:
    """N minibatch updates on one rollout batch; returns the step's averaged diagnostics.

    Several processes (``dist``) all hold the whole batch and cut it into the same minibatches;
    each trains on every world-th sequence of a minibatch, in ``train.grad_accum`` micro-batches.
    A micro-batch's loss is its aggregate times its share of the minibatch's denominator (valid
    tokens for token-mean, sequences for the seq modes) times the world size, which DDP's
    gradient average divides out again: the update is the one-process update on the whole
    minibatch, for any number of processes and micro-batches. SIS draws its uniforms for the
    whole minibatch, so they do not depend on the split either.

    An update whose loss or gradient norm is not finite is not applied (no optimizer step; the
    gradients are dropped) and counted in ``skipped_updates``: one bad batch cannot turn every
    weight into NaN. Under DeepSpeed the engine has applied it inside ``backward`` already; it is
    only counted.

    The analyses replay a stored step through this same function (with their own
    ``settings.minibatches``) and look in through ``hooks`` (``Hooks``: ``idx`` are indices into
    ``samples``).

    The method's regularisers (docs/METHODS.md §13) join each micro-batch's per-token loss before
    its aggregation: the reference KL in the loss needs ``reference`` (``rl/reference.py``), called
    once per micro-batch without gradient (each sample is in one minibatch, so once per sample and
    step); the entropy bonus makes the policy forward keep the entropy's gradient. With both
    coefficients 0 nothing of this runs.

    With ``method.correction.mode: decoupled`` (docs/METHODS.md §14.3) pi_old is computed first,
    without gradient, in the very micro-batches the updates then use (``old_logprobs``), and
    its time is reported as ``old_forward_s``.
    """
    batch = StepBatch(samples, step, dist or Dist(), hooks, reference)
    parts = (_minibatches if settings.minibatch_groups is False else group_minibatches)(samples, settings, step)
    rows, trained, skipped = [], 0, 0
    learner.model.train()
    t0 = time.perf_counter()
    needs_old = settings.method.correction.needs_old
    olds = old_logprobs(learner.model, samples, parts, settings, batch.dist) if needs_old else [None] * len(parts)
    old_forward_s = time.perf_counter() - t0
    if needs_old and hooks.old is not None:
        _report_old(hooks.old, samples, parts, olds, settings, batch.dist)
    for mb, idx in enumerate(parts):
        diag, n, applied = minibatch_update(learner, settings, batch, mb, idx, old=olds[mb])
        trained, skipped = trained + n, skipped + (not applied)
        if hooks.after is not None:
            hooks.after(mb, idx.tolist())
        rows.append(diag)
    learner.model.eval()
    return _step_stats(rows, skipped, old_forward_s if needs_old else None, batch.dist, trained)


def _report_old(hook, samples: list[Sample], parts: list[torch.Tensor], olds: list, settings, dist: Dist) -> None:
    """``hook(sample indices, log pi_old [T])`` for each micro-batch of ``old_logprobs``."""
    for idx, mb_old in zip(parts, olds):
        mb_samples = [samples[i] for i in idx.tolist()]
        for micro, (logp, _) in zip(_micro_batches(mb_samples, dist, settings), mb_old):
            hook([idx[i].item() for i in micro], logp)


def _minibatches(samples: list[Sample], settings: UpdateSettings, step: int) -> list[torch.Tensor]:
    """The step's ``settings.minibatches`` minibatches of sample indices, in the step's own random order."""
    order = torch.randperm(
        len(samples), generator=torch.Generator().manual_seed(stream_seed(settings.seed, "order", step))
    )
    parts = [p for p in order.chunk(settings.minibatches) if len(p)]
    return parts


def group_minibatches(samples: list[Sample], settings: UpdateSettings, step: int) -> list[torch.Tensor]:
    """``train.minibatch_groups``: the step's minibatches of sample indices, each of whole prompt
    groups. The groups (samples with the same ``group`` and prompt ids, in order of first
    appearance) are put in the step's own random order and cut into ``settings.minibatches``
    parts whose numbers of groups differ by at most one (``tensor_split``); a minibatch lists its
    samples in batch order. With fewer groups than minibatches there are fewer updates, one a group.

    With an integer g each group is first cut into parts of g samples (consecutive in batch order,
    the last part shorter where g does not divide the group), and the parts take the groups'
    place: shuffled by the same stream, cut into minibatches of as equal a number of parts as can
    be. A g at least as large as every group gives the whole groups, bit for bit."""
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault((s.group, tuple(s.prompt_ids)), []).append(i)
    members = list(groups.values())
    size = settings.minibatch_groups
    if size is not True:  # parts of g = size samples of each group
        members = [m[k : k + size] for m in members for k in range(0, len(m), size)]
    order = torch.randperm(
        len(members), generator=torch.Generator().manual_seed(stream_seed(settings.seed, "group-order", step))
    )
    parts = [sorted(i for g in part.tolist() for i in members[g]) for part in order.tensor_split(settings.minibatches)]
    return [torch.tensor(p) for p in parts if p]


def _step_stats(rows: list[dict], skipped: int, old_forward_s: float | None, dist: Dist, trained: int) -> dict:
    """The step's diagnostics: the minibatches' averaged, the skipped updates, pi_old's time
    (decoupled corrections), the sequences each process trained on (several processes)."""
    stats = _mean_rows(rows)
    stats["skipped_updates"] = skipped
    if old_forward_s is not None:
        stats["old_forward_s"] = old_forward_s
    if dist.world > 1:  # shows the sharding: sequences each process trained on, in rank order
        stats["sequences_per_process"] = dist.gather_objects(trained)
    return stats


def old_logprobs(model, samples: list[Sample], parts: list[torch.Tensor], settings: UpdateSettings, dist: Dist) -> list:
    """The decoupled mode's extra forward (docs/METHODS.md §14.3): for each minibatch, for each of
    this process's micro-batches, (log pi_old [N], log pi_old at the behaviour's top-K ids [N, K])
    of the policy before any update of the step, without gradient. It runs the training forward
    itself on the same micro-batches, so with one minibatch pi_old is the policy bit for bit."""
    olds = []
    with torch.no_grad():
        for idx in parts:
            mb_samples = [samples[i] for i in idx.tolist()]
            mb_old = []
            for micro in _micro_batches(mb_samples, dist, settings):  # the very micro-batches the update uses
                micro_samples = [mb_samples[i] for i in micro]
                out = policy_token_batch(
                    model,
                    micro_samples,
                    settings.temperature,
                    settings.logprob_chunk,
                    share=_agreed_share(micro_samples, dist),
                    drop_truncated=settings.mask_truncated,
                )
                mb_old.append((out.batch.logp.detach(), out.batch.topk_logp.detach()))
            olds.append(mb_old)
    return olds


class _Micro(NamedTuple):
    """One micro-batch's results: its diagnostics row and its share of the minibatch's loss."""

    row: dict
    loss: float
    denominator: float  # its aggregate's denominator (the kept tokens' with correction.denominator=kept)


def minibatch_update(
    learner: Learner, settings: UpdateSettings, batch: StepBatch, mb: int, idx: torch.Tensor, old: list | None = None
) -> tuple[dict, int, bool]:
    """One optimizer update on minibatch ``mb`` (``idx``: its indices into ``batch.samples``), this
    process's micro-batches of it accumulated; (its diagnostics, the sequences this process
    trained on, whether the update was applied). The method's token losses carry the run's
    off-policy correction (``settings.method.correction``; ``old``: pi_old per micro-batch in
    decoupled mode, from ``old_logprobs``)."""
    method, dist = settings.method, batch.dist
    mb_samples = [batch.samples[i] for i in idx.tolist()]
    u = _sis_uniforms(mb_samples, settings.seed, batch.step, mb) if method.needs_u else None
    total = method.denominator(valid_counts(mb_samples, settings.mask_truncated))  # of the whole minibatch
    if method.kl_in_loss and batch.reference is None:
        raise MasktrlError("method.kl_coef > 0 with method.kl_in=loss needs the reference policy's log-probabilities")
    learner.optimizer.zero_grad(set_to_none=True)
    micro_rows, loss_value, trained, kept_den = [], 0.0, 0, 0
    for j, micro in enumerate(_micro_batches(mb_samples, dist, settings)):
        u_micro = None if u is None else torch.cat([u[i] for i in micro])
        done = micro_update(
            learner.model,
            settings,
            batch,
            (mb, [mb_samples[i] for i in micro], [idx[i].item() for i in micro]),
            u_micro,
            None if old is None else old[j],
            total,
        )
        loss_value += done.loss
        kept_den += done.denominator
        trained += len(micro)
        micro_rows.append(done.row)
    if method.correction.drops_rejected:
        loss_value *= rescale_to_kept(learner.model, total, dist.sum([kept_den])[0], dist)
    grad_norm = dist.clip_grad_norm(learner.model, settings.grad_clip)
    loss_total = dist.sum([loss_value])[0]
    applied = math.isfinite(loss_total) and (
        math.isfinite(grad_norm) or dist.deepspeed
    )  # DeepSpeed: no norm; it stepped already
    if applied:
        learner.optimizer.step()
    else:  # not applied: the weights and the optimizer state stay as they were
        learner.optimizer.zero_grad(set_to_none=True)
    dist.whole()  # FSDP2: the updated shards gathered for the engine and the next forward
    with warnings.catch_warnings():  # torch warns when the first update of a run is the skipped one
        warnings.simplefilter("ignore", UserWarning)
        learner.scheduler.step()  # the schedule follows the updates planned, applied or not
    diag = combine_rows([r for rank_rows in dist.gather_objects(micro_rows) for r in rank_rows])
    diag.update(loss=loss_total, grad_norm=grad_norm)
    return diag, trained, applied


def rescale_to_kept(model, total: int, kept: float, dist: Dist) -> float:
    """``method.correction.denominator: kept`` (verl's ``modified_response_mask``): the micro-batches
    were scaled by their kept denominators over the minibatch's ``total`` of valid ones; the
    gradients are multiplied by total / kept, which turns that into kept / kept (nothing when no
    token is kept). Returns the factor."""
    if dist.deepspeed:
        raise MasktrlError(
            "method.correction.denominator=kept is not supported under DeepSpeed (it steps inside backward)"
        )
    if kept <= 0:
        return 1.0
    factor = max(total, 1) / kept
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(factor)
    return factor


def micro_update(
    model,
    settings: UpdateSettings,
    batch: StepBatch,
    where: tuple,
    u: torch.Tensor | None,
    old: tuple | None,
    total: int,
) -> _Micro:
    """The forward and backward of one micro-batch (``where``: the minibatch index, its samples,
    their indices into ``batch.samples``): the policy's log-probabilities, the method's corrected
    token losses, the regularisers, the aggregate scaled by the micro-batch's share of the
    minibatch's denominator ``total``; its diagnostics row and its share of the loss."""
    method, dist = settings.method, batch.dist
    mb, micro_samples, micro_idx = where
    # the packed forward's attention stays switched in through the backward (activation checkpointing replays the layers
    # there)
    with (
        dist.accumulate(model),
        packing.segments_attention(base_model(model)) if settings.packing else contextlib.nullcontext(),
    ):
        share_prompts = _agreed_share(micro_samples, dist)
        out = policy_token_batch(
            model,
            micro_samples,
            settings.temperature,
            settings.logprob_chunk,
            share=share_prompts,
            drop_truncated=settings.mask_truncated,
            packed=settings.packing,
            method=method,
        )
        u = None if u is None else u.to(out.batch.logp.device, out.batch.logp.dtype)  # drawn on the CPU
        losses, corr, seen = method.corrected_token_losses(out.batch, out.advantages, old=old, u=u)
        if batch.hooks.before is not None:
            batch.hooks.before(mb, micro_idx, out, losses, u)
        ref_lp = (
            batch.reference(micro_samples, share=share_prompts).to(out.batch.logp.device) if method.kl_in_loss else None
        )
        reg = method.regularize(losses.loss, out.batch, ref_logp=ref_lp, entropy=out.entropy)
        agg_batch = kept_batch(out.batch, corr) if method.correction.drops_rejected else out.batch
        loss = method.aggregate(reg.loss, agg_batch, horizon=settings.horizon)
        denominator = method.denominator(agg_batch)
        share = denominator / max(total, 1)  # 1.0 for one process, one micro-batch
        dist.backward(loss if share == 1.0 and dist.world == 1 else loss * (share * dist.world))
    row = {
        **token_diagnostics(seen, losses, out.advantages, method.params),
        **correction_diagnostics(corr, out.batch),
        "entropy": out.entropy.mean().item(),
        **regularizer_diagnostics(out.batch, reg, method.params),
    }
    if settings.gradient_checkpointing:
        row["shared_prompt_frac"] = float(out.shared_prompt)
    return _Micro(row, loss.item() * share, denominator)


def _agreed_share(samples: list[Sample], dist: Dist) -> bool | None:
    """Under ZeRO-3 and FSDP2 every process must run the same module calls (each call gathers its
    weights from all processes), so they agree on the policy forward: the shared-prompt one only
    if every process can use it with the same number of calls. Otherwise each decides (None)."""
    if not (dist.zero3 or dist.fsdp2):
        return None
    mine = (can_share_prompts(samples), shared_forward_calls(samples))
    views = dist.gather_objects(mine)
    return all(ok for ok, _ in views) and len({calls for _, calls in views}) == 1


_WARNED_BUDGETS: set[int] = set()


def _micro_batches(samples: list[Sample], dist: Dist, settings: UpdateSettings) -> list[list[int]]:
    """This process's micro-batches of a minibatch: ``train.grad_accum`` contiguous ones, or by
    the token budget ``train.micro_batch_tokens`` (``packing.token_budget_batches`` over its
    share, every world-th sequence from its rank; then split until every process has as many as
    the one with most, since each micro-batch runs the same collectives). A sequence over the
    budget is trained alone; the first time that happens in a process, one warning line."""
    budget = settings.micro_batch_tokens
    if budget is None:
        return micro_batches(len(samples), dist.rank, dist.world, settings.grad_accum)
    mine = list(range(dist.rank, len(samples), dist.world))
    part = [samples[i] for i in mine]
    res = packing.token_budget_batches(
        [len(s.prompt_ids) for s in part], [len(s.gen.response_ids) for s in part], budget, _distinct_prompts(part)[1]
    )
    if res.oversized and budget not in _WARNED_BUDGETS:
        _WARNED_BUDGETS.add(budget)
        longest = max(
            packing.sequence_tokens(len(part[i].prompt_ids), len(part[i].gen.response_ids)) for i in res.oversized
        )
        print(
            f"warning: train.micro_batch_tokens={budget}: {len(res.oversized)} sequence(s) are "
            f"longer (up to {longest} tokens); "
            "each is trained alone in a micro-batch of its own",
            file=sys.stderr,
            flush=True,
        )
    batches = [[mine[j] for j in b] for b in res.batches]
    if dist.world > 1:
        count = max(dist.gather_objects(len(batches)))
        if count > len(batches):
            if len(mine) < count:
                raise MasktrlError(
                    f"train.micro_batch_tokens={budget}: a process holds {len(mine)} sequences of a "
                    "minibatch but "
                    f"another needs {count} micro-batches; raise "
                    "train.micro_batch_tokens or lower train.minibatches"
                )
            batches = packing.balance(batches, count)
    return batches


def micro_batches(n: int, rank: int, world: int, grad_accum: int) -> list[list[int]]:
    """This process's part of a minibatch of ``n`` sequences (every world-th, from ``rank``), cut
    into ``grad_accum`` contiguous micro-batches. Every process must get the same number of
    non-empty micro-batches (each runs the same collectives), hence the check."""
    if n // world < grad_accum:
        raise MasktrlError(
            f"a minibatch of {n} sequences cannot be split over {world} process(es) x "
            f"train.grad_accum={grad_accum}: "
            "lower train.minibatches or train.grad_accum, or raise rollout.prompts_per_step"
        )
    mine = list(range(rank, n, world))
    bounds = [len(mine) * j // grad_accum for j in range(grad_accum + 1)]
    return [mine[a:b] for a, b in zip(bounds, bounds[1:])]


def valid_counts(samples: list[Sample], drop_truncated: bool = False) -> list[int]:
    """Valid tokens per sequence, from the recorded behaviour log-probabilities (a token is
    valid iff log mu > -inf; none of a truncated response's with ``drop_truncated``): what the
    minibatch's aggregation denominator is made of, known without a forward pass."""
    return [sum(lp > float("-inf") for lp in behaviour_logp(s, drop_truncated)) for s in samples]


def regularizer_diagnostics(batch, reg, params) -> dict:
    """The regularisers' metrics of a micro-batch (docs/METHODS.md §12): ``kl_ref``, the mean
    in-loss KL estimate over valid tokens, and ``entropy_bonus``, entropy_coef times the mean
    entropy (what the bonus takes off a token-mean loss); none when off."""
    row = {}
    if reg.kl is not None:
        row["kl_ref"] = mean_over_valid(reg.kl, batch)
    if reg.entropy is not None:
        row["entropy_bonus"] = params.entropy_coef * mean_over_valid(reg.entropy, batch)
    return row


def sis_uniforms(seed: int, step: int, mb: int, n: int) -> torch.Tensor:
    """[n] float64 uniforms SIS uses for the n tokens of minibatch ``mb`` of ``step``, in order."""
    gen = torch.Generator().manual_seed(stream_seed(seed, "sis", step, mb))
    return torch.rand(n, generator=gen, dtype=torch.float64)


def _sis_uniforms(samples: list[Sample], seed: int, step: int, mb: int) -> list[torch.Tensor]:
    """``sis_uniforms`` cut into one tensor per sample: the same draws whichever process or
    micro-batch trains a sample."""
    lengths = [len(s.gen.response_ids) for s in samples]
    return list(sis_uniforms(seed, step, mb, sum(lengths)).split(lengths))


def combine_rows(rows: list[dict]) -> dict:
    """Diagnostics of micro-batches (of all processes) as one minibatch row: counts summed,
    ``*_max`` maxed, everything else averaged with weights n_valid (exact for means over valid
    tokens, approximate for quantiles such as D_p95). One row is returned as it is."""
    if len(rows) == 1:
        return rows[0]
    weights = [r.get("n_valid", 1.0) for r in rows]
    out = {"n_valid": sum(weights)} if "n_valid" in rows[0] else {}
    for k in sorted({k for r in rows for k in r} - {"n_valid"}):
        pairs = [(r[k], w) for r, w in zip(rows, weights) if r.get(k) is not None and r[k] == r[k]]  # skip None/NaN
        if k.endswith("_max"):
            out[k] = max((v for v, _ in pairs), default=float("nan"))
        elif pairs:
            wsum = sum(w for _, w in pairs)
            out[k] = sum(v * w for v, w in pairs) / wsum if wsum else sum(v for v, _ in pairs) / len(pairs)
        else:
            out[k] = float("nan")
    return out


def _mean_rows(rows: list[dict]) -> dict:
    keys = {k for r in rows for k in r}
    out = {}
    for k in sorted(keys):
        vals = [r[k] for r in rows if r.get(k) is not None]
        if vals:
            out[k] = max(vals) if k.endswith("_max") else sum(vals) / len(vals)
    return out
