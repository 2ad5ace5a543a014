"""Rollouts with transformers ``generate`` (batched, KV cache): the CPU engine.

Recorded log-probabilities are ``log_softmax`` of the *processed* scores that ``generate``
samples from, i.e. ``log_softmax(logits / T)`` with ``top_p = 1``. With ``top_p < 1`` the
scores of tokens outside the nucleus are ``-inf``: the recorded distribution is then the
truncated, renormalised one actually sampled from, and such tokens appear in the top-K
lists (if K exceeds the nucleus) as zero-mass atoms (``-inf``), as docs/METHODS.md §0 allows.

The ``n`` samples of a prompt share one prefill: the prompt runs through the model once and its
KV cache is copied to the ``n`` rows, instead of ``generate(num_return_sequences=n)`` running it
``n`` times. The logits and, for a given seed, the samples are those of the plain call (the rows
and the sampling draws are in the same order); only the prompt compute is divided by ``n``.

With ``drop_finished`` (``rollout.drop_finished``) the engine runs its own decode loop instead
of ``generate`` after the same prefill: rows that have ended leave the batch and the KV cache
(``rollout/decode.py``); the records are computed as here.

With ``decode="fused"`` (``rollout.decode``) it runs its own fixed-batch loop instead
(``rollout/fused.py``): the same forwards, draws and records as ``generate`` (bit-identical for
one seed), without ``generate``'s per-step bookkeeping. Either loop draws sampled tokens as
``draw`` (``rollout.draw``) says: ``torch.multinomial`` as ``generate`` does, or
``inverse_cdf`` (one uniform per row, ``rollout/draw.py``).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

import torch

from masktrl.errors import MasktrlError
from masktrl.models.kvcache import cache_kwarg
from masktrl.models.loading import DTYPES
from masktrl.models.lowprec import LowPrecisionCopy
from masktrl.models.moe import routing_records
from masktrl.rollout.base import Generation, SamplingSettings
from masktrl.rollout.decode import decode_dropping_finished, prefill_cache
from masktrl.rollout.draw import not_finite
from masktrl.rollout.fused import decode_fixed_batch


def sampling_kwargs(s: SamplingSettings) -> dict:
    if s.greedy:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    # generation_config defaults to top_k=50: switch it off so we sample the full softmax(z/T)
    return {"do_sample": True, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}


def shared_prefill(model: torch.nn.Module, input_ids: torch.Tensor, attention: torch.Tensor, n: int) -> dict:
    """``generate`` inputs for ``n`` samples per left-padded prompt [P, W] with one prefill per prompt.

    All but each prompt's last token go through the base model once; the cache is repeated
    ``n`` times per row, so ``generate`` only runs the last prompt token (and the new ones) per
    sample. Same row order as ``num_return_sequences=n``.
    """
    cache = prefill_cache(model, input_ids, attention, n)
    return {
        "input_ids": input_ids.repeat_interleave(n, dim=0),  # [P*n, W]
        "attention_mask": attention.repeat_interleave(n, dim=0),
        cache_kwarg(model): cache,
    }


def synced_processes(model: torch.nn.Module) -> bool:
    """Whether ``generate`` keeps every process stepping until all have ended (transformers'
    ``synced_gpus``: DeepSpeed ZeRO-3 or FSDP across processes, whose forwards gather weights
    collectively). masktrl's loops end per process, so there the engine runs ``generate``: the
    fixed-batch loop's tokens and records are its own, ``drop_finished``'s tokens too."""
    import torch.distributed as tdist
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    world = tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1
    return world > 1 and (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model))


@contextmanager
def gc_paused():
    """Pause Python's cyclic garbage collector while building many small lists.

    The records of one rollout batch are ~10^5 small lists; building them triggers several
    collections, each scanning every live object (model, samples, ...), which cost ~15 ms per
    step on the tiny default, four times the conversion itself. None of these lists can be
    cyclic garbage, so nothing is lost by collecting later.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def eval_mode(model: torch.nn.Module) -> bool:
    """``model`` in eval mode (``model.eval()`` only when one of its modules is training: it visits
    every module, ~2 ms on a tiny model); returns whether it was training."""
    was_training = model.training
    if was_training or any(m.training for m in model.modules()):
        model.eval()
    return was_training


