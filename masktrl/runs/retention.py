"""Storage budgets: which checkpoints and rollout batches a run keeps, and how much disk a run
will need.

Retention (``train.keep_checkpoints``, ``train.keep_steps``, ``rollout.store``) is applied by
``prune`` right after a checkpoint is complete and recorded in the manifest, never before: the
manifest first marks what goes as ``pruned`` (so nothing reads it any more), then the files are
deleted. A crash between the two leaves files the next ``prune`` deletes; it never leaves a
manifest that points at a deleted file as ``done``.

* ``keep_checkpoints=N``: the newest N complete checkpoints stay, plus any step listed in
  ``keep_steps``; older ones go. ``--resume`` needs only the newest; ``masktrl eval`` and the
  analyses can then use the steps kept (and step 0, the starting policy).
* ``rollout.store=resume``: a step's rollout batch is deleted once a checkpoint at that step or
  later is recorded: what stays is exactly what ``--resume`` reuses (the batches after the newest
  checkpoint). ``--rollouts-from`` such a run is refused (its early steps are gone); train on it
  with ``rollout.store=all``.

``project`` estimates the disk a run needs from its config and parameter count: rollouts at
``ROLLOUT_BYTES_PER_TOKEN[model.dtype]`` per generated token (every response at
``rollout.max_new_tokens``, an upper bound), checkpoints at their weights plus optimizer state
(see ``checkpoint_bytes``).
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from masktrl.runs.store import checkpoint_key, done_steps, key_step, rollout_key, stage_kind

ROLLOUT_BYTES_PER_TOKEN = {"bfloat16": 38.7, "float16": 78.0, "float32": 78.0}
"""Bytes of a stored rollout batch per generated token at K = 20 with Qwen3's 151,936-token
vocabulary and trained-model-like (Zipf) ids, by ``model.dtype``: rollout storage format 2 on
bf16 logits 38.7, on float32 logits 78.0 (docs/BENCHMARKS.md §2;
float16, not measured, is taken as float32). ``benchmarks/disk_projection.py --measure`` gives
a worst case (uniform ids) for the checkout's format."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_FP32_BYTES = 12
"""DeepSpeed ZeRO optimizer state per parameter: fp32 master weights + Adam's two fp32 moments."""


# --------------------------------------------------------------------------- retention


def checkpoints_to_prune(done: list[int], keep: int | None, keep_steps: tuple[int, ...] = ()) -> list[int]:
    """Of the complete checkpoint steps ``done``, those that ``keep`` (newest N) and
    ``keep_steps`` do not keep, oldest first. ``keep=None`` keeps all."""
    if keep is None:
        return []
    newest = set(sorted(done)[-keep:])
    return [s for s in sorted(done) if s not in newest and s not in set(keep_steps)]


def rollouts_to_prune(stored: list[int], newest_checkpoint: int, mode: str) -> list[int]:
    """Of the stored rollout steps, those ``rollout.store=mode`` drops once ``newest_checkpoint`` is recorded."""
    if mode == "all":
        return []
    return [s for s in sorted(stored) if s <= newest_checkpoint]


def prune(store, keep: int | None, keep_steps: tuple[int, ...], rollout_store: str) -> dict:
    """Apply the retention settings to a run (``RunStore``); returns the steps pruned.

    Called by the main process after a checkpoint is recorded. Marks the stages ``pruned`` in
    the manifest (one read-modify-write under the run's manifest lock), then deletes their
    files, and any files of stages marked ``pruned`` earlier that are still there (a crash in
    between)."""
    if not store.writable:
        return {"checkpoints": [], "rollouts": []}
    with store.updating() as manifest:  # under the run's manifest lock: a stage an eval records meanwhile is kept
        stages = manifest["stages"]
        done_ckpt = done_steps(stages, "checkpoint")
        stored = done_steps(stages, "rollout")
        ckpts = checkpoints_to_prune(done_ckpt, keep, keep_steps)
        rollouts = rollouts_to_prune(stored, done_ckpt[-1] if done_ckpt else 0, rollout_store)
        keys = [checkpoint_key(s) for s in ckpts] + [rollout_key(s) for s in rollouts]
        for key in keys:
            stages[key] = {**stages[key], "status": "pruned"}
    for key, entry in stages.items():
        if entry.get("status") != "pruned":
            continue
        step = key_step(key)
        if stage_kind(key) == "checkpoint":
            shutil.rmtree(store.checkpoint_dir(step), ignore_errors=True)
        else:
            for rel in entry.get("files", {}):
                (store.root / rel).unlink(missing_ok=True)
            _rmdir_if_empty(store.step_dir(step))
    return {"checkpoints": ckpts, "rollouts": rollouts}


def _rmdir_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


# --------------------------------------------------------------------------- projection


