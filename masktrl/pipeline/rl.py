"""The pieces of one RL step, as plain functions: collect a rollout batch, score it, form
group advantages, and run one policy update with any registered method.

The train loop (``pipeline/train.py``) calls these top to bottom; nothing here knows which
method runs: method-specific behaviour comes from the method registry in ``masktrl.methods``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from masktrl.errors import MasktrlError
from masktrl.methods import TokenBatch, aggregate, aggregate_denominator
from masktrl.methods.diagnostics import token_diagnostics
from masktrl.models.logprobs import token_logprobs_and_entropy
from masktrl.pipeline.distributed import Dist
from masktrl.pipeline.tasks import encode_prompt
from masktrl.rollout.base import Sample, SamplingSettings
from masktrl.seeding import stream_seed


def sampling_settings(cfg) -> SamplingSettings:
    r = cfg.rollout
    return SamplingSettings(r.n, r.max_new_tokens, r.temperature, r.top_p, r.logprobs_k)


def generate_groups(engine, tokenizer, task, examples, settings, seed, chat_template=False) -> list[list[Sample]]:
    """``settings.n`` scored samples per example, one list per example (a GRPO group)."""
    prompt_ids = [encode_prompt(tokenizer, ex.prompt, chat_template) for ex in examples]
    gens = engine.generate(prompt_ids, settings, seed)
    groups = [
        [
            Sample(ex.id, ex.prompt, ex.answer, ids, g, gen, text=tokenizer.decode(gen.response_ids, skip_special_tokens=True))
            for gen in outs
        ]
        for g, (ex, ids, outs) in enumerate(zip(examples, prompt_ids, gens))
    ]
    flat = [s for group in groups for s in group]
    scores = task.score_many([examples[s.group] for s in flat], [s.text for s in flat])  # batched: math grading runs in a pool
    for s, score in zip(flat, scores):
        s.reward = score
        s.extra["score"] = score
    return groups


def set_group_advantages(group: list[Sample], eps: float = 1e-6) -> None:
    """GRPO: A_i = (R_i - mean(R)) / (std(R) + eps) within the group (unbiased std)."""
    rewards = torch.tensor([s.reward for s in group], dtype=torch.float64)
    std = rewards.std() if len(group) > 1 else torch.tensor(0.0, dtype=torch.float64)
    adv = (rewards - rewards.mean()) / (std + eps)
    for s, a in zip(group, adv.tolist()):
        s.advantage = a


@dataclass
class PolicyOutputs:
    batch: TokenBatch
    advantages: torch.Tensor  # [N]
    entropy: torch.Tensor  # [N] (no grad)


class PolicyForward(torch.nn.Module):
    """The policy's training forward as one module call, so DDP and DeepSpeed can wrap it: hidden
    states at the response positions, then log pi at the [sampled, top-K] ids and the entropy.

    ``lm`` is the causal LM; parameters (and their order) are exactly ``lm``'s.
    """

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm
        self.vocab_size = lm.get_output_embeddings().weight.shape[0]  # read before ZeRO-3 partitions it

    def forward(self, input_ids, attention, rows, cols, ids, temperature: float, chunk: int,
                prompt_ids=None, prompt_attention=None, group=None):
        """Without ``prompt_ids``: ``input_ids`` [B, L] is prompt+response, right-padded. With them:
        ``input_ids`` [B, R] holds the responses only (see ``shared_prompt_hidden``)."""
        if prompt_ids is None:
            hidden = self.lm.base_model(input_ids=input_ids, attention_mask=attention).last_hidden_state  # [B, L, H]
        else:
            hidden = shared_prompt_hidden(self.lm.base_model, prompt_ids, prompt_attention, input_ids, attention, group)
        h = hidden[rows, cols]  # [N, H]
        weight = self.lm.get_output_embeddings().weight  # [V, H]
        # [N, 1+K] log pi at the sampled and top-K ids, and [N] entropy (no grad), in one pass over V
        lp, entropy = token_logprobs_and_entropy(h, weight, ids, temperature=temperature, chunk_size=chunk)
        return lp, entropy


def policy_token_batch(model, samples: list[Sample], temperature: float, chunk: int) -> PolicyOutputs:
    """Run the policy on prompt+response and gather log pi at the sampled and top-K ids.

    ``model``: a causal LM, or a ``PolicyForward`` (possibly wrapped by DDP/DeepSpeed). Never
    materialises the [B, T, V] logits: ``token_logprobs`` works on response positions only,
    ``chunk`` tokens at a time.
    """
    policy = model if isinstance(getattr(model, "module", model), PolicyForward) else PolicyForward(model)
    inner = getattr(policy, "module", policy)
    vocab_size = inner.vocab_size
    device = next(policy.parameters()).device
    prompts, group = _distinct_prompts(samples)
    if len(prompts) < len(samples) and not _checkpointing(inner.lm):
        inputs = _shared_prompt_inputs(samples, prompts, group)
    else:
        inputs = _whole_sequence_inputs(samples)
    inputs = {k: v.to(device) for k, v in inputs.items()}

    sampled = torch.tensor([t for s in samples for t in s.gen.response_ids], device=device)  # [N]
    topk_ids = torch.tensor([row for s in samples for row in s.gen.topk_ids], dtype=torch.long, device=device)  # [N, K]
    ids = torch.cat([sampled[:, None], topk_ids], dim=1)  # [N, 1+K]
    lp, entropy = policy(inputs.pop("input_ids"), inputs.pop("attention"), inputs.pop("rows"), inputs.pop("cols"),
                         ids, temperature, chunk, **inputs)  # [N, 1+K], [N]
    dt = lp.dtype  # float32 at least (float64 for a float64 model)
    behavior_topk = torch.tensor([row for s in samples for row in s.gen.topk_logp], dtype=dt, device=device)  # [N, K]
    behavior_logp = torch.tensor([x for s in samples for x in s.gen.logp], dtype=dt, device=device)  # [N]
    seq_ids = torch.tensor([i for i, s in enumerate(samples) for _ in s.gen.response_ids], device=device)  # [N]
    advantages = torch.tensor([s.advantage for s in samples for _ in s.gen.response_ids], dtype=dt, device=device)
    batch = TokenBatch(
        logp=lp[:, 0],
        behavior_logp=behavior_logp,
        sampled_ids=sampled,
        topk_ids=topk_ids,
        topk_behavior_logp=behavior_topk,
        topk_logp=lp[:, 1:],
        seq_ids=seq_ids,
        vocab_size=vocab_size,
    )
    return PolicyOutputs(batch, advantages, entropy)


def _distinct_prompts(samples: list[Sample]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts (first-seen order) and, per sample, the index of its prompt."""
    index: dict[tuple[int, ...], int] = {}
    group = [index.setdefault(tuple(s.prompt_ids), len(index)) for s in samples]
    return [list(p) for p in index], group


