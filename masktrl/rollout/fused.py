"""The transformers engine's fixed-batch decode loop (``rollout.decode: fused``) and the
inverse-CDF draw (``rollout.draw: inverse_cdf``).

At the small shapes (the lab: a 2-layer model, 64-512 rows, 5 new tokens) generation is
per-step overhead more than arithmetic: ``generate``'s bookkeeping, transformers' module
machinery around ~1 ms of GEMMs, a second pass over every step's scores for the records, and
above all ``torch.multinomial``, which on a CPU draws one exponential variate per vocabulary
entry and row (``q ~ Exp(1)``, token ``argmax(p / q)``): 22 ms of every step at 512 rows x
2,004 tokens (docs/BENCHMARKS.md §6).

``decode_fixed_batch`` runs what ``generate`` runs, step for step, on the same batch: the shared
prefill of the engine (rollout/decode.py), then one forward per step with the KV cache held in
buffers sized for the whole response (``GrowingLayer`` with ``max_new_tokens`` spare positions:
written in place, never copied); the scores through the logits processors ``generate`` builds;
one ``log_softmax`` and one ``topk`` per step, recorded as they are computed; finished rows fed
the pad token, as ``generate`` feeds them; the loop ends when every row has ended. With
``draw="multinomial"`` the token is ``torch.multinomial(softmax(scores), 1)`` on the whole batch,
as ``generate`` draws it, so for one seed the tokens and every record are bit-identical to the
``generate`` path (tests/test_rollout_fused.py).

``draw="inverse_cdf"`` draws each row's token with one uniform variate: the first token whose
cumulative probability (``exp`` of the recorded log mu, summed in float64 by blocks of 64
tokens, then within the block found) exceeds ``u`` times the row's total. That is the
recorded distribution up to float64 rounding (a token of probability below ~1e-16 of its row's
total is drawn at a rate off by that much), as
``torch.multinomial`` is that of its float32 probabilities: equal in distribution, but for one
seed the samples differ from ``multinomial``'s (another random stream). It replaces the
per-entry exponential draws and the ``softmax``.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from masktrl.models.kvcache import cache_kwarg, new_cache
from masktrl.models.leanstep import lean_step
from masktrl.rollout.decode import growing_cache, logits_processors, prefill_cache
from masktrl.rollout.draw import draw_buffers, draw_tokens

_NO_PROCESSORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stateless_processors(model: torch.nn.Module, generate_kwargs: dict, history: torch.Tensor, mask: torch.Tensor):
    """``logits_processors`` (rollout/decode.py), remembered per model, keywords and generation
    config when ``generate`` would build no processor at all (the lab's and the default's
    settings: temperature 1, no top-p/k): building them deep-copies the generation config, ~5 ms
    a call. A non-empty list is built afresh every call (processors may keep per-row state)."""
    key = (repr(sorted(generate_kwargs.items())), repr(sorted(vars(model.generation_config).items())))
    known = _NO_PROCESSORS.setdefault(model, {})
    if key in known:
        return known[key]
    config, processors = logits_processors(model, generate_kwargs, history, mask)
    if not len(processors):
        if len(known) >= 64:  # settings that change call after call: keep the memory bounded
            known.clear()
        known[key] = (config, processors)
    return config, processors


@torch.no_grad()
def decode_fixed_batch(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    n: int,
    k: int,
    generate_kwargs: dict,
    draw: str = "multinomial",
):
    """``n`` responses per left-padded prompt of ``input_ids`` [P, W] (``attention`` its mask),
    every row in the batch until all have ended, as ``generate`` runs them. ``generate_kwargs``:
    the engine's keywords to ``generate`` (sampling settings, ``max_new_tokens``,
    ``pad_token_id``, ``eos_token_id``). Returns [R, T] ids (``pad`` after a row's end), [R, T]
    log mu, [R, T, K] top-K ids and log mu (R = P n, rows in ``num_return_sequences`` order)."""
    width = input_ids.shape[1]
    max_new = generate_kwargs["max_new_tokens"]
    pad, eos = generate_kwargs["pad_token_id"], generate_kwargs["eos_token_id"]
    history = input_ids.repeat_interleave(n, dim=0)
    mask = attention.repeat_interleave(n, dim=0)
    rows = history.shape[0]
    # the whole history in one buffer: each step writes its column, the processors read a view
    tokens = history.new_full((rows, width + max_new), pad)
    tokens[:, :width] = history
    full_mask = mask.new_ones(rows, width + max_new)
    full_mask[:, :width] = mask
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    shared = n > 1 and width > 1  # the engine's shared prefill; else generate's whole-prompt first step
    cache = prefill_cache(model, input_ids, attention, n) if shared else new_cache(model.config)
    cache = growing_cache(cache, spare=max_new)
    config, processors = stateless_processors(model, generate_kwargs, history, mask)
    buffers = None
    use_mask = not bool((attention == 1).all())  # generate drops an all-ones mask too
    kw = cache_kwarg(model)
    lean = lean_step(model, cache)  # None: through model(...)
    # generate asks for the last position's logits only: the lm_head GEMM then has one row per
    # sequence, and its rounding can differ from a GEMM over every prompt position
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    finished = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
    token, positions = (history[:, -1:], positions[:, -1:]) if shared else (history, positions)
    ids, logp, top_ids, top_lp = [], [], [], []
    for t in range(max_new):
        end = width + t
        step_mask = full_mask[:, :end] if use_mask else None
        if lean is not None:
            logits = lean(token, positions, step_mask)
        else:
            logits = model(
                input_ids=token, attention_mask=step_mask, position_ids=positions, use_cache=True, **{kw: cache}, **keep
            ).logits
        scores = logits[:, -1].float()
        if len(processors):
            scores = processors(tokens[:, :end], scores)
        lp = torch.log_softmax(scores, dim=-1)
        if buffers is None:  # sized by the first step's scores, reused by every later one
            buffers = draw_buffers(draw, lp.shape[0], lp.shape[1], lp.device)
        nxt = draw_tokens(scores, lp, config.do_sample, draw, buffers)
        nxt = nxt.masked_fill(finished, pad)  # generate's pad for the rows that have ended
        vals, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)
        ids.append(nxt)
        logp.append(lp.gather(1, nxt[:, None]).squeeze(1))
        top_ids.append(idx)
        top_lp.append(vals)
        finished |= nxt == eos
        if t + 1 == max_new or bool(finished.all()):
            break
        tokens[:, end] = nxt
        token = nxt[:, None]
        positions = positions[:, -1:] + 1
    return torch.stack(ids, 1), torch.stack(logp, 1), torch.stack(top_ids, 1), torch.stack(top_lp, 1)
