"""LoRA adapters on the policy through ``peft`` (``model.lora``; the optional extra
``pip install 'masktrl[lora]'``).

``apply_lora`` injects the adapters *in place* (``peft.inject_adapter_in_model``): the model
stays the transformers causal LM every other part of masktrl handles (the shared-prompt
forward, gradient checkpointing, the chunked log-probabilities, DDP/DeepSpeed wrapping), only
its targeted linear layers gain ``lora_A``/``lora_B`` and compute

    y = W x + (alpha / r) B A dropout(x)

and only the adapter matrices train (every other parameter has ``requires_grad=False``). B
starts at zero (peft's default initialisation; A is drawn from the run's seed in a forked RNG,
so the caller's random streams are untouched), so before the first update the model is the
base model bit for bit: the adapter path adds exact zeros.

* ``reference_policy(model)``: the base model, i.e. the same module with every adapter off, for
  the reference-KL term (no second copy of the weights).
* ``adapter_state_dict`` / ``load_adapter_state_dict``: the adapter weights only, what a
  checkpoint keeps.
* ``merged_state_dict``: the base weights with each adapter merged (W + (alpha/r) B A), under
  the base model's own key names: what an engine with its own copy of the weights (vLLM) loads.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch

from masktrl.errors import MasktrlError

ADAPTER = "default"  # peft's adapter name; masktrl uses one adapter
ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer except the output head


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = ALL_LINEAR  # module names (suffixes) or "all-linear"

    @classmethod
    def from_config(cls, lora) -> LoraSettings:
        """From ``model.lora`` (``config.LoraConfig``)."""
        return cls(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=tuple(lora.target_modules))

    def check(self) -> None:
        """MasktrlError naming the key for a value peft would reject or misuse."""
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0:
            raise MasktrlError(f"model.lora.rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise MasktrlError(f"model.lora.alpha must be > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise MasktrlError(f"model.lora.dropout must be in [0, 1), got {self.dropout!r}")
        targets = self.target_modules
        if isinstance(targets, str):
            targets = (targets,)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise MasktrlError(
                f"model.lora.target_modules must be module names or {ALL_LINEAR!r}, got {self.target_modules!r}"
            )


def import_peft():
    try:
        import peft
    except ImportError:
        raise MasktrlError("model.lora needs the peft package: pip install 'masktrl[lora]'") from None
    return peft


def _linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the model's ``nn.Linear`` layers other than the output head
    (what ``target_modules`` matches)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name and m is not head
        }
    )


def resolve_targets(model: torch.nn.Module, settings: LoraSettings) -> list[str]:
    """The module names the adapters go on: ``all-linear`` is every ``nn.Linear`` but the output
    head (attention and dense MLP projections; a mixture-of-experts model's fused expert
    tensors and routers are not ``nn.Linear`` and stay frozen). MasktrlError when a listed
    name matches no linear layer (peft would skip it silently as long as another one matches)."""
    t = settings.target_modules
    if isinstance(t, (tuple, list)) and tuple(t) == (ALL_LINEAR,):
        t = ALL_LINEAR
    names = _linear_names(model)
    if t == ALL_LINEAR:
        if not names:
            raise MasktrlError(
                f"model.lora.target_modules {ALL_LINEAR!r}: {type(model).__name__} has no linear layer besides its head"
            )
        return names
    wanted = [t] if isinstance(t, str) else list(t)
    missing = [x for x in wanted if x not in names]
    if missing:
        raise MasktrlError(
            f"model.lora.target_modules {missing} match no linear layer of "
            f"{type(model).__name__}; "
            f"its linear layers: {', '.join(names)} (or {ALL_LINEAR!r})"
        )
    return wanted


def apply_lora(model: torch.nn.Module, settings: LoraSettings, seed: int, base: str | None = None) -> torch.nn.Module:
    """Inject LoRA adapters into ``model`` in place (and return it); freeze everything else.
    ``base``: where the base weights are (what an adapter checkpoint names,
    ``save_adapter``); remembered on the model with the settings as ``model.masktrl_lora``."""
    settings.check()
    peft = import_peft()
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=resolve_targets(model, settings),
        bias="none",
        init_lora_weights=True,  # B = 0: the adapted model starts as the base model
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
        except ValueError as exc:  # peft's NoMatchingPeftModuleError is a ValueError
            raise MasktrlError(f"model.lora: {str(exc).splitlines()[0]}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    model.masktrl_lora = (settings, base)
    return model


def lora_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every peft LoRA layer in ``model`` (empty without adapters). A process
    that has not imported peft's LoRA module holds no LoRA layer, and is spared importing it."""
    LoraLayer = getattr(sys.modules.get("peft.tuners.lora"), "LoraLayer", None)
    if LoraLayer is None:
        return []
    inner = getattr(model, "module", model)  # DDP / DeepSpeed wrappers
    return [(n, m) for n, m in inner.named_modules() if isinstance(m, LoraLayer)]


def has_lora(model: torch.nn.Module) -> bool:
    return bool(lora_layers(model))


@contextlib.contextmanager
def reference_policy(model: torch.nn.Module):
    """Inside the block ``model`` is its base model (every adapter off): the reference policy of
    a LoRA run, with no second copy of the weights. Which parameters require gradients is
    restored on exit (peft's switch changes it). ValueError for a model without adapters (its
    reference policy needs a frozen copy instead)."""
    layers = [m for _, m in lora_layers(model)]
    if not layers:
        raise ValueError("reference_policy needs a model with LoRA adapters")
    grads = {p: p.requires_grad for m in layers for p in m.parameters()}
    was_disabled = [m.disable_adapters for m in layers]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m, off in zip(layers, was_disabled):
            m.enable_adapters(not off)
        for p, flag in grads.items():
            p.requires_grad_(flag)


