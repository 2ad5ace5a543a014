"""``masktrl train`` as a recipe: ``setup`` builds everything once, ``rl_step`` is one RL step
(rollout -> reward -> advantages -> update -> record), ``finish`` evaluates and writes the
summary; ``train`` runs them, with Ctrl-C and checkpoints around the steps.

Every random draw comes from a stream named by (seed, purpose, step) (``masktrl.seeding``), so a
resumed run reproduces an uninterrupted one; every artifact is written atomically and recorded
in the manifest only once complete (``runs/store.py``).

Resume (``resume=True``) restarts from the newest complete checkpoint: the run store checks every
artifact the resumed run will read, then weights, optimizer, scheduler and RNG states are
restored, ``metrics.jsonl`` is cut back to that step, and the rollout batches already stored for
later steps are reused instead of regenerated. Under DeepSpeed each process also reloads its
shard of the optimizer state (``checkpoint.restore_engine_state``), after checking the shards
fit this launch. On CPU with the same seed the final weights are bit-identical to an
uninterrupted run, with one process, DDP, ZeRO-2 and ZeRO-3.

With ``rollout.staleness`` = s the batches are sampled s steps ahead: step S first stores the
batches of steps S+1..S+s not stored yet, sampled by the policy after step S-1, so step S trains
on a batch sampled by the policy after step S-1-s (the starting policy for the first ones). With
``train.lab_stats`` every metrics row also says whether the methods can differ on the run
(``rl/lab_stats.py``, docs/LAB.md).

After each checkpoint, ``apply_retention`` deletes what ``train.keep_checkpoints`` and
``rollout.store`` no longer keep; every metrics row also goes to the ``train.report_to``
trackers (``rl/tracking.py``).

Under ``accelerate launch`` (``rl/distributed.py``, docs/CLUSTER.md) every process
generates its share of the prompt groups, the groups are gathered so every process holds the
whole batch, and ``policy_update`` trains each process on its part of every minibatch; only the
main process writes, through the same store (the others get a read-only view).

What can go wrong is handled here too (docs/RELIABILITY.md): everything checkable is checked
before the run folder is written (``rl/checks.py``); the main process holds the run's
lock for the whole run (``runs/locks.py``); SIGTERM is a Ctrl-C (``rl/signals.py``);
a step whose loss or gradient norm is not finite is not applied, and ``train.max_nonfinite_steps``
of them in a row stop the run; any way out of ``train`` records the status (``interrupted`` or
``failed`` with the reason), never leaving ``running`` behind.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from masktrl.config import Config
from masktrl.errors import MasktrlError
from masktrl.io import atomic_write_json
from masktrl.methods import get_method, make_params
from masktrl.models import checkpointing
from masktrl.models.loading import tokenizer_fingerprint
from masktrl.rl import train_state as ckpt
from masktrl.runs import retention
from masktrl.rl.collect import CollectSettings, collect_rollouts
from masktrl.rl.distributed import Dist, launched
from masktrl.rl.evaluation import heldout_accuracy, periodic_eval
from masktrl.runs.faults import maybe_crash
from masktrl.rl import checks
from masktrl.rl.lab_stats import LabStats
from masktrl.rl.policy import PolicyForward
from masktrl.rl.rollout_source import RolloutSource
from masktrl.runs.store import RunStore
from masktrl.rl.signals import Interrupted, graceful_stop
from masktrl.rl.tracking import Trackers, open_trackers
from masktrl.rl.update import UpdateSettings, make_optimizer, policy_update
from masktrl.rl.warmstart import prepare_policy
from masktrl.rollout import make_engine
from masktrl.tasks.prompts import wraps_chat


@dataclass
class TrainResult:
    summary: dict
    store: RunStore
    is_main: bool = True  # False on the other processes of a multi-process run (they print nothing)


@dataclass
class State:
    """Everything a run's steps share, built once by ``setup``."""

    cfg: Config
    store: RunStore
    dist: Dist
    task: object
    model: torch.nn.Module  # the (unwrapped) language model
    tokenizer: object
    policy: torch.nn.Module  # its training forward, wrapped for DDP / DeepSpeed when launched so
    optimizer: torch.optim.Optimizer
    scheduler: object
    engine: object
    method: object
    params: object
    collect: CollectSettings
    update: UpdateSettings
    rollouts_from: str | None
    source: RolloutSource | None  # --rollouts-from: stored batches instead of generation
    rollout_meta: dict  # written with every rollout batch
    start: int  # the last step already done (resume), 0 for a new run
    steps: int
    warmstart: dict
    test_set: list  # the task's held-out split (eval_before, eval_after, train.eval_every)
    eval_before: float
    t_start: float
    wall_before: float = 0.0  # wall time of the run's earlier sessions (resume)
    nonfinite_total: int = 0  # steps so far with an update skipped for a non-finite loss or gradient norm
    nonfinite_run: int = 0  # ... of them in a row, up to the last step
    progress: object = None
    lab: LabStats | None = None  # train.lab_stats: the before-update hook and the rows' lab/* entries
    ahead: dict = field(default_factory=dict)  # rollout.staleness: step -> (samples, stats) sampled ahead, not yet trained on
    trackers: Trackers = field(default_factory=lambda: Trackers((), Path("."), ""))  # train.report_to (main process)

    def wall_time(self) -> float:
        return self.wall_before + time.time() - self.t_start


