"""The embedded default model: a tiny Qwen3-architecture causal LM (or another architecture,
``architectures.py``) and its tokenizer: characters (``vocab.py``) or numbers (the lab's, ``numbers.py``).

Both are built locally (no hub) and saved with ``save_pretrained`` so every later stage,
and vLLM, loads them exactly like a real checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerFast

from masktrl.config import MOE_DEFAULTS
from masktrl.models.numbers import build_number_tokenizer
from masktrl.models.vocab import (
    EOS,
    PAD,
    SPECIAL_TOKENS,
    UNK,
    build_char_tokenizer,
    build_word_tokenizer,
    wrap_tokenizer,
)

__all__ = [
    "EOS",
    "PAD",
    "SPECIAL_TOKENS",
    "UNK",
    "TinyModelConfig",
    "build_char_tokenizer",
    "build_tiny_model",
    "tiny_tokenizer",
    "wrap_tokenizer",
]


@dataclass(frozen=True)
class TinyModelConfig:
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_positions: int = 256
    num_experts: int = MOE_DEFAULTS["num_experts"]  # MoE architectures only
    experts_per_token: int = MOE_DEFAULTS["experts_per_token"]

    @classmethod
    def of(cls, m) -> TinyModelConfig:
        """The shape of the tiny model a ``ModelConfig`` describes."""
        experts, top_k = m.moe_shape()
        return cls(
            m.hidden_size,
            m.num_layers,
            m.num_heads,
            m.num_kv_heads,
            m.intermediate_size,
            max_positions=m.max_positions or TinyModelConfig.max_positions,
            num_experts=experts,
            experts_per_token=top_k,
        )


def tiny_tokenizer(kind: str, alphabet: str | None) -> PreTrainedTokenizerFast:
    """The tiny model's tokenizer of ``model.tokenizer`` = ``kind``: 'char' (one token per
    character of the task's ``alphabet``), 'numbers' (one token per integer, ``numbers.py``) or
    'words' (one token per whitespace-separated word of ``alphabet``)."""
    if kind == "numbers":
        return build_number_tokenizer()
    if kind == "words":
        return build_word_tokenizer((alphabet or "").split())
    return build_char_tokenizer(alphabet)


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, cfg: TinyModelConfig, seed: int, architecture: str = "qwen3"):
    """A randomly initialised causal LM of ``architecture`` (``architectures.ARCHITECTURES``;
    default Qwen3) with untied embeddings (tied tiny models degenerate in engines)."""
    import torch

    from masktrl.models.architectures import get_architecture, model_classes

    arch = get_architecture(architecture)
    config_class, model_class = model_classes(arch)
    head_dim = {"head_dim": cfg.hidden_size // cfg.num_heads} if arch.head_dim else {}
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        **arch.extra(cfg),
        **head_dim,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model
