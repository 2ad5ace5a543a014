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

FP8 training (``train.quantization``; docs/MODELS.md, "FP8 training"): ``quantize_training``
makes the trainer's own forward use the same quantised values, with straight-through gradients
into the float32 master weights. Every quantised module gets a forward pre-hook that puts
``fp8_ste(W)`` in place of its parameter ``W`` for the duration of its forward (the forward hook
puts ``W`` back), so the optimizer, the checkpoints and the engine's copy only ever see ``W``.
``fp8_ste`` is ``fp8_roundtrip`` in the forward and the identity in the backward: the gradient
reaching ``W`` is the float32 gradient of the loss evaluated at the quantised point
``W_hat = fp8_roundtrip(W)`` (the straight-through estimator of FP8 training recipes:
Megatron-LM/Transformer Engine keep float32 master weights the same way). The same layers as
the engine's scheme (``quantized_weights``, LoRA adapters included, as the engine's copy has
them), the same
per-token activation round trip for ``fp8-act`` / ``fp8-full`` (straight-through too). The
policy forward computes its logits from the output layer's weight directly, so
``quantized_head`` is how it sees ``fp8-full``'s quantised output layer.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from masktrl.errors import ConfigError

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


class _FP8StraightThrough(torch.autograd.Function):
    """Forward: ``fp8_roundtrip(x)`` (in x's dtype); backward: the incoming gradient unchanged."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return fp8_roundtrip(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


def fp8_ste(x: Tensor) -> Tensor:
    """``fp8_roundtrip(x)`` whose gradient with respect to ``x`` is the identity (straight-through):
    d loss(fp8_ste(x)) / dx = loss'(fp8_roundtrip(x))."""
    return _FP8StraightThrough.apply(x)


TRAIN_HOOKS = (
    "_masktrl_fp8_train"  # module attribute: (hook ids, parameter names, activations too) of quantize_training
)


def _train_pre_hook(module, args):
    """The trainer's forward of a quantised module: its parameters replaced by their straight-through
    FP8 round trip (and its input too for fp8-act / fp8-full) until ``_train_post_hook``."""
    _, names, act = getattr(module, TRAIN_HOOKS)
    saved = {}
    for name in names:
        saved[name] = module._parameters[name]
        module._parameters[name] = fp8_ste(saved[name])  # a non-leaf tensor: its gradient flows to the parameter
    module.__dict__["_masktrl_fp8_saved"] = saved
    if act and args and isinstance(args[0], Tensor):
        return (fp8_ste(args[0]), *args[1:])
    return None


def _train_post_hook(module, args, output):
    """Put the float32 master parameters back after the quantised forward."""
    module._parameters.update(module.__dict__.pop("_masktrl_fp8_saved", {}))


def quantize_training(model: torch.nn.Module, quantization: str) -> list[str]:
    """Make ``model``'s own forward FP8 (``train.quantization``, see the module doc): the
    parameters ``quantized_weights`` names (the engine's copy's, LoRA adapters included) enter every forward as
    ``fp8_ste`` of themselves; returns their names. The output layer under ``fp8-full`` is
    quantised by the hook when the module is called (generation) and by ``quantized_head`` in the
    policy forward, which reads its weight directly."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    names = quantized_weights(model, output_layer=quantization == "fp8-full")
    modules = dict(model.named_modules())
    by_module: dict[str, list[str]] = {}
    for name in names:
        mod_name, _, param = name.rpartition(".")
        by_module.setdefault(mod_name, []).append(param)
    for mod_name, params in by_module.items():
        module = modules[mod_name]
        pre = module.register_forward_pre_hook(_train_pre_hook)
        post = module.register_forward_hook(_train_post_hook)
        setattr(module, TRAIN_HOOKS, ((pre.id, post.id), tuple(params), quantization in ACT_QUANTIZED))
    return names


def strip_training_quantization(model: torch.nn.Module) -> None:
    """Remove ``quantize_training``'s hooks from ``model`` (a deep copy of a trained model keeps them)."""
    for module in model.modules():
        entry = module.__dict__.pop(TRAIN_HOOKS, None)
        if entry is not None:
            pre, post = entry[0]
            module._forward_pre_hooks.pop(pre, None)
            module._forward_hooks.pop(post, None)