def checkpoint_bytes(n_params: int, dtype: str, *, deepspeed_stage: int | None = None) -> dict:
    """Bytes of one checkpoint by part.

    ``weights``: the HF safetensors export (``model.dtype``). ``optimizer``: without DeepSpeed,
    torch AdamW's two moments in the parameters' dtype (trainer_state.pt); under DeepSpeed ZeRO,
    fp32 master weights + two fp32 moments (12 B/parameter, summed over the processes' shards),
    and ZeRO-0/1/2 also write the module's weights again (``mp_rank_00_model_states.pt``)."""
    w = n_params * DTYPE_BYTES[dtype]
    if deepspeed_stage is None:
        return {"weights": w, "optimizer": 2 * w}
    module = w if deepspeed_stage < 3 else 0
    return {"weights": w, "optimizer": ADAM_FP32_BYTES * n_params + module}


def checkpoint_steps(steps: int, every: int) -> list[int]:
    """The steps at which a run of ``steps`` steps writes a checkpoint (every ``every`` and the last)."""
    return sorted({s for s in range(every, steps + 1, every)} | {steps})


@dataclass(frozen=True)
class DiskProjection:
    tokens_per_step: int  # generated tokens at most (every response at max_new_tokens)
    bytes_per_token: float
    rollout_step: int  # bytes of one step's rollout batch
    rollouts_kept: int  # batches on disk at most
    checkpoint: dict  # bytes of one checkpoint by part
    checkpoints_kept: int  # complete checkpoints on disk at most (one more while the newest is written)
    steps: int

    @property
    def checkpoint_total(self) -> int:
        return sum(self.checkpoint.values())

    @property
    def rollouts(self) -> int:
        return self.rollout_step * self.rollouts_kept

    @property
    def checkpoints(self) -> int:
        return self.checkpoint_total * self.checkpoints_kept

    @property
    def per_run(self) -> int:
        return self.rollouts + self.checkpoints

    def info(self) -> dict:
        """What the run's manifest records (``disk_projection``)."""
        return {
            "per_step": self.rollout_step,
            "per_checkpoint": self.checkpoint_total,
            "per_run": self.per_run,
            "bytes_per_token": self.bytes_per_token,
        }

    def summary(self) -> str:
        """One line for the start of a run."""
        return (
            f"projected disk: rollouts {human(self.rollout_step)}/step ({self.tokens_per_step:,} "
            "tokens at most x "
            f"{self.bytes_per_token:.0f} B), {self.rollouts_kept} kept = {human(self.rollouts)}; "
            "checkpoints "
            f"{human(self.checkpoint_total)} each ({human(self.checkpoint['weights'])} weights + "
            f"{human(self.checkpoint['optimizer'])} optimizer), {self.checkpoints_kept} kept = "
            f"{human(self.checkpoints)}; "
            f"run total <= {human(self.per_run)}"
        )


def project(
    cfg, n_params: int, *, deepspeed_stage: int | None = None, bytes_per_token: float | None = None
) -> DiskProjection:
    """The disk a run of ``cfg`` needs at most, for a policy of ``n_params`` parameters
    (``bytes_per_token``: default ``ROLLOUT_BYTES_PER_TOKEN[cfg.model.dtype]``)."""
    r, t = cfg.rollout, cfg.train
    if bytes_per_token is None:
        bytes_per_token = ROLLOUT_BYTES_PER_TOKEN[cfg.model.dtype]
    tokens = r.prompts_per_step * r.n * r.max_new_tokens
    kept_rollouts = t.steps if r.store == "all" else min(t.steps, t.checkpoint_every)
    written = checkpoint_steps(t.steps, t.checkpoint_every)
    if t.keep_checkpoints is None:
        kept_ckpts = len(written)
    else:
        pinned = len(set(t.keep_steps) & set(written))
        kept_ckpts = min(len(written), t.keep_checkpoints + pinned)
    return DiskProjection(
        tokens_per_step=tokens,
        bytes_per_token=bytes_per_token,
        rollout_step=int(tokens * bytes_per_token),
        rollouts_kept=kept_rollouts,
        checkpoint=checkpoint_bytes(n_params, cfg.model.dtype, deepspeed_stage=deepspeed_stage),
        checkpoints_kept=kept_ckpts,
        steps=t.steps,
    )


def count_parameters(model, trainable_only: bool = False) -> int:
    """Parameters of a loaded model (each shared tensor once); ``trainable_only``: those that
    train, what a LoRA run's checkpoints hold (the adapters and their optimizer state)."""
    seen, total = set(), 0
    for p in model.parameters():
        if trainable_only and not p.requires_grad:
            continue
        if id(p) not in seen:
            seen.add(id(p))
            total += getattr(p, "ds_numel", None) or p.numel()  # ZeRO-3 partitions: the full size
    return total


def count_parameters_in_folder(path: str | Path) -> int:
    """Parameters of a safetensors model folder, from the file headers only (nothing loaded)."""
    total = 0
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def human(n: float) -> str:
    """Bytes as B/KB/MB/GB/TB (powers of 1000)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