class NonFiniteError(MasktrlError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


def train(cfg: Config, store: RunStore, progress=None, *, resume: bool = False, rollouts_from: str | None = None,
          dist: Dist | None = None, checked: checks.Checked | None = None, restart: bool = False,
          forced_changes: list[str] | None = None) -> TrainResult:
    """The whole run: the checks (``checked``: already done by the caller), setup, the RL steps (a
    checkpoint every ``train.checkpoint_every``, at each of ``train.keep_steps``, at the end, and
    when Ctrl-C or SIGTERM asks to stop; retention applied after each), then ``finish``.
    ``restart``: the run folder holds a failed or interrupted run with no checkpoint, started
    again from scratch (``plan_start``). ``forced_changes``: the keys ``--resume --force``
    changed, recorded with the new config once the checkpoint is known to fit this launch."""
    dist = dist or (Dist.from_launch(cfg.train) if launched() else Dist())  # a bad launch config fails here, before any write
    resume, restart = dist.broadcast((resume, restart))  # the main process decided what to do with the folder
    checked = checked or checks.check(cfg, rollouts_from=rollouts_from)  # before anything is written
    if not dist.is_main:
        store, progress = store.read_only(), None
    s = None
    try:
        with store.writing(), graceful_stop(graceful=False) as stop:  # one writer per run; SIGTERM = Ctrl-C
            s = setup(cfg, store, checked, progress, resume=resume, restart=restart, rollouts_from=rollouts_from, dist=dist,
                      forced_changes=forced_changes)
            with s.store.recording_failure(lambda: {"wall_time_s": s.wall_time()}):
                bar = s.progress.add_task("RL", total=s.steps, completed=s.start, info="") if s.progress else None
                stop.graceful = True  # a signal now finishes the step and checkpoints it
                for step in range(s.start + 1, s.steps + 1):
                    row = rl_step(s, step)
                    stopping = s.dist.broadcast(stop.requested)  # every process stops after the same step
                    if step % cfg.train.checkpoint_every == 0 or step == s.steps or step in cfg.train.keep_steps or stopping:
                        ckpt.save_step(s.store, step, s.model, s.tokenizer, s.optimizer, s.scheduler, s.dist, s.policy)
                        s.store.set_info(wall_time_s=s.wall_time())
                        apply_retention(s)
                    if s.progress:
                        s.progress.update(bar, advance=1, info=f"reward {row['reward_mean']:.3f}  {row['tokens_per_s']:.0f} tok/s")
                    if stopping:
                        raise Interrupted(stop.signum)
                stop.graceful = False
                return finish(s)
    finally:
        checked.task.close()  # reward / grading processes
        if s is not None:
            s.trackers.close()  # flushed and closed however the run ends (finish closed them already when it completed)


def setup(cfg: Config, store: RunStore, checked: checks.Checked, progress=None, *, resume: bool = False, restart: bool = False,
          rollouts_from: str | None = None, dist: Dist | None = None, forced_changes: list[str] | None = None) -> State:
    """Record the run, load (or warm-start) the policy, restore a checkpoint when resuming, start
    the engine and evaluate the starting policy. A failure once the run is recorded leaves it
    ``failed`` with the reason (or ``interrupted``), never ``running``."""
    t_start = time.time()
    dist = dist or Dist()
    torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.seed)
    store.manifest  # noqa: B018  every process reads the run's state before the main one changes it
    start = store.resume_step(checked.vocab_size) if resume else 0  # checks every stored artifact it reads, before any write
    if start:
        ckpt.check_resumable(store.checkpoint_dir(start), dist)  # its DeepSpeed state fits this launch, before anything is written
    dist.barrier()
    if store.writable and not resume:
        if restart:
            store.restart()
        elif store.exists():
            raise MasktrlError(f"run folder {store.root} was started by another process meanwhile; choose another --run (nothing was changed)")
        store.record_config(cfg)
    elif store.writable and forced_changes:
        store.record_config(cfg, forced_changes=forced_changes)  # --resume --force with another config
    wall_before = store.previous_wall_time() if resume else 0.0
    store.set_info(method=cfg.method_name, seed=cfg.seed, steps_planned=cfg.train.steps, status="running", pid=os.getpid(),
                   processes=dist.world, reason=None)
    with store.recording_failure(lambda: {"wall_time_s": wall_before + time.time() - t_start}):
        return _build(cfg, store, checked, progress, start=start if resume else None, rollouts_from=rollouts_from, dist=dist,
                      t_start=t_start, wall_before=wall_before)


