"""``masktrl train``: warm start, then rollout -> reward -> advantages -> update, step after step.

The loop reads top to bottom. Every random draw comes from a stream named by (seed, purpose,
step), so a resumed run reproduces an uninterrupted one; every artifact is written
atomically and recorded in the manifest only once complete.

Resume (``resume=True``) restarts from the last complete checkpoint: weights, optimizer,
scheduler and RNG states are restored, ``metrics.jsonl`` is cut back to that step, and the
rollout batches already stored for later steps are reused (verified by hash) instead of
regenerated. On CPU with the same seed the final weights are bit-identical to an
uninterrupted run.

Under ``accelerate launch`` (see ``pipeline/distributed.py`` and docs/CLUSTER.md) every process
generates its share of the prompt groups, the groups are gathered so every process holds the
whole batch, and ``policy_update`` trains each process on its part of every minibatch; only the
main process writes, through the same ``store`` (the others get a read-only view).
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass

import torch

from masktrl.config import Config, save_config
from masktrl.errors import ArtifactError, MasktrlError
from masktrl.methods import get_method, make_params
from masktrl.models.loading import load_model_and_tokenizer, tokenizer_fingerprint
from masktrl.pipeline import checkpoint as ckpt
from masktrl.pipeline.evaluate import periodic_eval
from masktrl.pipeline.evaluate_task import heldout_accuracy
from masktrl.pipeline.distributed import Dist, launched
from masktrl.pipeline.faults import maybe_crash
from masktrl.pipeline.rl import PolicyForward, generate_groups, policy_update, sampling_settings, set_group_advantages
from masktrl.seeding import stream_seed
from masktrl.io import atomic_write_json, atomic_write_text
from masktrl.pipeline.store import RunStore
from masktrl.pipeline.tasks import make_task
from masktrl.pipeline.warmstart import prepare_policy
from masktrl.rollout import make_engine
from masktrl.rollout.replay import RolloutSource
from masktrl.rollout.storage import read_rollouts, write_rollouts

MAX_REFILLS = 4  # dynamic sampling: rollout attempts per step before training on what was kept


@dataclass
class TrainResult:
    summary: dict
    store: RunStore
    is_main: bool = True  # False on the other processes of a multi-process run (they print nothing)


def run(cfg: Config, store: RunStore, progress=None, *, resume: bool = False, rollouts_from: str | None = None,
        dist: Dist | None = None) -> TrainResult:
    t_start = time.time()
    dist = dist or (Dist.from_launch(cfg) if launched() else Dist())  # a bad launch config fails here, before any write
    if resume and dist.deepspeed:
        raise MasktrlError("--resume of a DeepSpeed run is not supported yet: its checkpoints hold the weights, not the sharded optimizer state")
    torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.seed)
    if not dist.is_main:
        store, progress = store.read_only(), None
    store.manifest  # noqa: B018  every process reads the run's state before the main one changes it
    dist.barrier()
    if store.writable:
        store.root.mkdir(parents=True, exist_ok=True)
        if not resume:
            save_config(cfg, store.root / "run.yaml")
            store.mark_done("config", [store.root / "run.yaml"], config_hash=cfg.hash())
    store.set_info(method=cfg.method_name, seed=cfg.seed, steps_planned=cfg.train.steps, status="running", pid=os.getpid(), processes=dist.world)

    task = make_task(cfg)
    with dist.loading():  # the main process first: it fills the warm-start cache, the others read it
        model, tokenizer, ws_info = prepare_policy(cfg, task, store.root.parent, progress)
    if not store.is_done("warmstart"):
        store.mark_done("warmstart", [], config_hash=cfg.hash("model", "task", "warmstart"), info=ws_info)
    method = get_method(cfg.method_name)
    params = make_params(cfg.method_name, **cfg.method_params)
    optimizer, scheduler = make_optimizer(model, cfg)
    start = 0
    if resume:
        start = restore_latest_checkpoint(store, model, optimizer, scheduler)
        dist.barrier()
    policy, optimizer = dist.prepare(PolicyForward(model), optimizer)  # model stays the (unwrapped) LM
    engine = make_engine(cfg, model, tokenizer, ws_info.get("path", cfg.model.path))
    if start:
        sync_weights(engine, model, dist)
    source = RolloutSource(rollouts_from, cfg.rollout.prompts_per_step, tokenizer) if rollouts_from else None
    steps = min(cfg.train.steps, source.num_steps) if source else cfg.train.steps
    settings = sampling_settings(cfg)
    test_set = task.test_examples()
    rollout_meta = {"engine": engine.name, "tokenizer": tokenizer_fingerprint(tokenizer), **settings.__dict__}

    if store.is_done("eval/before"):
        eval_before = store.stage("eval/before")["accuracy"]
    else:
        eval_before = heldout_accuracy(engine, tokenizer, task, test_set, settings, cfg.eval.greedy, cfg.model.chat_template, cfg.seed)
        store.mark_done("eval/before", [], accuracy=eval_before)
    bar = progress.add_task("RL", total=steps, completed=start, info="") if progress else None
    stop = _GracefulStop()
    try:
        for step in range(start + 1, steps + 1):
            t0 = time.time()
            rollout_path = store.step_dir(step) / "rollouts.parquet"
            stage = f"step/{step:06d}/rollout"
            if store.is_done(stage):  # resumed: reuse what is stored, after checking its hash
                store.verify(stage)
                samples, meta = read_rollouts(rollout_path)
                gen_stats = meta["stats"]
            else:
                if source:
                    samples, gen_stats = source.batch(step)
                else:
                    samples, gen_stats = collect_rollouts(engine, tokenizer, task, settings, method, params, cfg, step, dist)
                maybe_crash("rollout-write", step)
                if store.writable:
                    write_rollouts(rollout_path, samples, {**(source.meta if source else rollout_meta), "stats": gen_stats})
                store.mark_done(stage, [rollout_path])
            t_rollout = time.time() - t0

            maybe_crash("update", step)
            stats = policy_update(policy, optimizer, scheduler, samples, method, params, cfg, cfg.seed, step, dist) if samples else {}
            sync_weights(engine, model, dist)
            store.mark_done(f"step/{step:06d}/train", [], defer=True)  # written with the next manifest write

            row = {
                "step": step,
                **gen_stats,
                **stats,
                "clip_frac": stats.get("mask_frac"),
                "rollout_time_s": t_rollout,
                "step_time_s": time.time() - t0,
                "tokens_per_s": gen_stats["tokens"] / max(time.time() - t0, 1e-9),
                "lr": scheduler.get_last_lr()[0],
            }
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < steps:
                row["eval/heldout/accuracy"] = heldout_accuracy(
                    engine, tokenizer, task, test_set, settings, cfg.eval.greedy, cfg.model.chat_template, cfg.seed
                )
            row.update(periodic_eval(cfg, store, engine, tokenizer, step, steps, write=store.writable))  # train.eval_benchmarks
            store.append_metrics(row)
            stopping = dist.broadcast(stop.requested)  # every process stops after the same step
            if step % cfg.train.checkpoint_every == 0 or step == steps or stopping:
                save_checkpoint(store, step, model, tokenizer, optimizer, scheduler, dist, policy)
            if progress:
                progress.update(bar, advance=1, info=f"reward {row['reward_mean']:.3f}  {row['tokens_per_s']:.0f} tok/s")
            if stopping:
                store.set_info(status="interrupted")
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        store.set_info(status="interrupted")
        raise
    except BaseException:
        store.set_info(status="failed")
        raise
    finally:
        stop.restore()

    if store.is_done("eval/after"):
        eval_after = store.stage("eval/after")["accuracy"]
    else:
        eval_after = heldout_accuracy(engine, tokenizer, task, test_set, settings, cfg.eval.greedy, cfg.model.chat_template, cfg.seed)
        store.mark_done("eval/after", [], accuracy=eval_after)
    summary = {
        "run": store.name,
        "method": cfg.method_name,
        "method_params": params.__dict__,
        "seed": cfg.seed,
        "steps": steps,
        "eval_before": eval_before,
        "eval_after": eval_after,
        "eval_split": f"{task.name} held-out, n={len(test_set)}",
        "eval_decoding": "greedy" if cfg.eval.greedy else f"sampled (T={cfg.rollout.temperature})",
        "warmstart": {k: ws_info.get(k) for k in ("source", "cached", "time_s", "final_loss")},
        "rollouts_from": rollouts_from,
        "wall_time_s": time.time() - t_start,
    }
    if store.writable:
        atomic_write_json(store.root / "summary.json", summary)
    store.mark_done("summary", [store.root / "summary.json"])
    store.set_info(status="complete")
    dist.barrier()
    return TrainResult(summary, store, dist.is_main)


def make_optimizer(model, cfg: Config):
    t = cfg.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.999))
    warmup = t.warmup_steps * t.minibatches  # the scheduler steps once per optimizer update
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup) if warmup else 1.0)
    return optimizer, scheduler


def collect_rollouts(engine, tokenizer, task, settings, method, params, cfg: Config, step: int, dist: Dist | None = None):
    """One step's rollout batch: prompts_per_step groups with advantages, and its statistics.

    With dynamic sampling (DAPO), groups whose rewards are all equal carry no signal and are
    dropped, and more prompts are generated (up to MAX_REFILLS attempts) to refill the batch.
    With several processes each generates and scores every world-th prompt's group (its own
    sampling seed), then the groups are gathered in prompt order: every process returns the
    same batch.
    """
    dist = dist or Dist()
    want = cfg.rollout.prompts_per_step
    dynamic = method.dynamic_sampling(params)
    kept, generated = [], []
    for attempt in range(MAX_REFILLS if dynamic else 1):
        rng = random.Random(stream_seed(cfg.seed, "prompts", step, attempt))
        examples = task.train_examples(want, rng)[dist.rank :: dist.world]
        seed = stream_seed(cfg.seed, "rollout", step, attempt, *dist.stream_key)
        groups = generate_groups(engine, tokenizer, task, examples, settings, seed, cfg.model.chat_template) if examples else []
        for group in groups:  # rewards and advantages: whole groups, where they were generated
            method.shape_rewards(params, group, settings.max_new_tokens)
            if not (dynamic and len({s.reward for s in group}) == 1):
                set_group_advantages(group)
        groups = _interleave(dist.gather_objects(groups))
        generated.extend(groups)
        kept.extend(g for g in groups if not (dynamic and len({s.reward for s in g}) == 1))
        if len(kept) >= want:
            break
    kept = kept[:want]
    for g, group in enumerate(kept):
        for s in group:
            s.group = g
    return [s for g in kept for s in g], rollout_stats(generated, len(kept))


def _interleave(per_rank: list[list]) -> list:
    """Rank r holds items r, r + W, r + 2W, ...: put them back in one list in that order."""
    return [x[j] for j in range(max(map(len, per_rank))) for x in per_rank if j < len(x)]


def rollout_stats(groups, kept: int) -> dict:
    samples = [s for g in groups for s in g]
    return {
        "reward_mean": sum(s.extra.get("score", s.reward) for s in samples) / len(samples),
        "response_len_mean": sum(len(s.gen.response_ids) for s in samples) / len(samples),
        "tokens": sum(len(s.gen.response_ids) for s in samples),
        "groups_kept": kept,
        "groups_generated": len(groups),
    }


def save_checkpoint(store: RunStore, step: int, model, tokenizer, optimizer, scheduler, dist: Dist | None = None, policy=None) -> None:
    """Written by the main process. Under DeepSpeed the weights are first gathered from the
    shards (every process takes part) and the sharded optimizer state is left out."""
    dist = dist or Dist()
    state = dist.full_state_dict(policy) if dist.deepspeed else None  # ZeRO-3: None except on the main process
    if state is not None:
        state = {k.removeprefix("lm."): v for k, v in state.items()}
    if store.writable:
        path = ckpt.save(store.checkpoint_dir(step), model, tokenizer, None if dist.deepspeed else optimizer, scheduler, step, state_dict=state)
        store.mark_done(f"checkpoint/{step:06d}", [path])
    dist.barrier()


def sync_weights(engine, model, dist: Dist) -> None:
    with dist.gathered(model):  # ZeRO-3: the engine reads whole weights
        engine.sync_weights(model)


def restore_latest_checkpoint(store: RunStore, model, optimizer, scheduler) -> int:
    """Load the newest complete checkpoint into model/optimizer/scheduler; return its step.

    Metrics rows after that step are dropped (the steps are redone and write them again).
    Returns 0 when no checkpoint exists yet (restart from the warm start).
    """
    done = sorted(int(k.split("/")[1]) for k, v in store.manifest["stages"].items() if k.startswith("checkpoint/") and v.get("status") == "done")
    step = done[-1] if done else 0
    # Check everything the resumed run will read before changing anything on disk.
    for key, entry in store.manifest["stages"].items():
        if entry.get("status") == "done" and key.startswith("step/") and key.endswith("/rollout") and int(key.split("/")[1]) > step:
            store.verify(key)
            read_rollouts(store.root / next(iter(entry["files"])))
    if step:
        store.verify(f"checkpoint/{step:06d}")
        path = store.checkpoint_dir(step)
        try:
            loaded, _ = load_model_and_tokenizer(path, _dtype_name(model))
        except MasktrlError as exc:
            raise ArtifactError(f"{path}/model.safetensors: unreadable checkpoint ({exc})") from None
        model.load_state_dict(loaded.state_dict())
        ckpt.load_trainer_state(path, optimizer, scheduler)
    for key in [k for k in store.manifest["stages"] if k.startswith("step/") and k.endswith("/train")]:
        if int(key.split("/")[1]) > step:  # updates after the checkpoint were lost with the process
            del store.manifest["stages"][key]
    store.write_manifest()
    if store.writable:
        rows = [r for r in store.read_metrics() if r["step"] <= step]
        atomic_write_text(store.metrics_path, "".join(_json_line(r) for r in rows))
    return step


def check_resumable(store: RunStore) -> None:
    """Refuse to resume from a folder that is not a masktrl run or whose config file changed."""
    if not store.root.is_dir():
        raise MasktrlError(f"no run folder {store.root}")
    if not store.exists():
        raise ArtifactError(f"{store.root / 'manifest.json'}: missing, cannot resume this run")
    store.verify("config")


def _json_line(row: dict) -> str:
    import json

    return json.dumps(row, sort_keys=True) + "\n"


def _dtype_name(model) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


class _GracefulStop:
    """First Ctrl-C: finish the current step, checkpoint it, stop. Second Ctrl-C: stop now."""

    def __init__(self):
        self.requested = False
        self._previous = None
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread (e.g. a notebook worker): keep default behaviour
            self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\ninterrupt: finishing this step and saving a checkpoint (Ctrl-C again to stop now)", flush=True)

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
