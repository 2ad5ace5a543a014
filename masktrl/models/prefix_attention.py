"""Decode attention with a shared prompt's keys and values held once (``rollout.drop_finished``).

The ``n`` samples of a prompt attend to the same prompt keys. The transformers cache, and the
engine's shared prefill (rollout/decode.py: ``prefill_cache``), hold those keys once per
sample, so every decode step reads each prompt's keys and values ``n`` times; at the long shape
(prompts of 64-256 tokens, 8 samples) that is most of the attention's memory traffic.
``SharedPrefix`` keeps each prompt's keys and values once ([P, Hkv, W, D]) and each running
row's own (its last prompt token and its response so far) in buffers with spare positions. A
decode step's attention is then, per layer:

* the prompt part: the queries of a prompt's samples stacked into one matrix (a slot per sample
  ``[P, Hkv, n * rep, D]``) against that prompt's keys once, the prompt's left padding masked;
* the row part: each row's query against its own keys;
* one softmax over both parts' scores, then the weights times the values of each part, summed.

That is softmax(q K^T / sqrt(d)) V over the row's prompt and response keys, as transformers'
attention computes it, in another order of the same sums: equal up to float rounding, not bit
for bit (tests/test_rollout_drop_finished.py checks the logits in float64 against the lean step
over the per-row cache, which is the transformers forward bit for bit). Grouped-query
attention keeps transformers' layout: query head ``h`` reads key head ``h // rep``.

Rows leave the batch as they end (``select``); a prompt whose samples have all ended leaves
with its last one, so its keys are no longer read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class SharedPrefix:
    """The keys and values a decode step attends to: each prompt's once, each row's own.

    ``prompt_keys``/``prompt_values``: per layer [P, Hkv, W, D] (W >= 1); ``prompt_mask``
    [P, W]: 1 where a prompt position is a token, 0 where it is left padding; ``n`` rows per
    prompt, in ``num_return_sequences`` order (row ``r`` is sample ``r % n`` of prompt ``r // n``);
    ``scaling``: the attention's scale; ``spare``: positions of the rows' buffers before the first
    growth."""

    def __init__(
        self,
        prompt_keys: list[Tensor],
        prompt_values: list[Tensor],
        prompt_mask: Tensor,
        n: int,
        scaling: float,
        spare: int,
    ):
        self.pk, self.pv = list(prompt_keys), list(prompt_values)
        P = prompt_mask.shape[0]
        if prompt_mask.shape[1] == 0:
            raise ValueError("SharedPrefix needs at least one prompt position (prompts of one token share nothing)")
        dtype = self.pk[0].dtype
        self.bias = torch.zeros(P, 1, 1, prompt_mask.shape[1], dtype=dtype, device=prompt_mask.device)
        self.bias.masked_fill_((prompt_mask == 0)[:, None, None, :], float("-inf"))  # [P, 1, 1, W]
        rows = torch.arange(P * n, device=prompt_mask.device)
        self.prompt_of, self.slot = rows // n, rows % n  # [R]: a row's prompt, its sample index
        self.n, self.scaling, self.spare = n, scaling, max(1, spare)
        layers = len(self.pk)
        self.k: list[Tensor | None] = [None] * layers  # [R, Hkv, capacity, D]
        self.v: list[Tensor | None] = [None] * layers
        self.length = [0] * layers

    def _append(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write a step's keys and values [R, Hkv, S, D] of layer ``i``; return the row's keys and
        values so far (views)."""
        end = self.length[i] + k.shape[-2]
        old_k, old_v = self.k[i], self.v[i]
        if old_k is None or old_v is None or end > old_k.shape[-2]:
            capacity = max(end + self.spare, 2 * (0 if old_k is None else old_k.shape[-2]))
            buf_k = k.new_empty(*k.shape[:-2], capacity, k.shape[-1])
            buf_v = v.new_empty(*v.shape[:-2], capacity, v.shape[-1])
            if old_k is not None and old_v is not None:
                buf_k[..., : self.length[i], :] = old_k[..., : self.length[i], :]
                buf_v[..., : self.length[i], :] = old_v[..., : self.length[i], :]
            self.k[i], self.v[i] = buf_k, buf_v
        else:
            buf_k, buf_v = old_k, old_v
        buf_k[..., self.length[i] : end, :] = k
        buf_v[..., self.length[i] : end, :] = v
        self.length[i] = end
        return buf_k[..., :end, :], buf_v[..., :end, :]

    def _to_slots(self, x: Tensor) -> Tensor:
        """Rows [R, Hkv, rep, X] -> a prompt's samples stacked [P, Hkv, n * rep, X] (zeros in the
        slots of rows that have ended)."""
        R, hkv, rep, last = x.shape
        P = self.bias.shape[0]
        if R == P * self.n:  # every prompt's n rows, in order: a reshape
            return x.view(P, self.n, hkv, rep, last).permute(0, 2, 1, 3, 4).reshape(P, hkv, self.n * rep, last)
        slots = x.new_zeros(self.bias.shape[0], self.n, hkv, rep, last)
        slots[self.prompt_of, self.slot] = x
        return slots.permute(0, 2, 1, 3, 4).reshape(-1, hkv, self.n * rep, last)

    def _from_slots(self, y: Tensor, rep: int) -> Tensor:
        """``_to_slots``'s inverse: [P, Hkv, n * rep, X] -> the rows' [R, Hkv, rep, X]."""
        P, hkv, _, last = y.shape
        rows = y.view(P, hkv, self.n, rep, last).permute(0, 2, 1, 3, 4)
        if self.prompt_of.shape[0] == P * self.n:
            return rows.reshape(P * self.n, hkv, rep, last)
        return rows[self.prompt_of, self.slot]

    def attend(self, i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Layer ``i``'s attention for one decode position: q [R, Hq, 1, D], the step's k, v
        [R, Hkv, 1, D] (appended to the rows' own); returns [R, 1, Hq, D]."""
        R, hq, S, D = q.shape
        if S != 1:
            raise ValueError("SharedPrefix attends one decode position at a time")
        ks, vs = self._append(i, k, v)
        hkv = ks.shape[1]
        rep = hq // hkv
        qg = q.reshape(R, hkv, rep, D) * self.scaling  # query head h = kv head h // rep
        own = torch.matmul(qg, ks.transpose(-1, -2))  # [R, Hkv, rep, t]
        width = self.bias.shape[-1]
        shared = torch.matmul(self._to_slots(qg), self.pk[i].transpose(-1, -2)) + self.bias
        scores = torch.cat([self._from_slots(shared, rep), own], dim=-1)  # [R, Hkv, rep, W + t]
        weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(vs.dtype)
        out = torch.matmul(weights[..., width:], vs)  # [R, Hkv, rep, D]
        out = out + self._from_slots(torch.matmul(self._to_slots(weights[..., :width]), self.pv[i]), rep)
        return out.reshape(R, 1, hq, D)

    def select(self, keep: Tensor) -> None:
        """Keep the rows ``keep`` (indices into the running rows); prompts left without a row
        leave too."""
        self.prompt_of, self.slot = self.prompt_of[keep], self.slot[keep]
        for i, (bk, bv) in enumerate(zip(self.k, self.v)):
            if bk is not None and bv is not None:
                self.k[i], self.v[i] = bk[keep], bv[keep]
        live = torch.unique(self.prompt_of)  # sorted
        if live.numel() < self.bias.shape[0]:
            self.pk = [x[live] for x in self.pk]
            self.pv = [x[live] for x in self.pv]
            self.bias = self.bias[live]
            self.prompt_of = torch.searchsorted(live, self.prompt_of)


def shared_prefix(model: Any, cache, attention: Tensor, n: int, spare: int) -> SharedPrefix:
    """The ``SharedPrefix`` of ``cache``, the keys and values of all but the last token of each
    left-padded prompt (mask ``attention`` [P, W]) computed once per prompt (the engine's shared
    prefill, rollout/decode.py: ``prefill_cache`` with one row per prompt), for ``n`` samples
    each of the dense Qwen3 ``model`` (its layers' attention scale)."""
    layers = model.model.layers[: model.config.num_hidden_layers]
    keys = [layer.keys for layer in cache.layers[: len(layers)]]
    values = [layer.values for layer in cache.layers[: len(layers)]]
    return SharedPrefix(keys, values, attention[:, :-1], n, layers[0].self_attn.scaling, spare)