def _build(cfg: Config, store: RunStore, checked: checks.Checked, progress, *, start: int | None, rollouts_from: str | None,
           dist: Dist, t_start: float, wall_before: float) -> State:
    """``start``: the checkpoint a resumed run continues from (None: a new run)."""
    task = checked.task
    with dist.loading():  # the main process first: it fills the warm-start cache, the others read it
        model, tokenizer, ws_info = prepare_policy(cfg, task, store.root.parent, progress)
    if not store.is_done("warmstart"):
        store.mark_done("warmstart", [], config_hash=cfg.hash("model", "task", "warmstart"), info=ws_info)
    if cfg.train.gradient_checkpointing:
        checkpointing.enable(model)
        if not checkpointing.shared_prompt_supported(model.base_model):
            _note(progress, dist, "warning: train.gradient_checkpointing: this transformers version drops the KV cache in "
                  "checkpointed layers, so the policy forward runs every response with its own prompt (no prompt sharing; "
                  "metrics column shared_prompt_frac = 0)")
    optimizer, scheduler = make_optimizer(model, cfg.train)
    projection = retention.project(cfg, retention.count_parameters(model), deepspeed_stage=dist.zero_stage)
    if start is not None:
        if start:
            with dist.loading():  # ZeRO-3: the checkpoint loads whole (no zero.Init), prepare shards it
                ckpt.restore(store.checkpoint_dir(start), model, optimizer, scheduler)
        store.rewind(start)  # forget the updates and metrics after that checkpoint
        dist.barrier()
    start = start or 0
    nonfinite_total, nonfinite_run = nonfinite_counts(store.read_metrics()) if start else (0, 0)
    vocab_size = model.get_output_embeddings().weight.shape[0]  # lab_stats; read before ZeRO-3 partitions it
    policy, optimizer = dist.prepare(PolicyForward(model), optimizer)  # model stays the (unwrapped) LM
    if start:
        ckpt.restore_engine_state(store.checkpoint_dir(start), dist, policy)  # DeepSpeed: optimizer shards, fp32 master weights
    store.set_info(disk_projection={"per_step": projection.rollout_step, "per_checkpoint": projection.checkpoint_total,
                                    "per_run": projection.per_run, "bytes_per_token": projection.bytes_per_token})
    _note(progress, dist, projection.summary())
    engine = make_engine(cfg.rollout, model, tokenizer, ws_info.get("path", cfg.model.path), dtype=cfg.model.dtype, seed=cfg.seed)
    if start:
        sync_weights(engine, model, dist)
    source: RolloutSource | None = checked.source
    collect = replace(CollectSettings.from_config(cfg), chat_template=wraps_chat(task, cfg.model.chat_template))
    s = State(
        cfg=cfg, store=store, dist=dist, task=task, model=model, tokenizer=tokenizer, policy=policy, optimizer=optimizer,
        scheduler=scheduler, engine=engine, method=get_method(cfg.method_name),
        params=make_params(cfg.method_name, **cfg.method_params), collect=collect, update=UpdateSettings.from_config(cfg),
        rollouts_from=rollouts_from, source=source,
        rollout_meta=source.meta if source else {"engine": engine.name, "tokenizer": tokenizer_fingerprint(tokenizer), **collect.sampling.__dict__},
        start=start, steps=min(cfg.train.steps, source.num_steps) if source else cfg.train.steps,
        warmstart=ws_info, test_set=task.test_examples(), eval_before=float("nan"), t_start=t_start, wall_before=wall_before,
        nonfinite_total=nonfinite_total, nonfinite_run=nonfinite_run, progress=progress,
        lab=LabStats(vocab_size, cfg.rollout.logprobs_k) if cfg.train.lab_stats else None,
    )
    s.eval_before = _heldout_once(s, "eval/before", 0)
    s.trackers = open_trackers(cfg.train.report_to, store.root, store.name, cfg.to_dict(), dist.is_main)
    s.trackers.log({"eval/heldout/accuracy": s.eval_before}, step=0)
    return s


