"""Checkpoints: HF ``save_pretrained`` (safetensors) + optimizer, scheduler and RNG states.

Written into a temporary folder and renamed into place, so a checkpoint folder that exists
is complete. Loading uses ``torch.load(weights_only=True)``: no pickle from files.

Under DeepSpeed the optimizer state is sharded: each process's shard is written by DeepSpeed
itself (``engine.save_checkpoint``) into the checkpoint's ``deepspeed/`` folder, and
``trainer_state.json`` records the ZeRO stage and process count it needs. DeepSpeed loads its
files with pickle; masktrl loads them only from the run's own checkpoint, after the manifest's
sha256 check of every file (``RunStore.resume_step``).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from masktrl.errors import ArtifactError, MasktrlError
from masktrl.io import atomic_dir, atomic_write_json
from masktrl.models.loading import load_model_and_tokenizer
from masktrl.models.lora import (
    ADAPTER_WEIGHTS,
    has_lora,
    is_adapter_folder,
    load_adapter_state_dict,
    read_adapter,
    save_adapter,
)
from masktrl.readers import read_json
from masktrl.rl.distributed import Dist
from masktrl.runs.faults import maybe_crash
from masktrl.runs.store import RunStore, checkpoint_key

ENGINE_STATE_DIR = "deepspeed"  # DeepSpeed's own checkpoint format, inside checkpoints/<step>/


class Sharded(NamedTuple):
    """A DeepSpeed run's part of a checkpoint: ``state_dict``, the weights to write instead of
    the model's own (gathered from the shards); ``engine_state``, a folder of DeepSpeed shards
    moved into the checkpoint as ``deepspeed/``; ``extra``, entries for trainer_state.json."""

    state_dict: dict | None = None
    engine_state: Path | None = None
    extra: dict | None = None


def save(dest: Path, model, tokenizer, optimizer, scheduler, step: int, sharded: Sharded = Sharded()) -> Path:
    """Write checkpoint ``step`` into ``dest``. ``optimizer=None`` (DeepSpeed: its state is
    sharded) leaves the optimizer state out; ``sharded``: see ``Sharded``."""
    dest = Path(dest)
    state_dict, engine_state, extra = sharded
    with atomic_dir(dest) as tmp:
        if has_lora(model):  # a LoRA run: the adapters only, naming their base (models/lora.py)
            save_adapter(tmp, model, state=state_dict)
        else:
            model.save_pretrained(tmp, state_dict=state_dict)
        maybe_crash("checkpoint-write", step)  # crash tests: die with a half-written checkpoint
        tokenizer.save_pretrained(tmp)
        trainer = {"optimizer": optimizer.state_dict()} if optimizer is not None else {}
        torch.save({**trainer, "scheduler": scheduler.state_dict()}, tmp / "trainer_state.pt")
        torch.save(_rng_state(), tmp / "rng_state.pt")
        atomic_write_json(tmp / "trainer_state.json", {"step": step, **(extra or {})})
        if engine_state is not None:
            Path(engine_state).rename(tmp / ENGINE_STATE_DIR)
    return dest


def save_step(
    store: RunStore, step: int, model, tokenizer, optimizer, scheduler, dist: Dist | None = None, policy=None
) -> None:
    """Checkpoint ``step`` into the run and record it as stage ``checkpoint/<step>``.

    Written by the main process. Under DeepSpeed every process takes part: the weights are
    gathered from the shards for the HF export, and each process writes its shard of DeepSpeed's
    state (optimizer partitions with the fp32 master weights) into ``<step>.deepspeed.tmp``,
    which is moved into the checkpoint as ``deepspeed/`` before the checkpoint is renamed into
    place: a checkpoint folder that exists is complete, DeepSpeed state included. Weights that
    are not all finite are never written (MasktrlError: the run stops as failed)."""
    dist = dist or Dist()
    sharded = dist.deepspeed or dist.fsdp2
    state = dist.full_state_dict(policy) if sharded else None  # ZeRO-3, FSDP2: None except on the main process
    if state is not None:
        state = {k.removeprefix("lm."): v for k, v in state.items()}
    weights = state if state is not None else (model.state_dict() if store.writable else None)
    bad = dist.broadcast(nonfinite_tensor(weights) if weights is not None else None)  # every process stops alike
    if bad is not None:
        raise MasktrlError(
            f"step {step}: the weights are not finite ({bad} holds NaN or inf); checkpoint {step} was not written"
        )
    if dist.fsdp2:  # the full optimizer state, in the one-process format; the weights whole again
        optimizer = _Saved(dist.full_optimizer_state(optimizer))
        dist.whole()
    dest = store.checkpoint_dir(step)
    shards = dest.with_name(dest.name + ".deepspeed.tmp") if dist.deepspeed else None
    if shards is not None:
        if store.writable:
            shutil.rmtree(shards, ignore_errors=True)
        dist.barrier()
        dist.save_engine_state(policy, shards)  # every process, its own shard
    if store.writable:
        extra = {"deepspeed": dist.engine_state_info()} if dist.deepspeed else None
        path = save(
            dest,
            model,
            tokenizer,
            None if dist.deepspeed else optimizer,
            scheduler,
            step,
            Sharded(state, shards, extra),
        )
        store.sync_metrics()  # the metrics rows of the checkpoint's steps are durable before it is recorded
        store.mark_done(
            checkpoint_key(step), [path], metrics=store.metrics_digest()
        )  # every file, and the rows up to it
    dist.barrier()


class _Saved:
    """An optimizer state already gathered, where ``save`` asks for ``optimizer.state_dict()``."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state


