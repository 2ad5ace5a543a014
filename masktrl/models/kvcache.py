"""The KV-cache plumbing shared by generation (``rollout/hf.py``'s shared prefill) and the
training forward (``rl/policy.py``'s shared prompt): an empty cache, and the keyword
that hands it to a model, across transformers versions."""

from __future__ import annotations

import inspect

import torch


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword that hands a KV cache to ``model`` (forward and ``generate``): ``cache`` from
    transformers 5.x on, where ``past_key_values`` is deprecated; ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def new_cache(config):
    """An empty ``DynamicCache`` for a model with ``config``."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=config)
    except TypeError:  # transformers versions whose DynamicCache takes no config
        return DynamicCache()
