"""Padding-free training forward: the sequences of a micro-batch packed into one row.

The padded forward lays a micro-batch out as [B, L_max] and spends every layer's work on the
padding: with ragged responses (a long tail of lengths) most of a padded micro-batch is padding.
Packing concatenates the sequences into one row [1, T] (T = the sum of their lengths) with
positions that restart at every segment, and runs attention segment by segment
(``segment_attention``, the ``cu_seqlens`` layout of varlen attention kernels: each segment
attends causally to itself only). The per-token layers (embeddings, projections, MLP, norms)
then run on exactly T tokens, and attention costs sum_i L_i^2 instead of B L_max^2. No FLOP
goes to padding, and none to the masked-out blocks a block-diagonal [T, T] mask would still
compute.

Two layouts, matching the two padded forwards of the policy:

* **whole sequences** (``pack_whole``): segment i is prompt_i + response_i without its last token;
  position p_i - 1 + t predicts response token t.
* **shared prompt** (``pack_shared``): each distinct prompt once, then every response (without
  its last token) at its true positions, in the same row: a prompt segment attends causally to
  itself, a response segment to its own prompt's keys and its own earlier tokens (lower-right
  causal). The per-token layers run once over prompts and responses together (one base-model
  call, no KV cache). Column 0 of a response is its prompt's last hidden state.

Causal attention makes both the same computation as the padded forwards; only the summation
order of a few reductions changes (``tests/test_packing.py`` checks log pi, losses and
gradients in float64 for every method).

``segment_attention`` is a transformers attention function (``AttentionInterface``): it is
switched in for the packed forward only (``segments_attention``), so generation and every other
forward keep the model's own attention implementation. Models whose attention layers do not
dispatch through that interface, or that have sliding-window or linear/recurrent layers (whose
state would flow across segments), cannot be packed: ``packing_unsupported`` says why.

``token_budget_batches`` forms micro-batches by a token budget instead of a fixed count.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from masktrl.config import layers_unpackable

ATTENTION_NAME = "masktrl_segments"


# --------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class Segments:
    """Where each segment's queries and keys lie in a packed row.

    ``queries[i]`` = (start, end) on the query axis; ``keys[i]``: the (start, end) ranges of the
    key axis segment i attends to, concatenated in order. Its queries are the last ones of those
    keys (lower-right causal): query j of a segment with q queries and k keys sees keys 0..k-q+j.
    """

    queries: tuple[tuple[int, int], ...]
    keys: tuple[tuple[tuple[int, int], ...], ...]

    def __post_init__(self):
        object.__setattr__(self, "_cache", {})

    def _plan(self):
        """Segments grouped by (queries, keys) shape: [(query positions, key positions, count, nq, nk)]
        as lists, and the permutation from group order back to the packed order."""
        if "plan" not in self._cache:
            by_shape: dict[tuple[int, int], list[int]] = {}
            for i, ((qs, qe), ranges) in enumerate(zip(self.queries, self.keys)):
                if qe > qs:
                    by_shape.setdefault((qe - qs, sum(b - a for a, b in ranges)), []).append(i)
            plan, order = [], []
            for (nq, nk), members in by_shape.items():
                q_pos = [p for i in members for p in range(*self.queries[i])]
                k_pos = [p for i in members for a, b in self.keys[i] for p in range(a, b)]
                plan.append((q_pos, k_pos, len(members), nq, nk))
                order += q_pos
            inverse = [0] * len(order)
            for j, p in enumerate(order):
                inverse[p] = j
            self._cache["plan"] = (plan, inverse)
        return self._cache["plan"]

    def groups(self, device):
        """(query positions, key positions, [(count, nq, nk)] per group) on ``device``, built
        once per device: the positions in group order (None where that is the packed order
        itself, so no gather is needed)."""
        key = ("groups", str(device))
        if key not in self._cache:
            plan, _ = self._plan()
            q = [p for g in plan for p in g[0]]
            k = [p for g in plan for p in g[1]]
            q_idx = None if q == list(range(len(q))) else torch.tensor(q, device=device)
            k_idx = None if k == list(range(len(k))) else torch.tensor(k, device=device)
            self._cache[key] = (q_idx, k_idx, [(g, nq, nk) for _, _, g, nq, nk in plan])
        return self._cache[key]

    def inverse(self, device):
        """[T] positions in group order of each packed query (``segment_attention``'s output
        order), or None where group order is the packed order."""
        key = ("inverse", str(device))
        if key not in self._cache:
            inv = self._plan()[1]
            self._cache[key] = None if inv == list(range(len(inv))) else torch.tensor(inv, device=device)
        return self._cache[key]

    @classmethod
    def self_attending(cls, lengths: list[int]) -> Segments:
        """Segments of ``lengths`` back to back, each attending causally to itself."""
        bounds = _bounds(lengths)
        return cls(tuple(bounds), tuple((b,) for b in bounds))


def _bounds(lengths: list[int], offset: int = 0) -> list[tuple[int, int]]:
    out, s = [], offset
    for n in lengths:
        out.append((s, s + n))
        s += n
    return out


def segment_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_segments: Segments | None = None,
    **kwargs,
):
    """Attention over packed segments (``packed_segments``). query [1, Hq, T, D], key/value
    [1, Hkv, S, D] (S = T, or the cached prompt keys plus T). Returns ([1, T, Hq, D], None) like
    transformers' attention functions.

    Segments of the same shape (queries, keys) are gathered into one batch and run through one
    ``scaled_dot_product_attention`` call (causal, lower-right aligned when a segment has more
    keys than queries); so a micro-batch of many short sequences costs a few calls, not one per
    sequence. Without ``packed_segments`` (any other forward while this implementation is
    switched in) it is plain causal sdpa over the whole row."""
    if attention_mask is not None:
        raise ValueError("segment_attention takes its layout from packed_segments, not an attention mask")
    gqa = query.shape[1] != key.shape[1]
    if packed_segments is None:
        out = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, scale=scaling, is_causal=query.shape[2] > 1, enable_gqa=gqa
        )
        return out.transpose(1, 2).contiguous(), None
    # one gather per tensor into group order (its backward is one scatter), then views per group
    q_idx, k_idx, shapes = packed_segments.groups(query.device)
    qa = query[0] if q_idx is None else query[0].index_select(1, q_idx)  # [Hq, Tq, D]
    ka = key[0] if k_idx is None else key[0].index_select(1, k_idx)  # [Hkv, Tk, D] (a shared prompt's keys repeat)
    va = value[0] if k_idx is None else value[0].index_select(1, k_idx)
    q_parts = qa.split([g * nq for g, nq, _ in shapes], dim=1)
    k_parts = ka.split([g * nk for g, _, nk in shapes], dim=1)
    v_parts = va.split([g * nk for g, _, nk in shapes], dim=1)
    parts = []
    for (g, nq, nk), qp, kp, vp in zip(shapes, q_parts, k_parts, v_parts):
        q = qp.unflatten(1, (g, nq)).transpose(0, 1)  # [g, Hq, nq, D]
        k = kp.unflatten(1, (g, nk)).transpose(0, 1)  # [g, Hkv, nk, D]
        v = vp.unflatten(1, (g, nk)).transpose(0, 1)
        if nk == nq:
            mask, causal = None, nq > 1
        else:  # lower-right causal: the queries are the last nq of the nk keys
            mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)  # [nq, nk]
            causal = False
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=causal, enable_gqa=gqa
        )  # [g, Hq, nq, D]
        parts.append(o.transpose(0, 1).flatten(1, 2))  # [Hq, g*nq, D]
    out = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [Hq, T, D] in group order
    inverse = packed_segments.inverse(query.device)
    if inverse is not None:
        out = out.index_select(1, inverse)  # back to the packed order
    return out.transpose(0, 1)[None].contiguous(), None


def _no_mask(*args, **kwargs):
    return None


def register() -> None:
    """Register ``segment_attention`` (and a mask function that builds nothing) with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, segment_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


