"""Mixture-of-experts routing: the experts a model picks for each token, and how often two copies
of a model route a token differently.

A low-precision rollout copy (bf16, FP8) of an MoE policy can pick other experts than the
trainer's copy for the same token, which moves the behaviour policy away from the trained one
by more than the precision of one expert's output would suggest. A token's routing in one MoE
layer is the set of its top-k experts (k = ``num_experts_per_tok``); two sets differ when any
expert is in one and not the other (the order within the top-k and the weights do not count).

Two ways to read it:

* from the routers' hooks (what training measures, ``mismatch/routing_flip_rate``):
  ``expert_choices`` records every MoE layer's choice during a forward pass (a forward hook on
  each router: a module named ``gate`` or ``router`` whose weight has one row per expert, as
  transformers' Qwen3-MoE ``Qwen3MoeTopKRouter`` and Mixtral-style linear routers); ``routing``
  stacks them; ``routing_flip_rate`` is the fraction of (token, MoE layer) pairs whose sets differ;
* from the routers' logits (``output_router_logits``): ``top_k_experts`` and
  ``compare_routing``, which compares two copies of a model directly (``RoutingFlips``: the
  rate, per layer and over any layer).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

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
        if (
            name.rsplit(".", 1)[-1] in ROUTER_NAMES
            and isinstance(weight, Tensor)
            and weight.dim() == 2
            and weight.shape[0] == num_experts
        ):
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
    hooks = [
        module.register_forward_hook(lambda _m, _i, out, k=k: calls.append(_selected(out, k).reshape(-1, k)))
        for _, module, k in routers
    ]
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


# --------------------------------------------------------------------------- from the routers' logits


@dataclass(frozen=True)
class RoutingFlips:
    rate: float  # fraction of (token, MoE layer) pairs whose top-k expert set differs
    any_layer: float  # fraction of tokens whose set differs in at least one MoE layer
    per_layer: list[float]  # the rate of each MoE layer, in layer order
    tokens: int  # tokens compared (attention-mask ones)


def top_k_experts(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    top_k: int | None = None,
) -> torch.Tensor:
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


def compare_routing(
    model_a: torch.nn.Module,
    model_b: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    top_k: int | None = None,
) -> RoutingFlips:
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


# --------------------------------------------------------------------------- routing replay (R3)

NO_ROUTING = "the engine cannot report its routing"


def replayed_weights(logits: Tensor, experts: Tensor, norm_topk_prob: bool) -> Tensor:
    """[T, k] gate weights of the replayed ``experts`` [T, k] from the router's own ``logits``
    [T, E]: softmax over all E experts (float32), taken at the replayed ids, renormalised over
    them when the router normalises its top-k (``norm_topk_prob``), in the logits' dtype. This is
    what transformers' Qwen3-MoE router computes for its own top-k, with the ids given instead of
    chosen; verl's and slime's replay do the same (``scores.gather(1, top_indices)``, docs/MODELS.md)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights = probs.gather(1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


@contextmanager
def replayed_routing(model: torch.nn.Module, experts: Tensor):
    """Inside the block, every MoE layer of ``model`` sends each token to the experts of
    ``experts`` [L, T, k] (layer l's [T, k] for the T tokens its router sees, in the forward's
    row-major [B, S] order) instead of its own top-k; the gate weights are recomputed from the
    router's logits over those experts (``replayed_weights``), so gradients reach the router and
    the experts as in an ordinary forward at that expert choice. Routers must return
    (logits, weights, indices), as transformers' Qwen3-MoE router does; ValueError otherwise."""
    routers = moe_routers(model)
    if len(routers) != experts.shape[0]:
        raise ValueError(f"the routing to replay has {experts.shape[0]} MoE layers, the model {len(routers)}")

    def replay(module, _inputs, output, layer: int):
        if not (isinstance(output, tuple) and len(output) == 3 and not output[2].is_floating_point()):
            raise ValueError(
                f"{type(module).__name__} does not return (logits, weights, indices): its routing cannot be replayed"
            )
        logits = output[0]
        ids = experts[layer].to(logits.device)
        if ids.shape != output[2].shape:
            raise ValueError(
                f"the routing to replay has shape {list(ids.shape)} for a router that sees {list(output[2].shape)}"
            )
        weights = replayed_weights(logits, ids, bool(getattr(module, "norm_topk_prob", False)))
        return logits, weights, ids.to(output[2].dtype)

    hooks = [
        module.register_forward_hook(lambda m, i, o, layer=layer: replay(m, i, o, layer))
        for layer, (_, module, _k) in enumerate(routers)
    ]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def routing_targets(records: list, width: int, layers: int, k: int) -> Tensor:
    """[L, B*width, k] the experts to replay for B right-padded rows of ``width`` positions:
    ``records[b]`` is row b's recorded routing, [positions][L*k] (``Generation.routing``: layer
    l's k experts at l*k..(l+1)*k); padding positions get experts 0..k-1 (their outputs are
    masked out of every real token)."""
    out = torch.arange(k).expand(len(records), width, layers, k).clone()  # [B, width, L, k]
    for b, rec in enumerate(records):
        if rec:
            out[b, : len(rec)] = torch.tensor(rec, dtype=torch.long).reshape(len(rec), layers, k)
    return out.permute(2, 0, 1, 3).reshape(layers, len(records) * width, k)


def routing_records(model: torch.nn.Module, rows: list[list[int]]) -> list[list[list[int]]]:
    """Each of ``rows`` (prompt + response ids) routed by ``model`` teacher-forced in one
    right-padded forward: per row, [positions][L*k] the top-k expert ids of each position at each
    MoE layer (``Generation.routing``)."""
    device = next(model.parameters()).device
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
    r = routing(model, ids, attention)  # [L, B, S, k]
    flat = r.permute(1, 2, 0, 3).reshape(len(rows), width, -1).tolist()  # [B, S, L*k]
    return [flat[b][: len(row)] for b, row in enumerate(rows)]