def nonfinite_tensor(state: dict) -> str | None:
    """The name of the first floating-point tensor of ``state`` holding NaN or inf, else None."""
    for name, tensor in state.items():
        if torch.is_tensor(tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def restore(path: Path, model, optimizer, scheduler) -> None:
    """Load a checkpoint into ``model`` (weights, in its dtype), ``optimizer``, ``scheduler`` and
    the global RNGs: what ``--resume`` continues from. A DeepSpeed checkpoint has no optimizer
    state here: ``restore_engine_state`` loads it after ``prepare``."""
    dtype = next(model.parameters()).dtype
    if is_adapter_folder(path):  # a LoRA run: the base is the run's own; only the adapters load
        try:
            _, _, adapters = read_adapter(path)
            load_adapter_state_dict(model, {k: v.to(dtype) for k, v in adapters.items()})
        except ValueError as exc:
            raise ArtifactError(f"{path}/{ADAPTER_WEIGHTS}: {exc}") from None
        load_trainer_state(path, optimizer, scheduler)
        return
    try:
        loaded, _ = load_model_and_tokenizer(path, str(dtype).removeprefix("torch."))
    except MasktrlError as exc:
        raise ArtifactError(f"{path}/model.safetensors: unreadable checkpoint ({exc})") from None
    model.load_state_dict(loaded.state_dict())
    load_trainer_state(path, optimizer, scheduler)


def check_resumable(path: Path, dist: Dist) -> None:
    """Refuse, before anything changes, a checkpoint whose DeepSpeed state does not fit this
    launch (written with or without DeepSpeed, another ZeRO stage, another process count)."""
    try:
        info = read_json(Path(path) / "trainer_state.json", error=ArtifactError, finite=False).get("deepspeed")
    except (OSError, AttributeError) as exc:
        raise ArtifactError(f"{path}/trainer_state.json: unreadable checkpoint ({str(exc).splitlines()[0]})") from None
    if info is not None and not (Path(path) / ENGINE_STATE_DIR).is_dir():
        raise ArtifactError(f"{path}/{ENGINE_STATE_DIR}: missing (the checkpoint's DeepSpeed state)")
    dist.check_engine_state(info, path)


def restore_engine_state(path: Path, dist: Dist, policy, optimizer=None) -> None:
    """Every process loads its shard of the checkpoint's DeepSpeed state into the prepared
    ``policy``; under FSDP2 the checkpoint's full optimizer state is sharded into the prepared
    ``optimizer`` (``restore`` loaded it before ``prepare``, which swaps the parameters). No-op
    otherwise."""
    dist.load_engine_state(policy, Path(path) / ENGINE_STATE_DIR)
    if dist.fsdp2 and optimizer is not None:
        try:
            state = torch.load(Path(path) / "trainer_state.pt", weights_only=True)["optimizer"]
        except (OSError, RuntimeError, KeyError) as exc:
            raise ArtifactError(f"{path}: unreadable optimizer state ({str(exc).splitlines()[0]})") from None
        dist.load_full_optimizer_state(optimizer, state)


def load_trainer_state(path: Path, optimizer, scheduler) -> dict:
    """Restore optimizer, scheduler and RNG states in place; return trainer_state.json."""
    path = Path(path)
    load_optimizer_state(path, optimizer, scheduler)
    try:
        _set_rng_state(torch.load(path / "rng_state.pt", weights_only=True))
        return read_json(path / "trainer_state.json", error=ArtifactError, finite=False)
    except (OSError, RuntimeError, KeyError) as exc:
        raise ArtifactError(f"{path}: unreadable checkpoint ({str(exc).splitlines()[0]})") from None


def load_optimizer_state(path: Path, optimizer, scheduler) -> None:
    """Restore optimizer and scheduler from ``trainer_state.pt`` (no RNG: analyses replaying a
    step use this, and leave the process's global generators alone)."""
    path = Path(path)
    try:
        state = torch.load(path / "trainer_state.pt", weights_only=True)
        if "optimizer" in state:  # DeepSpeed checkpoints keep it in deepspeed/ (restore_engine_state)
            optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        raise ArtifactError(f"{path}: unreadable optimizer state ({str(exc).splitlines()[0]})") from None


def _rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": json.dumps(random.getstate()),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": np_state[2]},
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    py = json.loads(state["python"])
    random.setstate((py[0], tuple(py[1]), py[2]))
    keys = state["numpy"]["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, int(state["numpy"]["pos"])))
