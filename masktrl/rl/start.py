"""The policy a run starts from, as the train recipe builds it: warm-started or loaded
(``rl/warmstart.py``) and recorded as the run's stage ``warmstart``, its head checked, LoRA
adapters on it (their base weights saved once in the run: ``lora_base``), a warning where
AdamW would update 16-bit weights (``sixteen_bit_weights_warning``), gradient checkpointing on
when asked (``load_policy``); and a resumed run's checkpoint loaded into it (``restore_run``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from masktrl.config import Config
from masktrl.errors import MasktrlError
from masktrl.io import atomic_dir
from masktrl.models import checkpointing
from masktrl.models.architectures import check_lm_head, shared_prompt_cache_ok
from masktrl.models.lora import apply_lora
from masktrl.models.lowprec import apply_training_quantization
from masktrl.models.packing import packing_unsupported
from masktrl.rl.checks import lora_settings
from masktrl.rl.distributed import Dist
from masktrl.rl.train_state import restore
from masktrl.rl.warmstart import prepare_policy
from masktrl.runs.store import LORA_BASE_KEY, WARMSTART_KEY, RunStore
from masktrl.tasks import Task


def load_policy(cfg: Config, store: RunStore, task: Task, progress, dist: Dist, *, say: Callable[[str], None]):
    """(model, tokenizer, info): the warm-started tiny model or the configured one, recorded as
    stage ``warmstart``, its head checked, LoRA adapters on it when ``model.lora`` asks;
    gradient checkpointing switched on when asked. ``say`` tells the user what is off."""
    with dist.loading():  # the main process first: it fills the warm-start cache, the others read it
        model, tokenizer, ws_info = prepare_policy(cfg, task, store.root.parent, progress)
    if not store.is_done(WARMSTART_KEY):
        store.mark_done(WARMSTART_KEY, [], config_hash=cfg.hash("model", "task", "warmstart"), info=ws_info)
    if cfg.train.packing and (reason := packing_unsupported(model)):
        raise MasktrlError(f"train.packing: {reason}; set train.packing=false")
    check_lm_head(model)  # the chunked log-probs assume logits = h W^T: a soft-capped or scaled head is refused
    if cfg.model.lora.rank is not None:
        apply_lora(model, lora_settings(cfg), seed=cfg.seed, base=lora_base(cfg, store, model, tokenizer, dist))
    shareable, why = shared_prompt_cache_ok(model.base_model)
    if not shareable:
        say(
            f"warning: the shared-prompt forward is off for this model ({why}): every response runs "
            "with its "
            "own prompt (metrics column shared_prompt_frac = 0)"
        )
    apply_training_quantization(
        model, cfg.train.quantization, cfg.train.quantization_backend
    )  # FP8 training (models/lowprec.py)
    if warning := sixteen_bit_weights_warning(model, cfg.train.lr, deepspeed=dist.deepspeed):
        say(warning)
    if cfg.train.gradient_checkpointing:
        checkpointing.enable(model)
        if not checkpointing.shared_prompt_supported(model.base_model):
            say(
                "warning: train.gradient_checkpointing: this transformers version drops the KV cache "
                "in "
                "checkpointed layers, so the policy forward runs every response with its own "
                "prompt (no prompt sharing; "
                "metrics column shared_prompt_frac = 0)"
            )
    return model, tokenizer, ws_info


# the smallest half-spacing of a 16-bit float around a weight, as a share of the weight (8 and 11
# significant bits): an update smaller than that rounds back to the weight
_HALF_SPACING = {"bfloat16": "2^-9", "float16": "2^-12"}


def sixteen_bit_weights_warning(model, lr: float, *, deepspeed: bool) -> str | None:
    """The warning for a policy whose trainable weights are 16-bit floats outside DeepSpeed (which
    keeps float32 master weights): torch's AdamW updates them in place in their own dtype, so a
    step below half a weight's spacing (``_HALF_SPACING`` of its size) is lost. None otherwise
    (float32 weights, LoRA adapters in float32 over a 16-bit base, or DeepSpeed)."""
    if deepspeed:
        return None
    trainable = {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.requires_grad}
    low = sorted(trainable & set(_HALF_SPACING))
    if not low:
        return None
    dtype = low[0]
    return (
        f"warning: the policy's trainable weights are {dtype} and no DeepSpeed optimizer keeps float32 "
        f"master copies: AdamW updates them in {dtype}, so an update smaller than {_HALF_SPACING[dtype]} of "
        f"a weight's size is lost (AdamW's steps are about train.lr={lr:g}); use model.dtype=float32 or "
        "DeepSpeed (docs/CLUSTER.md)"
    )


def lora_base(cfg: Config, store: RunStore, model, tokenizer, dist: Dist) -> str:
    """Where a LoRA run's adapter checkpoints find their base weights: ``model.path`` for a real
    model; for the tiny model its warm-started weights, saved once in the run (``<run>/base/``,
    named relative to a checkpoint folder, so the run folder can move)."""
    if cfg.model.path != "tiny":
        local = Path(cfg.model.path)
        return str(local.resolve()) if local.exists() else cfg.model.path
    dest = store.lora_base_dir
    if store.writable and not store.is_done(LORA_BASE_KEY):
        with atomic_dir(dest) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        store.mark_done(LORA_BASE_KEY, [dest])
    dist.barrier()
    return os.path.relpath(dest, store.checkpoint_dir(0))  # ../../base: the run folder can move


def restore_run(store: RunStore, start: int, model, optimizer, scheduler, dist: Dist) -> tuple[int, int]:
    """A resumed run: checkpoint ``start`` loaded (none at step 0), what happened after it
    forgotten; returns the non-finite counters read back from the metrics rows (``nonfinite_counts``)."""
    if start:
        with dist.loading():  # ZeRO-3: the checkpoint loads whole (no zero.Init), prepare shards it
            restore(store.checkpoint_dir(start), model, optimizer, scheduler)
    store.rewind(start)  # forget the updates and metrics after that checkpoint
    dist.barrier()
    return nonfinite_counts(store.read_metrics()) if start else (0, 0)


def nonfinite_counts(rows: list[dict]) -> tuple[int, int]:
    """(steps with a skipped update, how many of the last rows in a row had one) from metrics rows."""
    total = rows[-1].get("nonfinite_steps", 0) if rows else 0
    run = 0
    for row in reversed(rows):
        if not row.get("skipped_updates"):
            break
        run += 1
    return total, run
