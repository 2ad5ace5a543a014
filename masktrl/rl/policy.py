"""The policy's training forward: log pi at each response token's sampled and behaviour top-K
ids, as a ``TokenBatch`` the methods consume.

``policy_token_batch`` never materialises the [B, T, V] logits (``models.logprobs`` works on
response positions only, a chunk of tokens at a time), and runs each distinct prompt of a
GRPO group once (``shared_prompt_hidden``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from masktrl.errors import MasktrlError
from masktrl.methods import BoundMethod, TokenBatch
from masktrl.models import checkpointing
from masktrl.models.architectures import shared_prompt_cache_ok
from masktrl.models.kvcache import cache_kwarg, new_cache
from masktrl.models.logprobs import renormalise_over_kept, token_logprobs_and_entropy, token_square_mass
from masktrl.models.lowprec import quantized_head
from masktrl.models.moe import NO_ROUTING, moe_routers, replayed_routing, routing_targets
from masktrl.models.packing import Packed, pack_shared, pack_whole, packed_hidden
from masktrl.rollout.base import Sample, kept_sizes, list_tensor, policy_tokens


@dataclass
class PolicyOutputs:
    batch: TokenBatch
    advantages: torch.Tensor  # [N]
    entropy: torch.Tensor  # [N] (with its gradient only when asked: entropy_grad)
    shared_prompt: bool = False  # whether the shared-prompt forward ran


class ForwardInputs(NamedTuple):
    """The policy forward's layout. Without ``prompt_ids``: ``input_ids`` [B, L] is
    prompt+response, right-padded. With them: ``input_ids`` [B, R] holds the responses only (see
    ``shared_prompt_hidden``). ``rows``, ``cols`` [N]: the response positions. With ``packed``
    (the padding-free layout, models/packing.py) the others are None."""

    input_ids: torch.Tensor | None
    attention: torch.Tensor | None
    rows: torch.Tensor | None
    cols: torch.Tensor | None
    prompt_ids: torch.Tensor | None = None
    prompt_attention: torch.Tensor | None = None
    group: torch.Tensor | None = None
    packed: Packed | None = None
    routing: torch.Tensor | None = (
        None  # [L, B*L, k] routing replay: the experts every MoE layer uses (whole layout only)
    )


class PolicyForward(torch.nn.Module):
    """The policy's training forward as one module call, so DDP and DeepSpeed can wrap it: hidden
    states at the response positions, then log pi at the [sampled, top-K] ids and the entropy.

    ``lm`` is the causal LM; parameters (and their order) are exactly ``lm``'s.
    """

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm
        self.vocab_size = lm.get_output_embeddings().weight.shape[0]  # read before ZeRO-3 partitions it

    def forward(
        self,
        inputs: ForwardInputs,
        ids,
        temperature: float,
        chunk: int,
        entropy_grad: bool = False,
        square_mass: bool = False,
    ):
        """``inputs``: the layout (``ForwardInputs``); ``ids`` [N, 1+K] the sampled and top-K ids.
        ``entropy_grad``: the entropy keeps its gradient (an entropy bonus, docs/METHODS.md §13.3).
        ``square_mass``: also [N] sum_V pi^2 (no grad; pdm tail=exact, §4.7), else None."""
        h = self.hidden(inputs)  # [N, H]
        h, weight = quantized_head(
            self.lm, h, self.lm.get_output_embeddings().weight
        )  # [N, H], [V, H] (fp8-full training: FP8)
        # [N, 1+K] log pi at the sampled and top-K ids, and [N] entropy, in one pass over V
        lp, entropy = token_logprobs_and_entropy(
            h, weight, ids, temperature=temperature, chunk_size=chunk, entropy_grad=entropy_grad
        )
        sq = (
            token_square_mass(h.detach(), weight.detach(), temperature=temperature, chunk_size=chunk)
            if square_mass
            else None
        )
        return lp, entropy, sq

    def hidden(self, inputs: ForwardInputs):
        """[N, H] final hidden states at the response positions (the rows the lm_head reads)."""
        if inputs.packed is not None:
            return packed_hidden(self.lm.base_model, inputs.packed)
        if inputs.routing is not None:  # routing replay: the engine's experts (models/moe.py)
            with replayed_routing(self.lm, inputs.routing):
                hidden = self.lm.base_model(
                    input_ids=inputs.input_ids, attention_mask=inputs.attention
                ).last_hidden_state
            return hidden[inputs.rows, inputs.cols]
        if inputs.prompt_ids is None:
            hidden = self.lm.base_model(
                input_ids=inputs.input_ids, attention_mask=inputs.attention
            ).last_hidden_state  # [B, L, H]
        else:
            hidden = shared_prompt_hidden(
                self.lm.base_model,
                inputs.prompt_ids,
                inputs.prompt_attention,
                inputs.input_ids,
                inputs.attention,
                inputs.group,
            )
        return hidden[inputs.rows, inputs.cols]


def policy_token_batch(
    model,
    samples: list[Sample],
    temperature: float,
    chunk: int,
    *,
    share: bool | None = None,
    drop_truncated: bool = False,
    packed: bool = False,
    method: BoundMethod | None = None,
) -> PolicyOutputs:
    """Run the policy on prompt+response and gather log pi at the sampled and top-K ids.

    ``method``: the bound method the outputs feed, which says what else the forward keeps: the
    entropy's gradient (``needs_entropy_grad``: an entropy bonus) and ``TokenBatch.pi_sq_sum`` =
    sum_V pi^2 per token, from the whole training distribution (``needs_full_pi``: one more
    chunked pass over the vocabulary, no grad; pdm ``tail=exact``). None: neither.

    ``model``: a causal LM, or a ``PolicyForward`` (possibly wrapped by DDP/DeepSpeed). Never
    materialises the [B, T, V] logits: ``token_logprobs`` works on response positions only,
    ``chunk`` tokens at a time.

    ``share``: run each distinct prompt once (``shared_prompt_hidden``); None decides from the
    samples (``can_share_prompts``). Under ZeRO-3 every process must make the same choice (the
    caller agrees on it). With activation checkpointing on, the shared path needs transformers'
    support for a read-only cache in checkpointed layers (``models/checkpointing.py``); without
    it every response runs with its prompt.

    ``drop_truncated`` (``rollout.mask_truncated``): the tokens of a response cut at the length
    limit get behaviour log-probability -inf, so every method treats them as invalid: no loss,
    no gradient, left out of every aggregation denominator (docs/METHODS.md §13.5).
    ``packed``: the padding-free forward (``train.packing``; models/packing.py), in the same two
    layouts (shared prompt or whole sequences). Under activation checkpointing the caller keeps
    ``packing.segments_attention`` around the forward and its backward (``policy_update`` does).
    """
    policy, inner, inputs, share = _policy_inputs(model, samples, share, packed)
    vocab_size = inner.vocab_size
    device = next(policy.parameters()).device

    sampled = list_tensor([t for s in samples for t in s.gen.response_ids], torch.long, device)  # [N]
    topk_ids = list_tensor([row for s in samples for row in s.gen.topk_ids], torch.long, device)  # [N, K]
    ids = torch.cat([sampled[:, None], topk_ids], dim=1)  # [N, 1+K]
    lp, entropy, sq = policy(inputs, ids, temperature, chunk, **_forward_wants(method))  # [N, 1+K], [N], [N] or None
    lp = renormalise_over_kept(
        lp, kept_sizes(samples, device)
    )  # truncated sampling: pi over the kept set (else lp itself)
    dt = lp.dtype  # float32 at least (float64 for a float64 model)
    behavior_topk, behavior_logp, seq_ids, advantages = _sample_tensors(samples, drop_truncated, dt, device)
    batch = TokenBatch(
        logp=lp[:, 0],
        behavior_logp=behavior_logp,
        sampled_ids=sampled,
        topk_ids=topk_ids,
        topk_behavior_logp=behavior_topk,
        topk_logp=lp[:, 1:],
        seq_ids=seq_ids,
        vocab_size=vocab_size,
        pi_sq_sum=None if sq is None else sq.to(dt).clamp(0.0, 1.0),
    )
    return PolicyOutputs(batch, advantages, entropy, shared_prompt=share)


def _forward_wants(method: BoundMethod | None) -> dict:
    """What else the policy forward keeps for ``method``: the entropy's gradient, sum_V pi^2."""
    wants = {}
    if method is not None and method.needs_entropy_grad:
        wants["entropy_grad"] = True
    if method is not None and method.needs_full_pi:
        wants["square_mass"] = True
    return wants


