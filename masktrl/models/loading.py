"""Loading models and tokenizers: a local folder, a run's checkpoint, or a hub id (cache only)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from masktrl.errors import MasktrlError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def load_model_and_tokenizer(path: str | Path, dtype: str = "float32"):
    """``path``: a folder with config.json (a checkpoint or a run's step) or a hub id.

    Hub ids resolve from the local cache only unless HF_HUB_OFFLINE=0 is set explicitly:
    masktrl itself never downloads.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    local = Path(path)
    if not local.exists():
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    elif not (local / "config.json").is_file():
        raise MasktrlError(f"{local}: not a model folder (no config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype])
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MasktrlError(f"cannot load model {path}: {first}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary, used to refuse replaying rollouts across tokenizers."""
    import hashlib
    import json

    vocab = tokenizer.get_vocab()
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]
