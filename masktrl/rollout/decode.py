"""The transformers engine's own decode loop, in which finished rows leave the batch
(``rollout.drop_finished``).

``generate`` runs a batch until its longest response ends: a row that emitted EOS keeps
running, on padding, through every later step. With ragged response lengths that is most of
the work (docs/NOTEBOOK_BENCHMARKS.md §6). This loop runs the same prefill as the engine (one per
distinct prompt, its KV cache repeated to the ``n`` samples), then one forward per step with
the KV cache, and after each step removes the rows that emitted EOS or reached
``max_new_tokens`` from the batch: from the token history, the attention mask, the positions
and every layer of the cache (``Cache.batch_select_indices``, an index on the batch dimension
of each layer's keys and values). The cache's full-attention layers are kept in buffers with
spare positions (``GrowingLayer``), so a step writes its keys and values in place instead of
copying the whole cache as transformers' ``DynamicLayer`` does. Where the lean step runs and a
prompt has ``n > 1`` samples, the prompt's keys and values are not repeated but held once
(``SharedPrefix``, masktrl/models/prefix_attention.py), and rows leave it instead.

It records what the ``generate`` path records, computed the same way: the scores are the
float32 last-position logits passed through the logits processors ``generate`` itself builds
for these settings (``_get_logits_processor`` on the model's ``generation_config`` updated with
the engine's keywords: temperature, top-p, and whatever the model's config adds, such as
``suppress_tokens``); the token is ``argmax`` (greedy) or one ``torch.multinomial`` draw from
``softmax(scores)``; log mu is ``log_softmax(scores)`` at the token and its top-K. The random
numbers of a draw are drawn for the whole batch, the ended rows' discarded
(``rollout/draw.py: draw_tokens``), so for one seed every response gets the tokens ``generate``
gives it, and the records agree up to the rounding of a smaller batch's GEMMs (~1e-6 in log mu
with float32 GEMMs on a CPU; a draw that lands within that rounding of the boundary between two
tokens could pick the other one, which no test has seen). The forward is the lean step
(``masktrl/models/leanstep.py``) where the model allows it, as in the fixed-batch loop.

Logits processors that see only the current rows' scores and token history (temperature,
top-p/k/min-p, suppressed or banned tokens, length rules, n-gram bans) need nothing. Two of
transformers' keep one entry per row of the batch they first saw, and the loop selects the
rows that stay there too: the repetition penalty's per-row prompt padding
(``prompt_ignore_length``) and the encoder repetition penalty's prompts. Any other processor
(one that ``generate`` builds from a model's ``generation_config`` that is not in
``ROW_FREE``, such as a watermark or classifier-free guidance) is refused with one line before
anything is generated, unless it defines ``batch_select_indices(indices)``, which the loop then
calls with the rows that stay, as it does for the cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from masktrl.errors import MasktrlError
from masktrl.models.kvcache import cache_kwarg, new_cache
from masktrl.models.leanstep import lean_step
from masktrl.models.prefix_attention import shared_prefix
from masktrl.rollout.topp import sort_free

ROW_FREE = frozenset(
    {  # transformers' processors whose output depends only on the rows they are given
        "TemperatureLogitsWarper",
        "TopPLogitsWarper",
        "SortFreeTopP",  # rollout/topp.py: TopPLogitsWarper's scores
        "TopKLogitsWarper",
        "MinPLogitsWarper",
        "TypicalLogitsWarper",
        "EpsilonLogitsWarper",
        "EtaLogitsWarper",
        "TopHLogitsWarper",
        "InfNanRemoveLogitsProcessor",
        "SuppressTokensLogitsProcessor",
        "SuppressTokensAtBeginLogitsProcessor",
        "NoBadWordsLogitsProcessor",
        "SequenceBiasLogitsProcessor",
        "NoRepeatNGramLogitsProcessor",
        "MinLengthLogitsProcessor",
        "MinNewTokensLengthLogitsProcessor",
        "ForcedBOSTokenLogitsProcessor",
        "ForcedEOSTokenLogitsProcessor",
        "ExponentialDecayLengthPenalty",
    }
)
ROW_STATE = {
    "RepetitionPenaltyLogitsProcessor": "prompt_ignore_length",  # processor -> its per-row tensor
    "EncoderRepetitionPenaltyLogitsProcessor": "encoder_input_ids",
}


def prefill_cache(model: torch.nn.Module, input_ids: torch.Tensor, attention: torch.Tensor, n: int):
    """The KV cache of all but the last token of each left-padded prompt [P, W], computed once
    per prompt by the base model and repeated ``n`` times per row (row order of
    ``num_return_sequences=n``)."""
    cache = new_cache(model.config)
    base = model.base_model
    positions = (attention.cumsum(1) - 1).clamp_min(0)  # what generate uses for left padding
    lean = lean_step(model, cache)  # the same operations without transformers' module machinery
    if lean is not None:
        lean(input_ids[:, :-1], positions[:, :-1], attention[:, :-1], head=False)
    else:
        base(
            input_ids=input_ids[:, :-1],
            attention_mask=attention[:, :-1],
            position_ids=positions[:, :-1],
            use_cache=True,
            **{cache_kwarg(base): cache},
        )
    cache.batch_repeat_interleave(n)
    return cache


class GrowingLayer(DynamicLayer):
    """Keys and values of one attention layer in buffers with spare positions along the sequence:
    a decode step writes its position in place, where transformers' ``DynamicLayer`` copies the
    whole layer cache (``torch.cat``) at every step; the capacity doubles when full. ``keys``
    and ``values`` are views of the filled part, which is what attention reads."""

    is_croppable = False

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None, spare: int):
        super().__init__()
        self.spare = spare
        if keys is not None and keys.numel():
            self._adopt(keys, values)

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.device, self.dtype = keys.device, keys.dtype
        self.length = keys.shape[-2]
        shape = (*keys.shape[:-2], self.length + self.spare, keys.shape[-1])
        self._k, self._v = keys.new_empty(shape), values.new_empty(shape)
        self._k[..., : self.length, :] = keys
        self._v[..., : self.length, :] = values
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys, self.values = self._k[..., : self.length, :], self._v[..., : self.length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self._adopt(key_states, value_states)
            return self.keys, self.values
        end = self.length + key_states.shape[-2]
        if end > self._k.shape[-2]:  # full: double the capacity
            grown = (*self._k.shape[:-2], max(end, 2 * self._k.shape[-2]), self._k.shape[-1])
            for name in ("_k", "_v"):
                buf = getattr(self, name).new_empty(grown)
                buf[..., : self.length, :] = getattr(self, name)[..., : self.length, :]
                setattr(self, name, buf)
        self._k[..., self.length : end, :] = key_states
        self._v[..., self.length : end, :] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = self._k[indices], self._v[indices]
            self._views()


def growing_cache(cache, spare: int):
    """``cache`` with each of its plain ``DynamicLayer`` layers (full attention) replaced by a
    ``GrowingLayer`` holding the same keys and values and ``spare`` free positions; other layer
    kinds (sliding windows, recurrent states) stay as they are. MasktrlError if one of them cannot
    drop rows."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = GrowingLayer(
                layer.keys if layer.is_initialized else None, layer.values if layer.is_initialized else None, spare
            )
        elif not hasattr(layer, "batch_select_indices"):
            raise MasktrlError(
                f"rollout.drop_finished cannot remove rows from the model's {type(layer).__name__} "
                "cache "
                "layers; set rollout.drop_finished=false"
            )
    return cache