def _checkpointing(lm) -> bool:
    """Whether transformers' activation checkpointing is on (it turns the KV cache off, which
    ``shared_prompt_hidden`` needs)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # the first is the newer name
        if hasattr(type(lm), name):
            return bool(getattr(lm, name))
    return False


def _padded(rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, width] (pad id 0, masked) and their attention mask."""
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    return ids, mask


def _whole_sequence_inputs(samples: list[Sample]) -> dict:
    """Each prompt+response as one right-padded row; position p-1+t predicts response token t."""
    seqs = [s.prompt_ids + s.gen.response_ids for s in samples]
    input_ids, attention = _padded(seqs, max(len(x) for x in seqs))  # [B, L]
    rows = [b for b, s in enumerate(samples) for _ in s.gen.response_ids]
    cols = [len(s.prompt_ids) - 1 + t for s in samples for t in range(len(s.gen.response_ids))]
    return {"input_ids": input_ids, "attention": attention, "rows": torch.tensor(rows), "cols": torch.tensor(cols)}


def _shared_prompt_inputs(samples: list[Sample], prompts: list[list[int]], group: list[int]) -> dict:
    """Each distinct prompt once [U, W] and each response without its last token [B, R]
    (both right-padded); column t of ``shared_prompt_hidden``'s output predicts response token t."""
    prompt_ids, prompt_attention = _padded(prompts, max(len(p) for p in prompts))
    heads = [s.gen.response_ids[:-1] for s in samples]
    input_ids, attention = _padded(heads, max(len(h) for h in heads))
    rows = [b for b, s in enumerate(samples) for _ in s.gen.response_ids]
    cols = [t for s in samples for t in range(len(s.gen.response_ids))]
    return {
        "input_ids": input_ids,
        "attention": attention,
        "rows": torch.tensor(rows),
        "cols": torch.tensor(cols),
        "prompt_ids": prompt_ids,
        "prompt_attention": prompt_attention,
        "group": torch.tensor(group),
    }