@contextlib.contextmanager
def segments_attention(base: torch.nn.Module):
    """``segment_attention`` as ``base``'s attention implementation for the duration (the model's
    own one is restored afterwards, also on error); nested uses are no-ops.

    Under activation checkpointing the backward pass replays each layer's forward, which must
    dispatch to the same attention: the caller then keeps this context around forward *and*
    backward (``packed_hidden`` refuses to run otherwise)."""
    register()
    config = base.config
    saved = config._attn_implementation
    if saved == ATTENTION_NAME:
        yield
        return
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = saved


def segments_attention_active(base: torch.nn.Module) -> bool:
    return base.config._attn_implementation == ATTENTION_NAME


def packing_unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` (a causal LM or its base model) cannot run the packed forward, or None."""
    return unsupported_reason(type(model), model.config)


def unsupported_reason(model_class: type, config) -> str | None:
    """Why a model of ``model_class`` with ``config`` cannot run the packed forward, or None
    (checked from the class and config alone, before any weight is loaded).

    Packing replaces the attention function of every layer, so every attention layer must
    dispatch through transformers' attention interface (``_supports_attention_backend``), and
    every layer must attend fully and causally: a sliding window or a linear/recurrent layer
    would need the segment boundaries too."""
    name = model_class.__name__
    if not getattr(model_class, "_supports_attention_backend", False):
        return (
            f"{name}'s attention layers do not use transformers' attention interface, so they cannot "
            "mask packed segments"
        )
    return layers_unpackable(name, config)


def config_unsupported_reason(model_cfg) -> str | None:
    """``unsupported_reason`` for the policy ``model_cfg`` (a ``ModelConfig``) describes, read
    from its config without the weights: a tiny model's architecture, or a model folder's (or
    cached hub id's) config.json. None also when the class is not known to transformers' auto
    classes (then it is checked once loaded, ``packing_unsupported``)."""
    if model_cfg.path == "tiny":
        from masktrl.models.architectures import get_architecture, model_classes
        from masktrl.models.tiny import TinyModelConfig

        arch = get_architecture(model_cfg.architecture)
        config_class, model_class = model_classes(arch)
        config = config_class(
            hidden_size=model_cfg.hidden_size,
            num_hidden_layers=model_cfg.num_layers,
            num_attention_heads=model_cfg.num_heads,
            intermediate_size=model_cfg.intermediate_size,
            **arch.extra(TinyModelConfig.of(model_cfg)),
        )
    else:
        from transformers import AutoModelForCausalLM

        from masktrl.models.loading import load_model_config

        config = load_model_config(model_cfg.path)
        model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
        if model_class is None:
            return None
    return unsupported_reason(model_class, config)


# --------------------------------------------------------------------------- packed inputs


@dataclass
class Packed:
    """A packed micro-batch: the tensors of one base-model call, and where the hidden state
    predicting each response token lies in its output (``gather`` [N] indexes its tokens)."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    segments: Segments
    gather: torch.Tensor  # [N]

    @property
    def tokens(self) -> int:
        """Tokens the base model runs."""
        return self.input_ids.shape[1]

    def to(self, device) -> Packed:
        move = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return Packed(**move)


def _row(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long)[None]


def pack_whole(prompts: list[list[int]], responses: list[list[int]]) -> Packed:
    """Each prompt + response (without its last token) as one segment."""
    seqs = [p + r[:-1] for p, r in zip(prompts, responses)]
    lengths = [len(s) for s in seqs]
    bounds = _bounds(lengths)
    gather = [s + len(p) - 1 + t for (s, _), p, r in zip(bounds, prompts, responses) for t in range(len(r))]
    return Packed(
        input_ids=_row([t for s in seqs for t in s]),
        position_ids=_row([i for n in lengths for i in range(n)]),
        segments=Segments.self_attending(lengths),
        gather=torch.tensor(gather, dtype=torch.long),
    )


def pack_shared(prompts: list[list[int]], group: list[int], responses: list[list[int]]) -> Packed:
    """The distinct ``prompts`` once, then each response without its last token, in one row;
    ``group[b]`` is the index of response b's prompt. A response segment's keys are its prompt's
    segment and its own (its queries the last of them)."""
    p_len = [len(p) for p in prompts]
    p_bounds = _bounds(p_len)
    heads = [r[:-1] for r in responses]
    r_len = [len(h) for h in heads]
    r_bounds = _bounds(r_len, sum(p_len))
    queries = tuple(p_bounds) + tuple(r_bounds)
    keys = tuple((b,) for b in p_bounds) + tuple((p_bounds[g], b) for g, b in zip(group, r_bounds))
    gather = []
    for g, (s, _), r in zip(group, r_bounds, responses):
        gather.append(p_bounds[g][1] - 1)  # the prompt's last hidden state predicts response token 0
        gather += [s + t for t in range(len(r) - 1)]
    return Packed(
        input_ids=_row([t for p in prompts for t in p] + [t for h in heads for t in h]),
        position_ids=_row(
            [i for n in p_len for i in range(n)] + [p_len[g] + t for g, n in zip(group, r_len) for t in range(n)]
        ),
        segments=Segments(queries, keys),
        gather=torch.tensor(gather, dtype=torch.long),
    )


# --------------------------------------------------------------------------- packed forward


def packed_hidden(base: torch.nn.Module, packed: Packed) -> torch.Tensor:
    """[N, H] the final hidden states predicting each response token of ``packed``, from
    ``base`` (the transformer without its lm_head) run on the packed row."""
    from masktrl.models import checkpointing

    if checkpointing.is_enabled(base) and not segments_attention_active(base):
        raise RuntimeError(
            "under activation checkpointing, run the packed forward and its backward inside segments_attention(base)"
        )
    with segments_attention(base):  # its registered mask function builds no mask
        out = base(
            input_ids=packed.input_ids,
            attention_mask=None,
            position_ids=packed.position_ids,
            use_cache=False,
            packed_segments=packed.segments,
        ).last_hidden_state  # [1, T, H]
    # index_select, not out[0, gather]: the gather repeats a shared prompt's last position, and the
    # backward of advanced indexing (index_put_ with accumulate) adds the repeats in a different order
    # run to run with several CPU threads; index_select's (index_add_) adds them in index order
    return out[0].index_select(0, packed.gather)


# --------------------------------------------------------------------------- token-budget micro-batches


@dataclass(frozen=True)
class Budgeted:
    """Micro-batches (indices into the samples, ascending within each) and the indices of the
    sequences that exceed the budget on their own (each trained alone)."""

    batches: list[list[int]]
    oversized: list[int]


def sequence_tokens(prompt_len: int, response_len: int) -> int:
    """Tokens a packed forward runs for one sequence: prompt + response without its last token."""
    return prompt_len + max(response_len - 1, 0)


def token_budget_batches(
    prompt_lens: list[int], response_lens: list[int], budget: int, prompt_keys: list | None = None
) -> Budgeted:
    """Micro-batches of at most ``budget`` packed tokens each, covering every sequence once.

    Cost of a micro-batch: the tokens its packed forward runs. With ``prompt_keys`` (a hashable
    per sequence; equal keys = the same prompt, run once by the shared-prompt forward) a prompt is
    counted once per micro-batch; without, every sequence counts its own prompt. (With all
    prompts of a micro-batch distinct both counts agree, so the count is exact whichever forward
    runs.)

    Length-aware grouping: sequences are taken longest first and each goes into the first
    micro-batch that already holds its prompt and has room, else the first with room, else a
    new one (first-fit decreasing), so similar lengths share micro-batches and few are half
    empty. A sequence longer than the budget on its own is a micro-batch by itself (listed in
    ``oversized``). Deterministic: ties keep the samples' order.
    """
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"the token budget must be a positive int, got {budget!r}")
    n = len(prompt_lens)
    keys = prompt_keys if prompt_keys is not None else list(range(n))
    cost = [sequence_tokens(p, r) for p, r in zip(prompt_lens, response_lens)]
    tail = [max(r - 1, 0) for r in response_lens]
    order = sorted(range(n), key=lambda i: (-cost[i], i))
    bins: list[list[int]] = []
    used: list[int] = []
    held: list[set] = []
    oversized = []
    for i in order:
        if cost[i] > budget:
            oversized.append(i)
            bins.append([i])
            used.append(budget + 1)  # closed
            held.append(set())
            continue
        shared = [b for b in range(len(bins)) if keys[i] in held[b] and used[b] + tail[i] <= budget]
        if shared:
            b = shared[0]
            used[b] += tail[i]
        else:
            b = next((b for b in range(len(bins)) if used[b] + cost[i] <= budget), None)
            if b is None:
                bins.append([])
                used.append(0)
                held.append(set())
                b = len(bins) - 1
            used[b] += cost[i]
            held[b].add(keys[i])
        bins[b].append(i)
    return Budgeted([sorted(b) for b in bins], sorted(oversized))


def batch_tokens(
    prompt_lens: list[int], response_lens: list[int], batch: list[int], prompt_keys: list | None = None
) -> int:
    """The packed tokens of micro-batch ``batch`` as ``token_budget_batches`` counts them."""
    keys = prompt_keys if prompt_keys is not None else list(range(len(prompt_lens)))
    first = {}
    for i in batch:
        first.setdefault(keys[i], i)
    return sum(prompt_lens[i] for i in first.values()) + sum(max(response_lens[i] - 1, 0) for i in batch)


def balance(batches: list[list[int]], count: int) -> list[list[int]]:
    """``batches`` split (the largest first, in halves) until there are ``count`` of them: every
    process of a multi-process update must run the same number of micro-batches. Splitting keeps
    each under its budget. Raises ValueError when there are fewer sequences than ``count``."""
    out = [list(b) for b in batches]
    if sum(len(b) for b in out) < count:
        raise ValueError(f"{sum(len(b) for b in out)} sequences cannot fill {count} micro-batches")
    while len(out) < count:
        j = max(range(len(out)), key=lambda k: (len(out[k]), -k))
        b = out.pop(j)
        out[j:j] = [b[: len(b) // 2], b[len(b) // 2 :]]
    return out
