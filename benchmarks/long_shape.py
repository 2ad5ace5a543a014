"""The long shape: long prompts, ragged heavy-tailed responses, an 11 M-parameter model.

Shared by ``vs_trl.py --shape long`` and ``roofline.py``. The workload is the ``longtail`` task
(masktrl/tasks/longtail.py): prompts of 64-256 tokens, each asking for a response of ``L``
tokens with ``L`` log-normal (median 128) clipped to 32..512; each response's own length is ``L``
times a log-normal factor (``row_length``), so the samples of a group differ in length too.

The model is a randomly initialised Qwen3 of the tiny family, made larger (hidden 384, 7
layers, 6 heads / 2 KV heads, MLP 1024: 11.05 M parameters, 11.02 M outside the embeddings),
with the task's character tokenizer (41 tokens), built once and cached under
``outputs/.cache/bench-long/``. A random model does not follow the length target, so while a
benchmark runs, ``follow_target_lengths`` adds a logits processor to every transformers
``generate`` call in the process (both trainers' generation goes through it): EOS is suppressed
before the response's length and forced at it. The tokens themselves are sampled from the
model; the length follows from the prompt and the first two sampled tokens by the same rule on
both sides, so both do the same, heavy-tailed work.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import statistics
from pathlib import Path

import torch

from common import OUT, bench_config

SPREAD = 0.5  # log-scale spread of a response's length around its prompt's target (within a group)
LONG_MODEL = dict(
    hidden_size=384, num_layers=7, num_heads=6, num_kv_heads=2, intermediate_size=1024, max_positions=1024
)
MAX_NEW_TOKENS = 512


def long_model(seed: int = 0) -> Path:
    """Folder of the long shape's model and tokenizer (built once)."""
    from masktrl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
    from masktrl.tasks.longtail import ALPHABET

    key = hashlib.sha256(json.dumps([LONG_MODEL, ALPHABET, seed]).encode()).hexdigest()[:12]
    dest = OUT / ".cache" / "bench-long" / key
    if (dest / "config.json").is_file() and (dest / "tokenizer.json").is_file():
        return dest
    tok = build_char_tokenizer(ALPHABET)
    model = build_tiny_model(tok, TinyModelConfig(**LONG_MODEL), seed)
    tmp = dest.with_name(dest.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(dest)
    return dest


def long_config(model_dir: Path, *overrides: str):
    """The long shape's masktrl config: the tiny preset's keys, the long task and model."""
    return bench_config(
        f"model.path={model_dir}",
        "task.name=longtail",
        "task.n_test=4",
        "eval.max_new_tokens=4",  # eval before/after is outside the timed steps; keep it short
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
        *overrides,
    )


def param_count(model_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir)
    total = sum(p.numel() for p in m.parameters())
    emb = m.get_input_embeddings().weight.numel() + m.get_output_embeddings().weight.numel()
    return {"total": total, "non_embedding": total - emb}


def row_length(target: int, first: int, second: int, low: int = 32, high: int = MAX_NEW_TOKENS) -> int:
    """A response's length: its prompt's target ``L`` times a log-normal factor (``SPREAD``)
    drawn from a hash of the response's first two tokens, clipped to [low, high]. So the
    samples of one group differ in length as a policy's do, by a rule that is the same in both
    trainers (it depends only on the sampled tokens)."""
    u = ((first * 1_000_003 + second) * 2_654_435_761 % 2**32 + 0.5) / 2**32
    z = statistics.NormalDist().inv_cdf(u)
    return min(high, max(low, round(target * math.exp(SPREAD * z))))


class TargetLength:
    """Logits processor: EOS suppressed before a row's length (``row_length``), forced at it.

    The target of a row is read from its prompt (``...|<L>=``, left-padded or not); the first
    call of a ``generate`` fixes where the response starts, the third (two tokens sampled)
    fixes each row's length."""

    def __init__(self, tokenizer):
        self.eos = tokenizer.eos_token_id
        vocab = tokenizer.get_vocab()
        self.digit = {vocab[str(d)]: d for d in range(10)}
        self.bar = vocab["|"]
        self.start = None
        self.targets = None

    def _targets(self, ids: torch.Tensor) -> torch.Tensor:
        out = []
        for row in ids.tolist():
            cut = len(row) - 1 - row[::-1].index(self.bar)
            digits = [self.digit[t] for t in row[cut + 1 :] if t in self.digit]
            out.append(int("".join(map(str, digits))) if digits else MAX_NEW_TOKENS)
        return torch.tensor(out)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (``rollout.drop_finished`` removes ended rows from the batch)."""
        if self.targets is not None:
            self.targets = self.targets[indices.to(self.targets.device)]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.start is None:
            self.start = input_ids.shape[1]
            self.targets = self._targets(input_ids).to(scores.device)
        t = input_ids.shape[1] - self.start  # response tokens so far; this call picks token t (0-based)
        if t == 2:
            firsts = input_ids[:, self.start : self.start + 2].tolist()
            self.targets = torch.tensor(
                [row_length(int(L), a, b) for L, (a, b) in zip(self.targets.tolist(), firsts)], device=scores.device
            )
        if t < 2:
            scores = scores.clone()
            scores[:, self.eos] = float("-inf")
            return scores
        before = t < self.targets - 1  # [B]
        at = t == self.targets - 1
        scores = scores.clone()
        scores[before, self.eos] = float("-inf")
        forced = torch.full_like(scores[0], float("-inf"))
        forced[self.eos] = 0.0
        scores[at] = forced
        return scores


@contextlib.contextmanager
def follow_target_lengths(tokenizer):
    """Every transformers ``generate`` in this process gets a fresh ``TargetLength`` processor."""
    import transformers.generation.utils as gen_utils

    orig = gen_utils.GenerationMixin._get_logits_processor

    def patched(self, *args, **kwargs):
        procs = orig(self, *args, **kwargs)
        procs.append(TargetLength(tokenizer))
        return procs

    gen_utils.GenerationMixin._get_logits_processor = patched
    try:
        yield
    finally:
        gen_utils.GenerationMixin._get_logits_processor = orig