def shared_prompt_hidden(base, prompt_ids, prompt_attention, response_ids, response_attention, group):
    """[B, 1+R, H] final hidden states predicting response tokens 0..R, each distinct prompt run once.

    GRPO's samples share their group's prompt. The U distinct prompts [U, W] (right-padded) go
    through ``base`` once; their KV cache is gathered per sequence (``group`` [B] -> prompt) and
    the responses [B, R] (without their last token) continue from it at their true positions,
    attending to the prompt's real tokens only. Column 0 is the prompt's last hidden state, column
    t the one after response token t-1. Causal attention makes this equal to running every
    prompt+response whole; gradients reach the prompt's computation through the cache. It cuts
    the forward and backward work on prompts by the group size.
    """
    from masktrl.rollout.hf import cache_kwarg, new_cache

    cache = new_cache(base.config)
    key = cache_kwarg(base)
    lengths = prompt_attention.sum(1)  # [U]
    positions = torch.arange(prompt_ids.shape[1], device=prompt_ids.device).expand_as(prompt_ids)
    out = base(input_ids=prompt_ids, attention_mask=prompt_attention, position_ids=positions, use_cache=True, **{key: cache})
    last = out.last_hidden_state[torch.arange(len(lengths), device=lengths.device), lengths - 1]  # [U, H]
    first = last[group][:, None]  # [B, 1, H]
    if response_ids.shape[1] == 0:  # every response is a single token
        return first
    cache.reorder_cache(group)  # [U, ...] -> [B, ...], differentiable
    steps = torch.arange(response_ids.shape[1], device=response_ids.device)
    rest = base(
        input_ids=response_ids,
        attention_mask=torch.cat([prompt_attention[group], response_attention], dim=1),  # [B, W+R], pad holes masked
        position_ids=lengths[group][:, None] + steps,  # [B, R]
        use_cache=True,
        **{key: cache},
    ).last_hidden_state  # [B, R, H]
    return torch.cat([first, rest], dim=1)


