"""The pieces of one RL step, as plain functions: collect a rollout batch, score it, form
group advantages, and run one policy update with any registered method.

The train loop (``pipeline/train.py``) calls these top to bottom; nothing here knows which
method runs: method-specific behaviour comes from the method registry in ``masktrl.methods``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from masktrl.methods import TokenBatch, aggregate
from masktrl.methods.diagnostics import token_diagnostics
from masktrl.models.logprobs import token_logprobs, token_entropy
from masktrl.pipeline.tasks import encode_prompt
from masktrl.rollout.base import Sample, SamplingSettings


def stream_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed for one named random stream (e.g. ("rollout", step, attempt)).

    Every random choice of a run is drawn from such a stream, so a resumed run draws
    exactly what an uninterrupted one would, without saving generator states.
    """
    return random.Random(repr((seed, *parts))).getrandbits(63)


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


def policy_token_batch(model, samples: list[Sample], temperature: float, chunk: int) -> PolicyOutputs:
    """Run the policy on prompt+response and gather log pi at the sampled and top-K ids.

    Never materialises the [B, T, V] logits: ``token_logprobs`` works on response positions
    only, ``chunk`` tokens at a time.
    """
    seqs = [s.prompt_ids + s.gen.response_ids for s in samples]
    width = max(len(x) for x in seqs)
    input_ids = torch.zeros(len(seqs), width, dtype=torch.long)  # [B, L] right-padded
    attention = torch.zeros(len(seqs), width, dtype=torch.long)
    rows, cols = [], []
    for b, (s, seq) in enumerate(zip(samples, seqs)):
        input_ids[b, : len(seq)] = torch.tensor(seq)
        attention[b, : len(seq)] = 1
        p = len(s.prompt_ids)
        rows += [b] * len(s.gen.response_ids)
        cols += range(p - 1, p - 1 + len(s.gen.response_ids))  # position t-1 predicts token t
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention).last_hidden_state  # [B, L, H]
    h = hidden[torch.tensor(rows), torch.tensor(cols)]  # [N, H]

    sampled = torch.tensor([t for s in samples for t in s.gen.response_ids])  # [N]
    topk_ids = torch.tensor([row for s in samples for row in s.gen.topk_ids], dtype=torch.long)  # [N, K]
    behavior_topk = torch.tensor([row for s in samples for row in s.gen.topk_logp], dtype=h.dtype)  # [N, K]
    behavior_logp = torch.tensor([x for s in samples for x in s.gen.logp], dtype=h.dtype)  # [N]
    seq_ids = torch.tensor([i for i, s in enumerate(samples) for _ in s.gen.response_ids])  # [N]
    advantages = torch.tensor([s.advantage for s in samples for _ in s.gen.response_ids], dtype=h.dtype)

    weight = model.get_output_embeddings().weight  # [V, H]
    ids = torch.cat([sampled[:, None], topk_ids], dim=1)  # [N, 1+K]
    lp = token_logprobs(h, weight, ids, temperature=temperature, chunk_size=chunk)  # [N, 1+K]
    with torch.no_grad():
        entropy = token_entropy(h.detach(), weight, temperature=temperature, chunk_size=chunk)  # [N]
    batch = TokenBatch(
        logp=lp[:, 0],
        behavior_logp=behavior_logp,
        sampled_ids=sampled,
        topk_ids=topk_ids,
        topk_behavior_logp=behavior_topk,
        topk_logp=lp[:, 1:],
        seq_ids=seq_ids,
        vocab_size=weight.shape[0],
    )
    return PolicyOutputs(batch, advantages, entropy)


def policy_update(model, optimizer, scheduler, samples: list[Sample], method, params, cfg, seed: int, step: int) -> dict:
    """N minibatch updates on one rollout batch; returns the step's averaged diagnostics."""
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(stream_seed(seed, "order", step)))
    parts = [p for p in order.chunk(cfg.train.minibatches) if len(p)]
    agg_mode = method.aggregation(params)
    rows = []
    model.train()
    for mb, idx in enumerate(parts):
        mb_samples = [samples[i] for i in idx.tolist()]
        out = policy_token_batch(model, mb_samples, cfg.rollout.temperature, cfg.train.logprob_chunk)
        u = None
        if method.needs_u(params):
            gen = torch.Generator().manual_seed(stream_seed(seed, "sis", step, mb))
            u = torch.rand(out.batch.logp.shape[0], generator=gen, dtype=torch.float64).to(out.batch.logp.dtype)
        losses = method.token_losses(out.batch, out.advantages, params, u=u)
        loss = aggregate(losses.loss, out.batch, agg_mode, **_norm_len(agg_mode, cfg))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        scheduler.step()
        diag = token_diagnostics(out.batch, losses, out.advantages, params)
        diag.update(loss=loss.item(), grad_norm=grad_norm.item(), entropy=out.entropy.mean().item())
        rows.append(diag)
    model.eval()
    return _mean_rows(rows)


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