def nonfinite_counts(rows: list[dict]) -> tuple[int, int]:
    """(steps with a skipped update, how many of the last rows in a row had one) from metrics rows."""
    total = rows[-1].get("nonfinite_steps", 0) if rows else 0
    run = 0
    for row in reversed(rows):
        if not row.get("skipped_updates"):
            break
        run += 1
    return total, run


def rl_step(s: State, step: int) -> dict:
    """One RL step; returns its metrics row (also appended to metrics.jsonl)."""
    t0 = time.time()
    samples, gen_stats = rollout_batch(s, step)  # rollout -> reward -> advantages (or the stored batch)
    sample_ahead(s, step)
    t_rollout = time.time() - t0
    maybe_crash("update", step)
    stats = policy_update(s.policy, s.optimizer, s.scheduler, samples, s.method, s.params, s.update, s.cfg.seed, step, s.dist,
                          before=s.lab) if samples else {}
    sync_weights(s.engine, s.model, s.dist)
    s.store.mark_done(f"step/{step:06d}/train", [], defer=True)  # written with the next manifest write
    row = {
        "step": step,
        **gen_stats,
        **stats,
        "clip_frac": stats.get("mask_frac"),
        "rollout_time_s": t_rollout,
        "step_time_s": time.time() - t0,
        "tokens_per_s": gen_stats["tokens"] / max(time.time() - t0, 1e-9),
        "lr": s.scheduler.get_last_lr()[0],
    }
    skipped = stats.get("skipped_updates", 0)
    s.nonfinite_total += bool(skipped)
    s.nonfinite_run = s.nonfinite_run + 1 if skipped else 0
    row.update(skipped_updates=skipped, nonfinite_steps=s.nonfinite_total)
    if s.lab is not None:  # rl/lab_stats.py: can the methods differ here?
        row.update(s.lab.row(samples, s.dist))
    row.update(step_evals(s, step))
    s.store.append_metrics(row)
    s.trackers.log(row)
    if s.nonfinite_run >= s.cfg.train.max_nonfinite_steps:
        first = step - s.nonfinite_run + 1
        raise NonFiniteError(
            f"steps {first}-{step}: {s.nonfinite_run} steps in a row with a non-finite loss or gradient norm (not applied); "
            f"the run stops (train.max_nonfinite_steps={s.cfg.train.max_nonfinite_steps}): lower train.lr or check the rollouts"
        )
    return row


def finish(s: State) -> TrainResult:
    """Evaluate the final policy, write summary.json and mark the run complete."""
    cfg = s.cfg
    eval_after = _heldout_once(s, "eval/after", s.steps)
    s.trackers.log({"eval/heldout/accuracy": eval_after}, step=s.steps)
    s.trackers.close()
    summary = {
        "run": s.store.name,
        "method": cfg.method_name,
        "method_params": s.params.__dict__,
        "seed": cfg.seed,
        "steps": s.steps,
        "eval_before": s.eval_before,
        "eval_after": eval_after,
        "eval_split": f"{s.task.name} held-out, n={len(s.test_set)}",
        "eval_decoding": "greedy" if cfg.eval.greedy else f"sampled (T={cfg.rollout.temperature})",
        "warmstart": {k: s.warmstart.get(k) for k in ("source", "cached", "time_s", "final_loss", "steps_done")},
        "rollouts_from": s.rollouts_from,
        "wall_time_s": s.wall_time(),  # every session of the run (resumes included)
    }
    if s.lab is not None:
        summary["lab_stats"] = s.lab.summary(s.store.read_metrics())
    if s.store.writable:
        s.store.sync_metrics()
        atomic_write_json(s.store.root / "summary.json", summary)
    s.store.mark_done("summary", [s.store.root / "summary.json"], step=s.steps)
    s.store.set_info(status="complete", wall_time_s=summary["wall_time_s"])
    s.dist.barrier()
    return TrainResult(summary, s.store, s.dist.is_main)