def policy_update(model, optimizer, scheduler, samples: list[Sample], method, params, cfg, seed: int, step: int,
                  dist: Dist | None = None, *, minibatches: int | None = None, before=None, after=None) -> dict:
    """N minibatch updates on one rollout batch; returns the step's averaged diagnostics.

    Several processes (``dist``) all hold the whole batch and cut it into the same minibatches;
    each trains on every world-th sequence of a minibatch, in ``train.grad_accum`` micro-batches.
    A micro-batch's loss is its aggregate times its share of the minibatch's denominator (valid
    tokens for token-mean, sequences for the seq modes) times the world size, which DDP's
    gradient average divides out again: the update is the one-process update on the whole
    minibatch, for any number of processes and micro-batches. SIS draws its uniforms for the
    whole minibatch, so they do not depend on the split either.

    The analyses replay a stored step through this same function: ``minibatches`` overrides
    ``train.minibatches``; ``before(mb, idx, out, losses, u)`` sees each micro-batch's policy
    outputs and token losses (``idx``: indices into ``samples``) before its backward, and
    ``after(mb, idx)`` runs after each optimizer step.
    """
    dist = dist or Dist()
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(stream_seed(seed, "order", step)))
    parts = [p for p in order.chunk(minibatches or cfg.train.minibatches) if len(p)]
    agg_mode = method.aggregation(params)
    rows, trained = [], 0
    model.train()
    for mb, idx in enumerate(parts):
        mb_samples = [samples[i] for i in idx.tolist()]
        u = _sis_uniforms(mb_samples, seed, step, mb) if method.needs_u(params) else None
        total = _denominator(mb_samples, agg_mode)
        optimizer.zero_grad(set_to_none=True)
        micro_rows, loss_value = [], 0.0
        for micro in micro_batches(len(mb_samples), dist.rank, dist.world, cfg.train.grad_accum):
            with dist.accumulate(model):
                out = policy_token_batch(model, [mb_samples[i] for i in micro], cfg.rollout.temperature, cfg.train.logprob_chunk)
                u_micro = None if u is None else torch.cat([u[i] for i in micro]).to(out.batch.logp.dtype)
                losses = method.token_losses(out.batch, out.advantages, params, u=u_micro)
                if before is not None:
                    before(mb, [idx[i].item() for i in micro], out, losses, u_micro)
                loss = aggregate(losses.loss, out.batch, agg_mode, **_norm_len(agg_mode, cfg))
                share = aggregate_denominator(out.batch, agg_mode) / max(total, 1)  # 1.0 for one process, one micro-batch
                dist.backward(loss if share == 1.0 and dist.world == 1 else loss * (share * dist.world))
            loss_value += loss.item() * share
            trained += len(micro)
            micro_rows.append({**token_diagnostics(out.batch, losses, out.advantages, params), "entropy": out.entropy.mean().item()})
        grad_norm = dist.clip_grad_norm(model, cfg.train.grad_clip)
        optimizer.step()
        scheduler.step()
        if after is not None:
            after(mb, idx.tolist())
        diag = combine_rows([r for rank_rows in dist.gather_objects(micro_rows) for r in rank_rows])
        diag.update(loss=dist.sum([loss_value])[0], grad_norm=grad_norm)
        rows.append(diag)
    model.eval()
    stats = _mean_rows(rows)
    if dist.world > 1:  # shows the sharding: sequences each process trained on, in rank order
        stats["sequences_per_process"] = dist.gather_objects(trained)
    return stats


def micro_batches(n: int, rank: int, world: int, grad_accum: int) -> list[list[int]]:
    """This process's part of a minibatch of ``n`` sequences (every world-th, from ``rank``), cut
    into ``grad_accum`` contiguous micro-batches. Every process must get the same number of
    non-empty micro-batches (each runs the same collectives), hence the check."""
    if n // world < grad_accum:
        raise MasktrlError(
            f"a minibatch of {n} sequences cannot be split over {world} process(es) x train.grad_accum={grad_accum}: "
            "lower train.minibatches or train.grad_accum, or raise rollout.prompts_per_step"
        )
    mine = list(range(rank, n, world))
    bounds = [len(mine) * j // grad_accum for j in range(grad_accum + 1)]
    return [mine[a:b] for a, b in zip(bounds, bounds[1:])]


def _denominator(samples: list[Sample], mode: str) -> int:
    """``aggregate_denominator`` of the samples' whole token batch, from their recorded behaviour
    log-probabilities (a token is valid iff log mu > -inf), without a forward pass."""
    valid = [sum(lp > float("-inf") for lp in s.gen.logp) for s in samples]
    return sum(valid) if mode == "token-mean" else sum(v > 0 for v in valid)


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


def _norm_len(mode: str, cfg) -> dict:
    return {"norm_len": cfg.rollout.max_new_tokens} if mode == "seq-mean-token-sum-norm" else {}


def _mean_rows(rows: list[dict]) -> dict:
    keys = {k for r in rows for k in r}
    out = {}
    for k in sorted(keys):
        vals = [r[k] for r in rows if r.get(k) is not None]
        if vals:
            out[k] = max(vals) if k.endswith("_max") else sum(vals) / len(vals)
    return out
