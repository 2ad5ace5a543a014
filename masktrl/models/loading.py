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
    if not local.exists() and str(path).startswith(("/", "./", "../", "~")):
        raise MasktrlError(f"no such model folder: {path}")
    if local.exists() and not (local / "config.json").is_file():
        raise MasktrlError(f"{local}: not a model folder (no config.json)")
    offline = hub_offline()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=offline)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype], local_files_only=offline)
    except (OSError, ValueError) as exc:
        if offline and not local.exists():
            raise MasktrlError(
                f"cannot load model {path}: not a local folder and not in the local hub cache "
                "(masktrl never downloads: pass a local folder, or fill the cache first)"
            ) from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MasktrlError(f"cannot load model {path}: {first}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def hub_offline() -> bool:
    """True unless the user explicitly allows downloads with HF_HUB_OFFLINE=0: hub ids are
    resolved from the local cache only. (Passed as ``local_files_only``, because
    huggingface_hub reads HF_HUB_OFFLINE once, at import.)"""
    return os.environ.get("HF_HUB_OFFLINE", "1").lower() not in ("0", "false", "no")


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary, used to refuse replaying rollouts across tokenizers."""
    import hashlib
    import json

    vocab = tokenizer.get_vocab()
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]