def sample_ahead(s: State, step: int) -> None:
    """``rollout.staleness`` = k: collect and store now, with the policy after step ``step`` - 1,
    the batches of steps ``step`` + 1 .. ``step`` + k that are neither sampled yet nor stored (by
    the run before a resume). Every process takes the same decisions: from the batches it holds
    and the manifest as read at setup (the other processes' view is not updated)."""
    if s.source:
        return  # --rollouts-from: the batches are used as stored
    for ahead in range(step + 1, min(step + s.cfg.rollout.staleness, s.steps) + 1):
        if ahead not in s.ahead and not s.store.is_done(f"step/{ahead:06d}/rollout"):
            s.ahead[ahead] = rollout_batch(s, ahead)


def rollout_batch(s: State, step: int) -> tuple[list, dict]:
    """The step's batch with rewards and advantages, and its statistics: sampled ahead
    (``sample_ahead``), stored (a resumed run reuses it, hash checked), replayed from
    ``--rollouts-from``, or collected; stored if new."""
    if step in s.ahead:
        return s.ahead.pop(step)
    if s.store.is_done(f"step/{step:06d}/rollout"):
        samples, meta = s.store.read_rollouts(step, verify=True, vocab_size=s.model.config.vocab_size)
        return samples, meta["stats"]
    if s.source:
        samples, gen_stats = s.source.batch(step)
    else:
        samples, gen_stats = collect_rollouts(s.engine, s.tokenizer, s.task, s.method, s.params, s.collect, step, s.dist)
    maybe_crash("rollout-write", step)
    s.store.write_rollouts(step, samples, {**s.rollout_meta, "stats": gen_stats})
    return samples, gen_stats


def step_evals(s: State, step: int) -> dict:
    """The evaluations due after ``step``: held-out accuracy every ``train.eval_every`` steps and
    the ``train.eval_benchmarks`` (``periodic_eval``)."""
    row = {}
    if s.cfg.train.eval_every and step % s.cfg.train.eval_every == 0 and step < s.steps:
        row["eval/heldout/accuracy"] = _heldout(s)
    row.update(periodic_eval(s.cfg, s.store, s.engine, s.tokenizer, step, s.steps, write=s.store.writable))
    return row


def apply_retention(s: State) -> None:
    """After a checkpoint is recorded: delete what ``train.keep_checkpoints`` / ``keep_steps`` and
    ``rollout.store`` no longer keep (``runs/retention.py``). The defaults keep everything."""
    t = s.cfg.train
    if s.store.writable and (t.keep_checkpoints is not None or s.cfg.rollout.store != "all"):
        retention.prune(s.store, t.keep_checkpoints, t.keep_steps, s.cfg.rollout.store)


def _note(progress, dist: Dist, text: str) -> None:
    """One line for the user, from the main process (above the progress bar when there is one)."""
    if not dist.is_main:
        return
    console = getattr(progress, "console", None)  # a rich Progress; other progress objects have none
    if console is not None:
        console.print(text, highlight=False, markup=False)
    else:
        print(text, flush=True)


def sync_weights(engine, model, dist: Dist) -> None:
    with dist.gathered(model):  # ZeRO-3: the engine reads whole weights
        engine.sync_weights(model)


def _heldout(s: State) -> float:
    cfg = s.cfg
    return heldout_accuracy(s.engine, s.tokenizer, s.task, s.test_set, s.collect.sampling, cfg.eval.greedy,
                            s.collect.chat_template, cfg.seed)


def _heldout_once(s: State, stage: str, step: int) -> float:
    """Held-out accuracy of the policy after ``step`` updates, recorded as ``stage`` (eval/before:
    step 0, eval/after: the last step) with its step; a resumed run reads it back if it measured
    the same step (a run extended with more steps measures its new last step)."""
    entry = s.store.stage(stage)
    if entry is not None and entry.get("status") == "done" and entry.get("step", 0 if stage == "eval/before" else None) == step:
        return entry["accuracy"]
    accuracy = _heldout(s)
    s.store.mark_done(stage, [], accuracy=accuracy, step=step)
    return accuracy
