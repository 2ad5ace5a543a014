"""Mixture-of-experts routing: how often two copies of a model route a token differently.

A low-precision rollout copy (bf16, FP8) of an MoE policy can pick other experts than the
trainer's copy for the same token, which moves the behaviour policy away from the trained one
by more than the precision of one expert's output would suggest. ``routing_flip_rate``
measures it from the routers' logits: for every token and MoE layer, the set of the top-k
experts (k = ``num_experts_per_tok``) under each copy, and whether the two sets differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingFlips:
    rate: float  # fraction of (token, MoE layer) pairs whose top-k expert set differs
    any_layer: float  # fraction of tokens whose set differs in at least one MoE layer
    per_layer: list[float]  # the rate of each MoE layer, in layer order
    tokens: int  # tokens compared (attention-mask ones)


def top_k_experts(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  top_k: int | None = None) -> torch.Tensor:
    """[layers, N, k] the sorted top-k expert ids of each of the N real tokens (mask 1, in
    row-major order) at each MoE layer of ``model``, from its routers' logits."""
    k = top_k or getattr(model.config, "num_experts_per_tok", None)
    if not k:
        raise ValueError(f"{type(model).__name__} is not a mixture-of-experts model (no num_experts_per_tok)")
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    finally:
        model.train(was_training)
    logits = getattr(out, "router_logits", None)
    if not logits:
        raise ValueError(f"{type(model).__name__} returned no router logits: not a mixture-of-experts model")
    keep = mask.reshape(-1).bool().cpu()  # [B*L]
    sets = []
    for layer in logits:  # [B*L, E] per MoE layer
        top = layer.float().cpu().topk(k, dim=-1).indices  # [B*L, k]
        sets.append(top.sort(dim=-1).values[keep])  # [N, k]
    return torch.stack(sets)  # [layers, N, k]


def routing_flip_rate(model_a: torch.nn.Module, model_b: torch.nn.Module, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None = None, *, top_k: int | None = None) -> RoutingFlips:
    """How often ``model_a`` and ``model_b`` (two copies of one MoE model, e.g. the trainer's
    float32/bf16 weights and a low-precision rollout copy; each on its own device and dtype)
    choose different top-k expert sets for the tokens of ``input_ids`` [B, L] (padding excluded
    with ``attention_mask``). Two sets differ when any expert is in one and not the other; the
    order of the k experts and their weights do not count."""
    a = top_k_experts(model_a, input_ids, attention_mask, top_k)  # [layers, N, k]
    b = top_k_experts(model_b, input_ids, attention_mask, top_k)
    if a.shape != b.shape:
        raise ValueError(f"the two models route differently shaped outputs: {list(a.shape)} vs {list(b.shape)}")
    differs = (a != b).any(dim=-1)  # [layers, N]
    n = differs.shape[1]
    if n == 0:
        return RoutingFlips(0.0, 0.0, [0.0] * differs.shape[0], 0)
    per_layer = differs.double().mean(dim=1)  # [layers]
    return RoutingFlips(
        rate=float(differs.double().mean()),
        any_layer=float(differs.any(dim=0).double().mean()),
        per_layer=[float(x) for x in per_layer],
        tokens=n,
    )
