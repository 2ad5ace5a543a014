"""Low-precision copies of a policy: what a rollout engine samples from while training stays in
float32 (``rollout.dtype``, ``rollout.quantization``; docs/ROLLOUTS.md, "Low-precision rollouts").

A real engine never samples from the trainer's float32 weights: vLLM holds its own copy in
bfloat16 (or float16), possibly quantised to FP8. ``LowPrecisionCopy`` builds that copy of a
transformers causal LM and re-makes it from the trainer's weights at every sync, so the
behaviour policy mu differs from pi_old by exactly the rounding a real engine adds.

FP8 (``fp8_roundtrip``) is a fake quantisation: every weight of a linear layer is scaled,
rounded to ``torch.float8_e4m3fn`` and multiplied back (quantise -> dequantise) in the copy's
compute dtype, so the copy computes with the values an FP8 kernel would use. Scales: one per
output channel, ``amax(|W_row|) / 448`` (448 is e4m3's largest finite value); a row of zeros
gets scale 1 (it stays zero). Which weights: as vLLM's ``Fp8Config.get_quant_method``
(``vllm/model_executor/layers/quantization/fp8.py``) chooses them -- the attention and MLP
projections and the MoE experts; never the embeddings, the output layer (``lm_head``), the
norms or a MoE router (vLLM builds ``Qwen3MoeSparseMoeBlock.gate`` with ``quant_config=None``).
``fp8-act`` also quantises the input of every quantised linear layer, one scale per token (as
vLLM's W8A8 path does on GPUs with FP8 support, ``use_per_token_if_dynamic``). ``fp8-full``
quantises the output layer too, weights and input: an "FP8 end-to-end"-like engine, the
strongest mismatch (no vLLM option does this; on a tiny model the output layer dominates the
error). In a MoE block the activation quantisation applies to the experts' input; the
activation between an expert's two projections stays in the compute dtype.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
QUANTIZATIONS = ("fp8", "fp8-act", "fp8-full")
ACT_QUANTIZED = ("fp8-act", "fp8-full")  # ... also quantise the inputs of the quantised layers
ROUTER_NAMES = ("gate", "router")  # a MoE router's module name (a dense MLP's is gate_proj): kept at full precision


def fp8_scale(x: Tensor) -> Tensor:
    """[..., 1] float32 scale per row of ``x`` [..., C] (the last dim is reduced): amax / 448, 1 for an all-zero row."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()  # [..., 1]
    scale = amax / E4M3_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def fp8_roundtrip(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``x`` [..., C] quantised to e4m3 with one scale per row (``fp8_scale``) and dequantised to
    ``dtype`` (default: ``x``'s): ``fl_dtype(e4m3(clamp(x / s, +-448)) * s)``, computed in float32.
    Values beyond the row's amax cannot occur; the clamp only absorbs the last bit of x / s.
    NaN stays NaN. Per output channel for a linear weight [out, in] (and [E, out, in] experts);
    per token for activations [..., in]."""
    scale = fp8_scale(x)
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(dtype or x.dtype)


def quantized_weights(model: torch.nn.Module, *, output_layer: bool = False) -> list[str]:
    """Names of the parameters an FP8 engine quantises: the weights of the linear layers (other
    than MoE routers and, unless ``output_layer``, the output layer) and the 3-D expert weights
    of a MoE block."""
    out_layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = []
    for mod_name, module in model.named_modules():
        if module is out_layer and not output_layer:
            continue
        last = mod_name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear):
            if last not in ROUTER_NAMES:
                names.append(f"{mod_name}.weight" if mod_name else "weight")
        elif last == "experts":  # transformers' fused experts: [E, out, in] parameters
            names.extend(f"{mod_name}.{p}" for p, t in module.named_parameters(recurse=False) if t.dim() == 3)
    return names


def _fp8_input_hook(module, args):
    """Forward pre-hook: the layer's input quantised per token (fp8-act)."""
    x, *rest = args
    return (fp8_roundtrip(x), *rest)


class LowPrecisionCopy:
    """A copy of ``model`` whose parameters are in ``dtype`` (buffers such as the rotary
    frequencies keep theirs, as a model loaded in that dtype has them) and, with
    ``quantization``, FP8 fake-quantised. ``refresh(model)`` re-makes it from new weights."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, quantization: str | None = None):
        if quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
        self.dtype, self.quantization = dtype, quantization
        self.model = copy.deepcopy(model)
        self.model.requires_grad_(False)
        self.quantized = set(quantized_weights(self.model, output_layer=quantization == "fp8-full")) if quantization else set()
        self._hooks = []
        if quantization in ACT_QUANTIZED:
            targets = {n.rsplit(".", 1)[0] for n in self.quantized}
            for name, module in self.model.named_modules():
                if name in targets:
                    self._hooks.append(module.register_forward_pre_hook(_fp8_input_hook))
        self.refresh(model)

    @torch.no_grad()
    def refresh(self, model: torch.nn.Module) -> None:
        """Copy ``model``'s current parameters into the copy: cast to its dtype, FP8 round trip
        for the quantised weights (from the source values, never from a rounded copy)."""
        src = dict(model.named_parameters())
        for name, p in self.model.named_parameters():
            w = src[name].detach()
            value = fp8_roundtrip(w, self.dtype) if name in self.quantized else w.to(self.dtype)
            if p.dtype != self.dtype or p.device != value.device or p.shape != value.shape:  # shape: a copy made from ZeRO-3 shards
                p.data = value.to(p.device)
            else:
                p.copy_(value)
        self.model.eval()
