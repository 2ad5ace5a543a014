"""The causal-LM architectures the built-in tiny model can take (``model.architecture``).

Each entry maps a name to the transformers config and model classes and the keyword arguments
that differ from the shared ones (``tiny.build_tiny_model`` passes vocabulary, sizes, special
tokens and untied embeddings to every architecture). All are built locally from their config,
with random weights: nothing is downloaded. ``qwen3`` is the default and builds exactly the
model masktrl always built (same config, same random draws).

Architecture-specific choices for the tiny shapes:

* ``qwen3-moe``: 8 experts, top-2 routing (``model.num_experts``, ``model.experts_per_token``),
  every layer sparse, expert width ``intermediate_size // 4``.
* ``mistral``, ``gemma2``, ``gemma3``: a sliding window of ``SLIDING_WINDOW`` tokens (shorter than
  the tiny runs' prompt + response), so the window really acts; their KV caches keep sliding
  layers, which the shared-prompt forward does not handle (``shared_prompt_cache_ok``): the
  policy runs every response with its prompt for them.
* ``gemma2``/``gemma3``: no final-logit soft-capping (``final_logit_softcapping=None``): the
  chunked log-probabilities are those of the plain linear head, and a checkpoint that soft-caps
  is refused (``check_lm_head``).
* ``gpt-neox``: rotary on a quarter of each head (its default ``partial_rotary_factor``),
  parallel residual; its linear layers have their own names (``query_key_value``, ``dense``,
  ``dense_h_to_4h``, ``dense_4h_to_h``), which LoRA's ``all-linear`` covers.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from masktrl.errors import MasktrlError

SLIDING_WINDOW = 8  # tokens; the tiny prompts + responses are longer, so the window is exercised


@dataclass(frozen=True)
class Architecture:
    config_class: str  # a transformers class name, imported when the model is built
    model_class: str
    extra: Callable[[object], dict] = field(default=lambda cfg: {})  # TinyModelConfig -> config kwargs
    head_dim: bool = True  # whether the config takes ``head_dim``


def _gqa(cfg) -> dict:
    return {"num_key_value_heads": cfg.num_kv_heads}


def _gemma(cfg) -> dict:
    head = cfg.hidden_size // cfg.num_heads
    return {
        **_gqa(cfg),
        "query_pre_attn_scalar": head,
        "sliding_window": SLIDING_WINDOW,
        "final_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
    }


ARCHITECTURES: dict[str, Architecture] = {
    "qwen3": Architecture("Qwen3Config", "Qwen3ForCausalLM", _gqa),
    "llama": Architecture("LlamaConfig", "LlamaForCausalLM", _gqa),
    "qwen2": Architecture("Qwen2Config", "Qwen2ForCausalLM", _gqa, head_dim=False),
    "qwen3-moe": Architecture(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        lambda cfg: {
            **_gqa(cfg),
            "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.experts_per_token,
            "moe_intermediate_size": max(1, cfg.intermediate_size // 4),
            "norm_topk_prob": True,
        },
    ),
    "mistral": Architecture(
        "MistralConfig", "MistralForCausalLM", lambda cfg: {**_gqa(cfg), "sliding_window": SLIDING_WINDOW}
    ),
    "gemma2": Architecture(
        "Gemma2Config", "Gemma2ForCausalLM", lambda cfg: {**_gemma(cfg), "attn_logit_softcapping": 50.0}
    ),
    "gemma3": Architecture(
        "Gemma3TextConfig", "Gemma3ForCausalLM", lambda cfg: {**_gemma(cfg), "attn_logit_softcapping": None}
    ),
    "phi3": Architecture("Phi3Config", "Phi3ForCausalLM", _gqa, head_dim=False),
    "olmo2": Architecture("Olmo2Config", "Olmo2ForCausalLM", _gqa, head_dim=False),
    "gpt-neox": Architecture("GPTNeoXConfig", "GPTNeoXForCausalLM", lambda cfg: {}, head_dim=False),
}
DEFAULT_ARCHITECTURE = "qwen3"


def get_architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise MasktrlError(f"unknown model.architecture {name!r}; choose one of: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def model_classes(arch: Architecture):
    import transformers

    return getattr(transformers, arch.config_class), getattr(transformers, arch.model_class)


_SHARE_CHECKED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[bool, str]] = weakref.WeakKeyDictionary()


def shared_prompt_cache_ok(base: torch.nn.Module) -> tuple[bool, str]:
    """``_shared_prompt_cache_ok``, computed once per model (the policy asks at every forward)."""
    if base not in _SHARE_CHECKED:
        _SHARE_CHECKED[base] = _shared_prompt_cache_ok(base)
    return _SHARE_CHECKED[base]


def _shared_prompt_cache_ok(base: torch.nn.Module) -> tuple[bool, str]:
    """Whether the shared-prompt forward (``rl/policy.py``: each distinct prompt run once,
    its KV cache continued by every response of its group) is exact for ``base`` (a decoder,
    ``lm.base_model``), and if not, why.

    It needs a cache whose layers keep every key and value (transformers' ``DynamicLayer``): a
    sliding-window layer keeps only the last tokens and masks by absolute position, which the
    gathered, right-padded prompt cache does not match. The reason is one line for the log.
    """
    from transformers.cache_utils import DynamicLayer

    from masktrl.models.kvcache import new_cache

    cache = new_cache(base.config)
    layers = getattr(cache, "layers", None)
    if layers is None:
        return False, "its KV cache class keeps no per-layer tensors"
    other = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if other:
        return False, f"its KV cache has {', '.join(other)} layers (sliding-window attention)"
    if getattr(base.config, "sliding_window", None) and getattr(base.config, "use_sliding_window", True):
        return False, f"it uses sliding-window attention (window {base.config.sliding_window})"
    return True, ""


@torch.no_grad()
def check_lm_head(model: torch.nn.Module) -> None:
    """MasktrlError unless the model's logits are ``hidden @ lm_head.weight^T`` (what the chunked
    log-probabilities compute from the final hidden state): soft-capped, scaled or biased heads
    would make every log pi silently wrong. Checked on one short input against the model's own
    forward."""
    cfg = model.config
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        value = getattr(cfg, key, None)
        if value not in (None, 1, 1.0):
            raise MasktrlError(
                f"{type(model).__name__}: {key}={value} is not supported (masktrl's "
                "log-probabilities use the plain linear head)"
            )
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise MasktrlError(f"{type(model).__name__}: an output layer with a bias is not supported")
    device = head.weight.device
    ids = torch.arange(min(4, head.weight.shape[0]), device=device)[None]  # [1, 4]
    was_training = model.training
    model.eval()
    try:
        hidden = model.base_model(input_ids=ids).last_hidden_state  # [1, 4, H]
        logits = model(input_ids=ids).logits  # [1, 4, V]
    finally:
        model.train(was_training)
    mine = hidden.float() @ head.weight.float().t()
    tol = 1e-3 if head.weight.dtype == torch.float32 else 5e-2
    err = (mine - logits.float()).abs().max().item()
    if not err <= tol * max(1.0, logits.float().abs().max().item()):
        raise MasktrlError(
            f"{type(model).__name__}: its logits are not the linear head of its last hidden state "
            f"(max difference {err:.3g}); not supported"
        )
