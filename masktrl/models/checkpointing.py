"""Gradient (activation) checkpointing that keeps the shared-prompt forward.

``train.gradient_checkpointing`` turns on transformers' per-layer checkpointing: each decoder
layer's activations are recomputed in the backward pass instead of stored. transformers then
drops the KV cache inside checkpointed layers (a layer that *writes* the cache would write it
twice, once more in the backward replay), and the shared-prompt forward
(``shared_prompt_hidden``: each distinct prompt run once, its cache reused by the group's
responses) needs that cache. It is kept by splitting the two passes:

* the **prompt pass** writes the cache: it runs with checkpointing off for its duration
  (``prompt_pass``). Its activations are those of the distinct prompts only (U x W tokens, a
  group size times fewer than the responses').
* the **response pass** only *reads* the prompt's cache: the cache is made read-only
  (``read_only``: ``update`` returns prompt + new keys/values without storing them), so the
  backward replay of a layer reads exactly the states of its first run, and the layers are told
  they may keep it under checkpointing (``response_pass``: transformers'
  ``_can_checkpoint_with_cache``, meant for layers that only read the cache).

Checkpointing is non-reentrant (``use_reentrant=False``): the prompt's keys and values enter each
response layer through the cache, not as arguments, and only the non-reentrant variant sends
their gradients back into the prompt pass. ``tests/test_gradient_checkpointing.py`` checks the
gradients against the plain forward.

Where transformers lacks that hook (older versions) ``shared_prompt_supported`` is False and the
policy falls back to running each response with its prompt (and says so once).
"""

from __future__ import annotations

import contextlib
import types

import torch


def enable(model: torch.nn.Module) -> None:
    """Per-layer activation checkpointing on ``model`` (a transformers model), non-reentrant."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the newer name (transformers 5.x)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def is_enabled(lm: torch.nn.Module) -> bool:
    """Whether transformers' activation checkpointing is on for ``lm``."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # the first is the newer name
        if hasattr(type(lm), name):
            return bool(getattr(lm, name))
    return False


def _layers(base: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers transformers checkpoints (``GradientCheckpointingLayer`` with the flag on)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # older transformers: no such layer class, no shared-prompt checkpointing
        return []
    return [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing is True]


def shared_prompt_supported(base: torch.nn.Module) -> bool:
    """Whether the shared-prompt forward can run under ``base``'s checkpointing: its checkpointed
    layers honour ``_can_checkpoint_with_cache`` and its cache keeps per-layer tensors."""
    layers = _layers(base)
    if not layers or not hasattr(type(layers[0]), "_can_checkpoint_with_cache"):
        return False
    from masktrl.models.kvcache import new_cache

    return hasattr(new_cache(base.config), "layers")


@contextlib.contextmanager
def prompt_pass(base: torch.nn.Module):
    """Checkpointing off while the prompt pass fills the cache (no-op when it is off)."""
    layers = _layers(base)
    for m in layers:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in layers:
            m.gradient_checkpointing = True


@contextlib.contextmanager
def response_pass(base: torch.nn.Module):
    """Checkpointed layers keep the (read-only) cache for the response pass."""
    layers = _layers(base)
    for m in layers:
        m._can_checkpoint_with_cache = True  # instance attribute over the class default
    try:
        yield
    finally:
        for m in layers:
            del m._can_checkpoint_with_cache


def read_only(cache):
    """Make a filled ``DynamicCache`` read-only: each layer's ``update`` returns its keys/values
    with the new ones appended, and stores nothing (the same tensors ``DynamicLayer.update``
    returns, so the forward is unchanged; the replay in the backward pass sees the same cache)."""
    for layer in cache.layers:
        layer.update = types.MethodType(_append_without_storing, layer)
    return cache


def _append_without_storing(self, key_states, value_states, *args, **kwargs):
    return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)