def adapter_state_dict(model: torch.nn.Module, state: dict | None = None) -> dict[str, torch.Tensor]:
    """The adapter weights only (``lora_A``/``lora_B``), under ``model``'s key names; from
    ``state`` (a full state dict of the adapted model, e.g. gathered from shards) if given."""
    state = state if state is not None else getattr(model, "module", model).state_dict()
    return {k: v for k, v in state.items() if ".lora_" in k}


def load_adapter_state_dict(model: torch.nn.Module, adapters: dict[str, torch.Tensor]) -> None:
    """Copy saved adapter weights into ``model``'s adapters; ValueError when the keys differ."""
    inner = getattr(model, "module", model)
    own = adapter_state_dict(inner)
    if set(own) != set(adapters):
        extra, missing = sorted(set(adapters) - set(own)), sorted(set(own) - set(adapters))
        raise ValueError(f"the adapter weights do not fit the model: missing {missing[:3]}, unexpected {extra[:3]}")
    inner.load_state_dict(adapters, strict=False)


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module, state: dict | None = None) -> dict[str, torch.Tensor]:
    """The base model's state dict (its own key names, no ``lora_`` entries) with every adapter
    merged into its layer's weight: W + (alpha / r) B A, computed in float32 and stored in W's
    dtype. ``state``: the adapted model's full state dict to merge from (default: ``model``'s).
    A model without adapters gets its state dict back unchanged."""
    inner = getattr(model, "module", model)
    state = state if state is not None else inner.state_dict()
    layers = dict(lora_layers(inner))
    if not layers:
        return dict(state)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        prefix, sep, leaf = key.rpartition(".base_layer.")
        if not sep:
            out[key] = value
            continue
        if leaf == "weight" and prefix in layers:
            layer = layers[prefix]
            a = state[f"{prefix}.lora_A.{ADAPTER}.weight"].float()  # [r, in]
            b = state[f"{prefix}.lora_B.{ADAPTER}.weight"].float()  # [out, r]
            delta = (b @ a) * layer.scaling[ADAPTER]  # [out, in]
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.t()
            value = (value.float() + delta.to(value.device)).to(value.dtype)
        out[f"{prefix}.{leaf}"] = value
    return out


@torch.no_grad()
def merge_and_unload(model: torch.nn.Module) -> torch.nn.Module:
    """Merge every adapter into its layer and put the plain layers back (in place; returned):
    a model without peft modules whose outputs are the adapted model's, every parameter
    trainable again."""
    merged = merged_state_dict(model)
    for name, layer in lora_layers(model):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer.get_base_layer())
    model.load_state_dict(merged)
    for p in model.parameters():
        p.requires_grad_(True)
    model.__dict__.pop("masktrl_lora", None)
    return model


# ------------------------------------------------------------------ adapter checkpoints
# An adapter checkpoint holds the adapters only, in peft's own layout (``PeftModel.from_pretrained``
# reads it): adapter_model.safetensors (keys ``base_model.model.<module>.lora_A.weight``) and
# adapter_config.json, whose ``base_model_name_or_path`` names the base weights: a hub id, an
# absolute folder, or a folder relative to the checkpoint itself.

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


def is_adapter_folder(path) -> bool:
    from pathlib import Path

    p = Path(path)
    return (p / ADAPTER_CONFIG).is_file() and not (p / "config.json").is_file()


def save_adapter(
    dest,
    model: torch.nn.Module,
    settings: LoraSettings | None = None,
    base: str | None = None,
    state: dict | None = None,
) -> None:
    """Write ``model``'s adapter weights (from ``state`` if given) and their config into ``dest``;
    ``settings`` and ``base`` default to those ``apply_lora`` remembered."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    inner = getattr(model, "module", model)
    remembered = getattr(inner, "masktrl_lora", (None, None))
    settings = settings or remembered[0]
    base = base if base is not None else remembered[1]
    if settings is None or base is None:
        raise ValueError("save_adapter needs the LoRA settings and the base model's location")
    adapters = adapter_state_dict(inner, state)
    tensors = {
        _PEFT_PREFIX + k.replace(f".{ADAPTER}.", "."): v.detach().contiguous().cpu() for k, v in adapters.items()
    }
    save_file(tensors, str(Path(dest) / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    targets = sorted({name.rsplit(".", 1)[-1] for name, _ in lora_layers(inner)})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    (Path(dest) / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def read_adapter(path) -> tuple[LoraSettings, str, dict[str, torch.Tensor]]:
    """(settings, the base model's location, the adapter weights under masktrl's key names) of
    an adapter checkpoint; a relative base is resolved against the checkpoint folder. ValueError
    for an unreadable one."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    path = Path(path)
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
        tensors = load_file(str(path / ADAPTER_WEIGHTS))
        settings = LoraSettings(
            rank=int(config["r"]),
            alpha=float(config["lora_alpha"]),
            dropout=float(config.get("lora_dropout", 0.0)),
            target_modules=tuple(config["target_modules"]),
        )
        base = str(config["base_model_name_or_path"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path}: unreadable adapter checkpoint ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        ) from None
    if not Path(base).is_absolute() and (path / base).exists():
        base = str((path / base).resolve())
    weights = {}
    for key, value in tensors.items():
        name = key.removeprefix(_PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            name = name.replace(f".{part}.weight", f".{part}.{ADAPTER}.weight")
        weights[name] = value
    return settings, base, weights