@contextmanager
def finite_probabilities():
    """A sampling draw from non-finite probabilities (``torch.multinomial``'s RuntimeError) as the
    one-line MasktrlError of a diverged policy."""
    try:
        yield
    except RuntimeError as exc:
        if "probability tensor contains" not in str(exc):
            raise
        raise not_finite() from None


def check_context(model, prompts: list[list[int]]) -> None:
    """MasktrlError, before anything is generated, for a prompt that leaves no position of the
    model's context for a response (transformers would run it anyway, far past what the model
    was trained on, at a cost quadratic in its length: a megabyte of text ran for minutes)."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not context:
        return
    too_long = [len(p) for p in prompts if len(p) >= context]
    if too_long:
        raise MasktrlError(
            f"{len(too_long)} of {len(prompts)} prompts do not fit the model's context "
            f"({context} positions); "
            f"the longest has {max(too_long)} tokens"
        )


class HFEngine:
    """Generation with the training model itself (no copy: weights are always in sync), or, with
    ``dtype`` other than the model's or ``quantization``, with a low-precision copy of it
    (``models/lowprec.py``) re-made from the model's weights at every ``sync_weights``; the
    recorded log mu and top-K lists are then the copy's, as with a real engine."""

    name = "hf"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        batch_size: int = 512,
        dtype: str | None = None,
        quantization: str | None = None,
        drop_finished: bool = False,
        decode: str = "generate",
        draw: str = "multinomial",
    ):
        self.tokenizer = tokenizer
        self.batch_size = batch_size  # prompts x n generated together
        self.drop_finished = drop_finished  # masktrl's decode loop (rollout/decode.py) instead of generate
        self.decode = decode  # generate | fused: masktrl's fixed-batch loop (rollout/fused.py)
        self.draw = draw  # multinomial | inverse_cdf (rollout/draw.py): how masktrl's loops draw a token
        self.dtype, self.quantization = dtype, quantization
        self.copy: LowPrecisionCopy | None = None
        self.record_routing = False  # model.routing_replay: record each sample's routing (Generation.routing)
        self.sync_weights(model)

    def needs_copy(self, model: torch.nn.Module) -> bool:
        """Whether the engine samples from a copy: another dtype than ``model``'s, or FP8."""
        own = next(model.parameters()).dtype
        return self.quantization is not None or (self.dtype is not None and DTYPES[self.dtype] != own)

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Sample from ``model``'s current weights: itself, or its low-precision copy re-made now."""
        self.policy = model  # the trainer's model (mismatch measurements compare against it)
        if not self.needs_copy(model):
            self.model = model
            return
        if self.copy is None:
            own = next(model.parameters()).dtype
            self.copy = LowPrecisionCopy(model, DTYPES[self.dtype] if self.dtype else own, self.quantization)
        else:
            self.copy.refresh(model)
        self.model = self.copy.model

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], settings: SamplingSettings, seed: int) -> list[list[Generation]]:
        check_context(self.model, prompts)
        per_call = max(1, self.batch_size // settings.n)
        gens: list[list[Generation]] = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for start in range(0, len(prompts), per_call):
                gens.extend(self._generate_chunk(prompts[start : start + per_call], settings))
        if self.record_routing:
            self._record_routing(prompts, gens, per_call * settings.n)
        return gens

    def _record_routing(self, prompts: list[list[int]], gens: list[list[Generation]], rows_per_call: int) -> None:
        """``Generation.routing`` of every sample: the top-k experts the engine's model (its
        low-precision copy, if any) picks at each prompt and response position, teacher-forced on
        prompt + response right after sampling, ``rows_per_call`` sequences a forward."""
        flat = [(p, g) for p, group in zip(prompts, gens) for g in group]
        was_training = self.model.training
        self.model.eval()
        try:
            for i in range(0, len(flat), rows_per_call):
                part = flat[i : i + rows_per_call]
                for (_, g), rec in zip(
                    part, routing_records(self.model, [list(p) + list(g.response_ids) for p, g in part])
                ):
                    g.routing = rec
        finally:
            self.model.train(was_training)

    def _generate_chunk(self, prompts: list[list[int]], s: SamplingSettings) -> list[list[Generation]]:
        tok = self.tokenizer
        width = max(len(p) for p in prompts)
        pad = tok.pad_token_id
        device = next(self.model.parameters()).device  # a GPU under accelerate launch
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # [P, W] left-padded
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        was_training = eval_mode(self.model)
        if (self.drop_finished or self.decode == "fused") and not synced_processes(self.model):
            kwargs = dict(
                sampling_kwargs(s), max_new_tokens=s.max_new_tokens, pad_token_id=pad, eos_token_id=tok.eos_token_id
            )
            loop = decode_dropping_finished if self.drop_finished else decode_fixed_batch
            with finite_probabilities():
                tensors = loop(self.model, input_ids, attention, s.n, s.logprobs_k, kwargs, draw=self.draw)
            if was_training:
                self.model.train()
            with gc_paused():
                return self._records(*tensors, len(prompts), s.n, kept=self._kept_bound(s))
        if s.n > 1 and width > 1:
            inputs = shared_prefill(self.model, input_ids, attention, s.n)
        else:
            inputs = {"input_ids": input_ids, "attention_mask": attention, "num_return_sequences": s.n}
        with finite_probabilities():
            out = self.model.generate(
                **inputs,
                **sampling_kwargs(s),
                max_new_tokens=s.max_new_tokens,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=pad,
                eos_token_id=tok.eos_token_id,
            )
        if was_training:
            self.model.train()
        new = out.sequences[:, width:]  # [P*n, T]
        k = s.logprobs_k
        logp_steps, ids_steps, topk_steps = [], [], []
        for t, scores in enumerate(out.scores):  # one [P*n, V] tensor per generated position
            lp = torch.log_softmax(scores.float(), dim=-1)
            top_lp, top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
            logp_steps.append(lp.gather(1, new[:, t : t + 1]).squeeze(1))
            ids_steps.append(top_ids)
            topk_steps.append(top_lp)
        with gc_paused():
            return self._records(
                new,
                torch.stack(logp_steps, 1),
                torch.stack(ids_steps, 1),
                torch.stack(topk_steps, 1),
                len(prompts),
                s.n,
                kept=self._kept_bound(s),
            )

    def _kept_bound(self, s: SamplingSettings) -> bool | None:
        """None: untruncated sampling (no kept set recorded); else whether every kept set is known
        to fit the top-K list (top_k <= K, or a vocabulary of at most K tokens)."""
        if not s.truncated:
            return None
        vocab = self.model.get_output_embeddings().weight.shape[0]
        return (0 < s.top_k <= s.logprobs_k) or vocab <= s.logprobs_k

    def _records(
        self, new, logp, top_ids, top_lp, n_prompts: int, n: int, kept: bool | None = None
    ) -> list[list[Generation]]:
        """The per-token tensors (ids and log mu [P*n, T], top-K ids and log mu [P*n, T, K]) as
        ``Generation`` records (Python lists), cut after EOS. ``kept`` (not None: truncated
        sampling): each token's kept-set size, the entries of its top-K list with mu > 0 (the
        processed scores of the tokens top-k / top-p dropped are -inf, so they sort after every
        kept token): the kept set is that list's prefix. Unless ``kept`` is True (every kept set
        is known to fit the list), a list with no -inf entry may have a larger kept set behind
        it: its size is recorded as K + 1, "more than K", which training refuses."""
        tok = self.tokenizer
        sizes = None
        if kept is not None:
            finite = torch.isfinite(top_lp).sum(-1)  # [P*n, T]
            if not kept:
                finite = torch.where(finite == top_lp.shape[-1], finite + 1, finite)
            sizes = finite.tolist()
        logp = logp.tolist()  # [P*n, T]
        top_ids = top_ids.tolist()  # [P*n, T, K]
        top_lp = top_lp.tolist()
        rows = new.tolist()
        eos = tok.eos_token_id  # read once: a tokenizer attribute lookup costs ~1 us
        result: list[list[Generation]] = []
        for i in range(n_prompts):
            group = []
            for j in range(i * n, (i + 1) * n):
                ids = rows[j]
                length = ids.index(eos) + 1 if eos in ids else len(ids)
                group.append(
                    Generation(
                        response_ids=ids[:length],
                        logp=logp[j][:length],
                        topk_ids=top_ids[j][:length],
                        topk_logp=top_lp[j][:length],
                        finished=length < len(ids) or ids[length - 1] == eos,
                        kept=sizes[j][:length] if sizes is not None else None,
                    )
                )
            result.append(group)
        return result