def logits_processors(model: torch.nn.Module, generate_kwargs: dict, input_ids: torch.Tensor, attention: torch.Tensor):
    """The generation config and the logits processors ``model.generate(input_ids, **generate_kwargs)``
    would use for left-padded rows ``input_ids`` with mask ``attention`` (transformers' own
    construction, so the model's ``generation_config`` counts too), a top-p warper among them
    computed by ``SortFreeTopP`` (the same scores, bit for bit)."""
    config, _ = model._prepare_generation_config(None, **generate_kwargs)
    model._prepare_special_tokens(config, True, device=input_ids.device)
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=input_ids.shape[1],
        encoder_input_ids=input_ids,
        device=input_ids.device,
        model_kwargs={"attention_mask": attention},
    )
    return config, sort_free(processors)  # the same scores; top-p without its index sort (rollout/topp.py)


def _attribute_selector(processor, attr: str):
    def select(keep: torch.Tensor) -> None:
        value = getattr(processor, attr)
        setattr(processor, attr, value[keep.to(value.device)])

    return select


def row_selectors(processors) -> list:
    """For each processor with per-row state, a function of the indices of the rows that stay
    (``ROW_STATE``, or the processor's own ``batch_select_indices``); MasktrlError for one whose
    rows the loop cannot follow."""
    selectors = []
    for p in processors:
        name = type(p).__name__
        attr = ROW_STATE.get(name)
        if hasattr(p, "batch_select_indices"):
            selectors.append(p.batch_select_indices)
        elif attr is not None:
            if isinstance(getattr(p, attr), torch.Tensor):
                selectors.append(_attribute_selector(p, attr))
        elif name not in ROW_FREE:
            raise MasktrlError(
                f"rollout.drop_finished cannot follow the rows of the logits processor {name} (from "
                "the "
                "model's generation_config); set rollout.drop_finished=false to "
                "sample with generate"
            )
    return selectors