def training_quantization(model: torch.nn.Module) -> bool:
    """Whether ``quantize_training`` made ``model``'s forward FP8."""
    return any(TRAIN_HOOKS in m.__dict__ for m in model.modules())


def quantized_head(lm: torch.nn.Module, hidden: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(hidden, weight) of the output layer as the trainer's forward uses them: their
    straight-through FP8 round trips when ``quantize_training`` quantised the output layer
    (``fp8-full``: weight per output channel, the hidden state per token), else unchanged."""
    entry = lm.get_output_embeddings().__dict__.get(TRAIN_HOOKS)
    if entry is None:
        return hidden, weight
    return (fp8_ste(hidden) if entry[2] else hidden), fp8_ste(weight)


class LowPrecisionCopy:
    """A copy of ``model`` whose parameters are in ``dtype`` (buffers such as the rotary
    frequencies keep theirs, as a model loaded in that dtype has them) and, with
    ``quantization``, FP8 fake-quantised. ``refresh(model)`` re-makes it from new weights."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, quantization: str | None = None):
        if quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
        self.dtype, self.quantization = dtype, quantization
        self.model = copy.deepcopy(model)
        strip_training_quantization(self.model)  # the engine quantises its copy itself, from the master weights
        self.model.requires_grad_(False)
        self.quantized = (
            set(quantized_weights(self.model, output_layer=quantization == "fp8-full")) if quantization else set()
        )
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
            if (
                p.dtype != self.dtype or p.device != value.device or p.shape != value.shape
            ):  # shape: a copy made from ZeRO-3 shards
                p.data = value.to(p.device)
            else:
                p.copy_(value)
        self.model.eval()


def torchao_unavailable() -> str | None:
    """Why torchao's float8 training cannot run here (None: it can): it needs torchao installed and
    a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer)."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "torchao is not installed (pip install torchao)"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    if torch.cuda.get_device_capability() < (8, 9):
        return f"the GPU ({torch.cuda.get_device_name()}) has no FP8 tensor cores (compute capability 8.9 or newer)"
    return None


def training_backend(quantization: str, backend: str) -> str:
    """The kernels ``train.quantization`` runs with: ``fake`` or ``torchao`` (``auto``: torchao
    where it can run, see ``torchao_unavailable``). ConfigError, with the reason, for ``torchao``
    where it cannot run or for a scheme it does not cover (fp8-full: the policy forward computes
    the output layer itself)."""
    if backend == "fake" or (backend == "auto" and (torchao_unavailable() or quantization == "fp8-full")):
        return "fake"
    why = torchao_unavailable() or (
        "torchao's float8 training does not cover fp8-full's output layer (use fake)"
        if quantization == "fp8-full"
        else None
    )
    if why:
        raise ConfigError(f"train.quantization_backend=torchao: {why}")
    return "torchao"


def apply_training_quantization(model: torch.nn.Module, quantization: str | None, backend: str = "auto") -> str | None:
    """``train.quantization`` on the trainer's ``model`` (after LoRA, before the optimizer sees it):
    ``quantize_training`` (the fake path) or torchao's ``convert_to_float8_training`` on the
    linear layers the scheme names (not routers, not the output layer). Returns
    the backend used (None: no quantisation). ConfigError for what cannot run (the MoE experts
    under torchao: they are not linear layers)."""
    if quantization is None:
        return None
    kind = training_backend(quantization, backend)
    if kind == "fake":
        quantize_training(model, quantization)
        return kind
    names = set(quantized_weights(model, output_layer=False))
    if any(not n.endswith(".weight") for n in names):  # 3-D expert tensors
        raise ConfigError(
            "train.quantization_backend=torchao: torchao's float8 training covers linear layers, not "
            "a MoE "
            "block's fused experts (use fake)"
        )
    from torchao.float8 import convert_to_float8_training

    chosen = {n.rsplit(".", 1)[0] for n in names}
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn in chosen)
    return kind
