"""The tiny model's token basics: the special tokens, the character tokenizer, and the
wrapping of a ``tokenizers`` tokenizer as a transformers one (``numbers.py`` builds on them too)."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK)


def build_char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """A tokenizer with one token per character of ``alphabet`` plus pad/eos/unk.

    Text round-trips exactly (spaces and newlines included) because every character is
    its own pre-token and the decoder concatenates tokens without separators.
    """
    chars = sorted(set(alphabet))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return wrap_tokenizer(tok)


def build_word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A tokenizer with one token per word of ``words`` plus pad/eos/unk: text is split at
    whitespace and decoded with single spaces (the agentic lab's, model.tokenizer=words)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return wrap_tokenizer(tok)


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """A ``tokenizers`` word-level tokenizer with the special tokens as a transformers tokenizer."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
