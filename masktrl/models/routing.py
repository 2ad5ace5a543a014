"""MoE routing decisions of a model and how often two copies of it route a token differently
(the rollout engine's low-precision copy against the trainer: ``mismatch/routing_flip_rate``).

A token's routing in one MoE layer is the set of its top-k experts. ``expert_choices`` records
it in every MoE layer of a forward pass (a forward hook on each router: a module named ``gate``
or ``router`` whose weight has one row per expert, as transformers' Qwen3-MoE
``Qwen3MoeTopKRouter`` and Mixtral-style linear routers); ``routing_flip_rate`` is the fraction
of (token, MoE layer) pairs whose expert *sets* differ (the order within the top-k does not count).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor

ROUTER_NAMES = ("gate", "router")


def moe_routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, int]]:
    """(name, router module, top_k) of every MoE layer of ``model`` (empty for a dense model)."""
    config = getattr(model, "config", None)
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not num_experts or not top_k:
        return []
    found = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if name.rsplit(".", 1)[-1] in ROUTER_NAMES and isinstance(weight, Tensor) and weight.dim() == 2 and weight.shape[0] == num_experts:
            found.append((name, module, int(getattr(module, "top_k", top_k))))
    return found


def _selected(output, k: int) -> Tensor:
    """[T, k] expert ids a router chose: the third output of a (logits, weights, indices) router,
    else the top-k of the logits it returns."""
    if isinstance(output, tuple) and len(output) == 3 and not output[2].is_floating_point():
        return output[2]
    logits = output[0] if isinstance(output, tuple) else output
    return logits.topk(k, dim=-1).indices


@contextmanager
def expert_choices(model: torch.nn.Module):
    """Record, during the forward passes inside the block, every MoE layer's top-k expert ids per
    token: yields a list that receives one [T, k] tensor per router call (layers in order)."""
    routers = moe_routers(model)
    calls: list[Tensor] = []
    hooks = [module.register_forward_hook(lambda _m, _i, out, k=k: calls.append(_selected(out, k).reshape(-1, k)))
             for _, module, k in routers]
    try:
        yield calls
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def routing(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """[L, B, S, k] top-k expert ids of every token of ``input_ids`` [B, S] in each of the model's
    L MoE layers (one forward pass)."""
    b, s = input_ids.shape
    with expert_choices(model) as calls:
        model(input_ids=input_ids, attention_mask=attention_mask)
    if not calls:
        raise ValueError("the model has no MoE layers: routing flips are defined for MoE models only")
    return torch.stack([c.reshape(b, s, -1) for c in calls])


def routing_flip_rate(a: Tensor, b: Tensor, mask: Tensor | None = None) -> float:
    """Fraction of tokens (rows of ``a`` and ``b`` [..., k], expert ids) whose top-k expert sets
    differ, over the positions where ``mask`` [...] is true (all when None); NaN for none."""
    if a.shape != b.shape:
        raise ValueError(f"routing tensors must have the same shape, got {list(a.shape)} and {list(b.shape)}")
    differ = (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)  # [...]
    if mask is not None:
        differ = differ[mask.expand_as(differ)]
    return differ.float().mean().item() if differ.numel() else float("nan")