def _sample_tensors(samples: list[Sample], drop_truncated: bool, dt: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """The samples' recorded log mu at the top-K ids [N, K] and at the sampled ids [N], each
    token's sequence index [N] and advantage [N]."""
    topk = list_tensor([row for s in samples for row in s.gen.topk_logp], dt, device)  # [N, K]
    sampled = list_tensor([x for s in samples for x in behaviour_logp(s, drop_truncated)], dt, device)  # [N]
    seq_ids = list_tensor([i for i, s in enumerate(samples) for _ in s.gen.response_ids], torch.long, device)  # [N]
    advantages = list_tensor([s.advantage for s in samples for _ in s.gen.response_ids], dt, device)
    return topk, sampled, seq_ids, advantages


def behaviour_logp(sample: Sample, drop_truncated: bool = False) -> list[float]:
    """The recorded log mu of each response token; all -inf (invalid) for a response cut at the
    length limit when ``drop_truncated`` (``rollout.mask_truncated``). Environment tokens of a
    multi-turn response (``policy_tokens``) are -inf whatever was recorded: invalid, so no rule
    trains on them or counts them (docs/ROLLOUTS.md, "Multi-turn rollouts")."""
    if drop_truncated and not sample.gen.finished:
        return [float("-inf")] * len(sample.gen.logp)
    if sample.gen.source is not None:
        return [x if own else float("-inf") for x, own in zip(sample.gen.logp, policy_tokens(sample.gen))]
    return sample.gen.logp


@torch.no_grad()
def response_hidden(model, samples: list[Sample]) -> torch.Tensor:
    """[N, H] the final hidden state that predicts each response token (the tokens of
    ``samples`` in order, as in ``policy_token_batch``), without gradient. With
    ``full_logprobs`` it gives the whole next-token distribution, for analyses that need more
    than the listed ids (exact divergences, docs/METHODS.md §4.5)."""
    policy, inner, inputs, _ = _policy_inputs(model, samples)
    return inner.hidden(inputs)


def lm_head_weight(model) -> torch.Tensor:
    """[V, H] the output embedding the policy's log-probabilities are computed with (no bias:
    ``PolicyForward`` uses none)."""
    inner = getattr(model, "module", model)
    lm = inner.lm if isinstance(inner, PolicyForward) else inner
    return lm.get_output_embeddings().weight


@torch.no_grad()
def full_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, temperature: float, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """[n, V] log softmax(hidden weight^T / T) over the whole vocabulary, computed in ``dtype``:
    ``hidden`` [n, H] from ``response_hidden``, ``weight`` from ``lm_head_weight``. Pass a chunk
    of tokens: the result holds [n, V]."""
    return torch.log_softmax((hidden.to(dtype) @ weight.to(dtype).t()) / temperature, dim=-1)


def base_model(model) -> torch.nn.Module:
    """The transformer without its lm_head, under any wrapping (``PolicyForward``, DDP, DeepSpeed)."""
    inner = getattr(model, "module", model)
    lm = inner.lm if isinstance(inner, PolicyForward) else inner
    return lm.base_model


def _policy_inputs(model, samples: list[Sample], share: bool | None = None, packed: bool = False):
    """(the PolicyForward to call, its unwrapped module, its inputs on the model's device, whether
    they are the shared-prompt forward's). ``share``, ``packed``: see ``policy_token_batch``."""
    policy = model if isinstance(getattr(model, "module", model), PolicyForward) else PolicyForward(model)
    inner = getattr(policy, "module", policy)
    device = next(policy.parameters()).device
    if replays_routing(inner.lm):  # the engine's experts, on whole right-padded sequences
        inputs = _whole_sequence_inputs(samples)
        inputs["routing"] = replay_targets(inner.lm, samples, inputs["input_ids"].shape[1])
        return policy, inner, ForwardInputs(**{k: v.to(device) for k, v in inputs.items()}), False
    prompts, group = _distinct_prompts(samples)
    if share is None:
        share = can_share_prompts(samples)
    # the padded shared-prompt forward continues a KV cache; the packed one attends within one row
    if share and not packed and checkpointing.is_enabled(inner.lm):
        share = checkpointing.shared_prompt_supported(inner.lm.base_model)
    if share and not packed and not shared_prompt_cache_ok(inner.lm.base_model)[0]:  # e.g. sliding-window caches
        share = False
    if packed:
        responses = [s.gen.response_ids for s in samples]
        layout = (
            pack_shared(prompts, group, responses) if share else pack_whole([s.prompt_ids for s in samples], responses)
        )
        return policy, inner, ForwardInputs(None, None, None, None, packed=layout.to(device)), share
    if share:
        inputs = _shared_prompt_inputs(samples, prompts, group)
    else:
        inputs = _whole_sequence_inputs(samples)
    return policy, inner, ForwardInputs(**{k: v.to(device) for k, v in inputs.items()}), share


REPLAY_ATTR = "masktrl_routing_replay"


def enable_routing_replay(model: torch.nn.Module, engine=None) -> None:
    """``model.routing_replay: rollout``: ``engine`` records every sample's routing from now on
    (``Generation.routing``; MasktrlError for an engine that cannot), and the training forward of
    ``model`` (every ``policy_token_batch``: the update, the separate mismatch forward, decoupled
    pi_old) sends each token to the experts the engine recorded for it, on whole prompt+response
    rows (no shared-prompt or packed layout)."""
    if engine is not None:
        if not hasattr(engine, "record_routing"):
            raise MasktrlError(
                f"model.routing_replay=rollout: rollout.engine={getattr(engine, 'name', '?')}: {NO_ROUTING}"
            )
        engine.record_routing = True
    setattr(model, REPLAY_ATTR, True)


def replays_routing(model: torch.nn.Module) -> bool:
    """Whether ``enable_routing_replay`` was called on ``model``."""
    return bool(getattr(model, REPLAY_ATTR, False))


def replay_targets(lm: torch.nn.Module, samples: list[Sample], width: int) -> torch.Tensor:
    """[L, B*width, k] the recorded experts of ``samples``' right-padded rows (``routing_targets``);
    MasktrlError for a sample without recorded routing."""
    routers = moe_routers(lm)
    k = routers[0][2] if routers else 0
    missing = sum(s.gen.routing is None for s in samples)
    if missing or not routers:
        raise MasktrlError(
            f"model.routing_replay=rollout: {missing} of {len(samples)} samples have no recorded routing"
            if routers
            else "model.routing_replay=rollout: the model has no MoE layers"
        )
    return routing_targets([s.gen.routing for s in samples], width, len(routers), k)


def _distinct_prompts(samples: list[Sample]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts (first-seen order) and, per sample, the index of its prompt."""
    index: dict[tuple[int, ...], int] = {}
    group = [index.setdefault(tuple(s.prompt_ids), len(index)) for s in samples]
    return [list(p) for p in index], group


def can_share_prompts(samples: list[Sample]) -> bool:
    """Whether the shared-prompt forward applies: some prompt repeats among ``samples``."""
    return len(_distinct_prompts(samples)[0]) < len(samples)


def shared_forward_calls(samples: list[Sample]) -> int:
    """How many base-model calls the shared-prompt forward makes for ``samples`` (1 when every
    response is a single token: no response pass); ZeRO-3 processes must agree on it."""
    return 1 if max(len(s.gen.response_ids) for s in samples) <= 1 else 2


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
    cache = new_cache(base.config)
    key = cache_kwarg(base)
    lengths = prompt_attention.sum(1)  # [U]
    positions = torch.arange(prompt_ids.shape[1], device=prompt_ids.device).expand_as(prompt_ids)
    with checkpointing.prompt_pass(base):  # the prompt pass writes the cache: never checkpointed
        out = base(
            input_ids=prompt_ids,
            attention_mask=prompt_attention,
            position_ids=positions,
            use_cache=True,
            **{key: cache},
        )
    last = out.last_hidden_state[torch.arange(len(lengths), device=lengths.device), lengths - 1]  # [U, H]
    # index_select, not last[group]: its backward adds a prompt's repeats in the same order every run
    # (packing.packed_hidden)
    first = last.index_select(0, group.to(last.device))[:, None]  # [B, 1, H]
    if response_ids.shape[1] == 0:  # every response is a single token
        return first
    cache.reorder_cache(group)  # [U, ...] -> [B, ...], differentiable
    steps = torch.arange(response_ids.shape[1], device=response_ids.device)
    checkpointed = checkpointing.is_enabled(base)
    if checkpointed:  # the response pass only reads the prompt's cache, so its layers may be replayed
        checkpointing.read_only(cache)
    with checkpointing.response_pass(base):
        rest = base(
            input_ids=response_ids,
            attention_mask=torch.cat(
                [prompt_attention[group], response_attention], dim=1
            ),  # [B, W+R], pad holes masked
            position_ids=lengths[group][:, None] + steps,  # [B, R]
            use_cache=not checkpointed,
            **{key: cache},
        ).last_hidden_state  # [B, R, H]
    return torch.cat([first, rest], dim=1)
