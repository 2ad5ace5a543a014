"""Loading models and tokenizers: a local folder, a run's checkpoint, or a hub id (cache only)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from masktrl.errors import MasktrlError
from masktrl.models.lora import is_adapter_folder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def load_model_and_tokenizer(path: str | Path, dtype: str = "float32"):
    """``path``: a folder with config.json (a checkpoint or a run's step) or a hub id.

    Hub ids resolve from the local cache only unless HF_HUB_OFFLINE=0 is set explicitly:
    masktrl itself never downloads. An adapter checkpoint of a LoRA run (``models/lora.py``:
    adapter_config.json naming its base, no config.json) loads as its base model with the
    adapters merged: a plain model with the adapted outputs.
    """
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(path)
    if is_adapter_folder(path):
        return _load_adapted(path, dtype), tokenizer
    with _load_errors(path, "model"):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype], local_files_only=hub_offline())
    return model, tokenizer


def load_trainable_policy(path: str | Path, dtype: str, lora=None, seed: int = 0):
    """The policy as training holds it, for replaying an update: a LoRA run's checkpoint as its
    base with the adapters injected and loaded (not merged: its optimizer state is the
    adapters'); a plain checkpoint as it is, with fresh zero-initialised adapters when ``lora``
    (a ``LoraSettings``) is given (a LoRA run's step 0, its base). Returns (model, tokenizer)."""
    from masktrl.models.lora import apply_lora, load_adapter_state_dict, read_adapter

    if not is_adapter_folder(path):
        model, tokenizer = load_model_and_tokenizer(path, dtype)
        if lora is not None:
            apply_lora(model, lora, seed=seed)
        return model, tokenizer
    try:
        settings, base, weights = read_adapter(path)
    except ValueError as exc:
        raise MasktrlError(str(exc)) from None
    model, _ = load_model_and_tokenizer(base, dtype)
    apply_lora(model, settings, seed=seed, base=base)
    try:
        load_adapter_state_dict(model, {k: v.to(DTYPES[dtype]) for k, v in weights.items()})
    except ValueError as exc:
        raise MasktrlError(f"{path}: {exc} (base {base})") from None
    return model, load_tokenizer(path)


def _load_adapted(path: str | Path, dtype: str):
    from masktrl.models.lora import apply_lora, load_adapter_state_dict, merge_and_unload, read_adapter

    try:
        settings, base, weights = read_adapter(path)
    except ValueError as exc:
        raise MasktrlError(str(exc)) from None
    model, _ = load_model_and_tokenizer(base, dtype)
    apply_lora(model, settings, seed=0)
    try:
        load_adapter_state_dict(model, {k: v.to(DTYPES[dtype]) for k, v in weights.items()})
    except ValueError as exc:
        raise MasktrlError(f"{path}: {exc} (base {base})") from None
    return merge_and_unload(model)


def load_tokenizer(path: str | Path):
    """The tokenizer of a model folder or a cached hub id (never downloads); pad = EOS if unset."""
    from transformers import AutoTokenizer

    quiet_transformers()
    local = Path(path)
    if not local.exists() and str(path).startswith(("/", "./", "../", "~")):
        raise MasktrlError(f"no such model folder: {path}")
    if (
        local.exists()
        and not (local / "config.json").is_file()
        and not (local / "tokenizer_config.json").is_file()
        and not is_adapter_folder(local)
    ):
        raise MasktrlError(f"{local}: not a model folder (no config.json)")
    with _load_errors(path, "model"):
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=hub_offline())
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_config(path: str | Path):
    """The transformers config of a model folder or a cached hub id, without the weights (never
    downloads): what the checks before a run read (context length, vocabulary)."""
    from transformers import AutoConfig

    quiet_transformers()
    if is_adapter_folder(path):  # a LoRA checkpoint: its base model's config
        from masktrl.models.lora import read_adapter

        try:
            return load_model_config(read_adapter(path)[1])
        except ValueError as exc:
            raise MasktrlError(str(exc)) from None
    with _load_errors(path, "model"):
        return AutoConfig.from_pretrained(str(path), local_files_only=hub_offline())


@contextlib.contextmanager
def _load_errors(path, what: str):
    """transformers' OSError/ValueError as one MasktrlError line."""
    try:
        yield
    except (OSError, ValueError) as exc:
        if hub_offline() and not Path(path).exists():
            raise MasktrlError(
                f"cannot load {what} {path}: not a local folder and not in the local hub cache "
                "(masktrl never downloads: pass a local folder, or fill the cache first)"
            ) from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MasktrlError(f"cannot load {what} {path}: {first}") from None


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