class Steps:
    """Per-step records of the rows still running, assembled into per-row tensors at the end."""

    def __init__(self):
        self.rows, self.tokens, self.logp, self.top_ids, self.top_lp = [], [], [], [], []

    def add(self, rows, tokens, lp, k: int) -> None:
        top_lp, top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
        self.rows.append(rows)
        self.tokens.append(tokens)
        self.logp.append(lp.gather(1, tokens[:, None]).squeeze(1))
        self.top_ids.append(top_ids)
        self.top_lp.append(top_lp)

    def tensors(self, n_rows: int, pad: int):
        """[R, T] ids (``pad`` after a row's end), [R, T] log mu, [R, T, K] top-K ids and log mu."""
        T, k = len(self.rows), self.top_ids[0].shape[1]
        device = self.tokens[0].device
        ids = torch.full((n_rows, T), pad, dtype=torch.long, device=device)
        logp = torch.zeros(n_rows, T, device=device)
        top_ids = torch.zeros(n_rows, T, k, dtype=torch.long, device=device)
        top_lp = torch.zeros(n_rows, T, k, device=device)
        for t, rows in enumerate(self.rows):
            ids[rows, t] = self.tokens[t]
            logp[rows, t] = self.logp[t]
            top_ids[rows, t] = self.top_ids[t]
            top_lp[rows, t] = self.top_lp[t]
        return ids, logp, top_ids, top_lp


@torch.no_grad()
def decode_dropping_finished(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    n: int,
    k: int,
    generate_kwargs: dict,
    draw: str = "multinomial",
):
    """``n`` responses per left-padded prompt of ``input_ids`` [P, W] (``attention`` its mask),
    finished rows leaving the batch after every step. ``generate_kwargs`` are the keywords the
    engine gives ``generate`` (sampling settings, ``max_new_tokens``, ``pad_token_id``,
    ``eos_token_id``). Returns the tensors of ``Steps.tensors``, rows in the order of
    ``num_return_sequences=n``: a row ends at its first EOS or at ``max_new_tokens``. ``draw``:
    how a sampled token is drawn (rollout/draw.py)."""
    from masktrl.rollout.draw import draw_buffers, draw_tokens

    width = input_ids.shape[1]
    max_new, pad, eos = (
        generate_kwargs["max_new_tokens"],
        generate_kwargs["pad_token_id"],
        generate_kwargs["eos_token_id"],
    )
    history = input_ids.repeat_interleave(n, dim=0)  # [R, W]: the tokens the logits processors see
    mask = attention.repeat_interleave(n, dim=0)
    n_rows = history.shape[0]
    positions = (mask.cumsum(1) - 1).clamp_min(0)[:, -1:]  # [R, 1] of the last prompt token
    # a prompt's keys and values held once for its n samples (models/prefix_attention.py), where the lean step runs
    shared = None
    if n > 1 and width > 1 and lean_step(model, None) is not None:
        shared = shared_prefix(model, prefill_cache(model, input_ids, attention, 1), attention, n, min(max_new, 64))
    if shared is not None:
        cache = None
        lean = lean_step(model, None, attend=shared.attend)
        select_rows = shared.select
    else:
        cache = prefill_cache(model, input_ids, attention, n) if width > 1 else new_cache(model.config)
        cache = growing_cache(cache, spare=min(max_new, 64))
        lean = lean_step(model, cache)  # None: through model(...)
        select_rows = cache.batch_select_indices
    config, processors = logits_processors(model, generate_kwargs, history, mask)
    buffers = None
    selectors = row_selectors(processors)
    use_mask = not bool((attention == 1).all())  # generate drops an all-ones mask too
    rows = torch.arange(n_rows, device=input_ids.device)  # original index of each running row
    token = history[:, -1:]
    steps = Steps()
    for t in range(max_new):
        if lean is not None:
            logits = lean(token, positions, mask if use_mask else None)
        else:
            logits = model(
                input_ids=token,
                attention_mask=mask if use_mask else None,
                position_ids=positions,
                use_cache=True,
                **{cache_kwarg(model): cache},
            ).logits
        scores = processors(history, logits[:, -1].float())
        lp = torch.log_softmax(scores, dim=-1)
        if buffers is None:  # sized by the first step's scores, reused by every later one
            buffers = draw_buffers(draw, lp.shape[0], lp.shape[1], lp.device)
        # drawn for the whole batch, the live rows' used: a row's token does not depend on which rows have ended
        nxt = draw_tokens(scores, lp, config.do_sample, draw, buffers, live=rows, batch=n_rows)
        steps.add(rows, nxt, lp, k)
        done = nxt == eos if t + 1 < max_new else torch.ones_like(nxt, dtype=torch.bool)
        if bool(done.all()):
            break
        token = nxt[:, None]
        history = torch.cat([history, token], dim=1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        positions = positions + 1
        if bool(done.any()):
            keep = (~done).nonzero().squeeze(1)
            rows, token, history, mask, positions = rows[keep], token[keep], history[keep], mask[keep], positions[keep]
            select_rows(keep)
            for select in selectors:
                select(keep)
    return steps.tensors(n_rows, pad)
