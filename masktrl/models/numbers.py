"""Number tokens for the lab: one token per integer, and a structured initialisation of their
embeddings.

``build_number_tokenizer(n)`` has one word-level token per integer ``0 .. n-1`` plus
pad/eos/unk and a separator ``=``; words are whitespace-separated and decode joined by one
space, so ``"12 40 3 1 ="`` round-trips. With ``n = 2000`` the vocabulary has 2,004 tokens,
much larger than the K = 20 of the behaviour's top-K lists.

``init_number_embeddings`` writes, into the first columns of both the input embedding and the
(untied) output embedding of every number token ``x``, features of its value: residues
``cos/sin(2 pi x / m)`` for ``m = 2..9``, a one-hot band per hundred and a few low-frequency
waves of ``x``; the other columns keep their small random values. A tiny model then learns
tasks over numbers from a few hundred supervised steps, where the same model from a purely
random initialisation learns nothing in that budget (docs/LAB.md).
"""

from __future__ import annotations

import math

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from masktrl.models.vocab import SPECIAL_TOKENS, UNK, wrap_tokenizer

NUMBER_TOKENS = 2000
SEPARATOR = "="
MODULI = tuple(range(2, 10))
BAND = 100  # one band feature per this many consecutive integers
LOW_FREQUENCIES = 4  # cos/sin(pi f x / n) for f = 1..LOW_FREQUENCIES


def build_number_tokenizer(n_numbers: int = NUMBER_TOKENS) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: pad/eos/unk, ``=``, then ``"0" .. str(n_numbers - 1)`` (ids 4..)."""
    if n_numbers < 1:
        raise ValueError(f"n_numbers must be >= 1, got {n_numbers}")
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, SEPARATOR))}
    for x in range(n_numbers):
        vocab[str(x)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # no decoder: tokens decode joined by " "
    return wrap_tokenizer(tok)


def number_token_ids(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """([n] token ids, [n] integer values) of every token whose text is a non-negative integer."""
    pairs = sorted((int(t), i) for t, i in tokenizer.get_vocab().items() if t.isdecimal() and str(int(t)) == t)
    values = torch.tensor([v for v, _ in pairs], dtype=torch.long)
    ids = torch.tensor([i for _, i in pairs], dtype=torch.long)
    return ids, values


def number_features(values: torch.Tensor, n_numbers: int) -> torch.Tensor:
    """[n, F] features of integer ``values`` in [0, n_numbers), each entry in [-1, 1].

    Columns: cos(2 pi x/m) and, for m > 2, sin(2 pi x/m), m in MODULI (15); a one-hot band
    x // BAND (ceil(n_numbers / BAND)); cos and sin(pi f x / n_numbers), f = 1..LOW_FREQUENCIES.
    """
    x = values.to(torch.float64)
    cols = []
    for m in MODULI:
        angle = 2 * math.pi * x / m
        cols.append(torch.cos(angle))
        if m > 2:  # sin(pi x) = 0 for every integer
            cols.append(torch.sin(angle))
    n_bands = -(-n_numbers // BAND)
    bands = torch.nn.functional.one_hot(values // BAND, n_bands).to(torch.float64)  # [n, n_bands]
    waves = []
    for f in range(1, LOW_FREQUENCIES + 1):
        angle = math.pi * f * x / n_numbers
        waves += [torch.cos(angle), torch.sin(angle)]
    return torch.cat([torch.stack(cols, dim=1), bands, torch.stack(waves, dim=1)], dim=1)


@torch.no_grad()
def init_number_embeddings(model, tokenizer, scale: float = 1.0) -> int:
    """Overwrite the first F columns of the number tokens' input and output embeddings with
    ``scale * number_features``; return F. Other tokens and columns are left as they are."""
    ids, values = number_token_ids(tokenizer)
    if not len(ids):
        raise ValueError("the tokenizer has no number tokens")
    feats = number_features(values, int(values.max()) + 1)  # [n, F]
    for emb in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):  # [V, H] each
        if feats.shape[1] > emb.shape[1]:
            raise ValueError(f"{feats.shape[1]} number features do not fit in hidden size {emb.shape[1]}")
        emb[ids, : feats.shape[1]] = (scale * feats).to(emb.dtype)
    return feats.shape[1]
