"""``masktrl train`` as a recipe: ``run`` plans the run folder and checks everything once
(``runs/plan.py``, ``rl/checks.py``); ``train`` takes the run's lock, confirms the plan under
it, and runs ``setup`` (builds everything once), ``rl_step`` per step (rollout -> reward ->
advantages -> update -> record) and ``finish`` (evaluates, writes the summary), with Ctrl-C and
checkpoints around the steps.

Every random draw comes from a stream named by (seed, purpose, step) (``masktrl.seeding``), so a
resumed run reproduces an uninterrupted one; every artifact is written atomically and recorded
in the manifest only once complete (``runs/store.py``).

Resume restarts from the newest complete checkpoint: the run store checks every artifact the
resumed run will read (``RunStore.resume_step``), then weights, optimizer, scheduler and RNG
states are restored, ``metrics.jsonl`` is cut back to that step, and the rollout batches already
stored for later steps are reused instead of regenerated. Under DeepSpeed each process also
reloads its shard of the optimizer state (``train_state.restore_engine_state``), after checking
the shards fit this launch. On CPU with the same seed the final weights are bit-identical to an
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
from typing import TYPE_CHECKING, Callable

import torch

from masktrl.config import Config
from masktrl.errors import MasktrlError
from masktrl.io import atomic_dir
from masktrl.methods import Method, get_method
from masktrl.models import checkpointing
from masktrl.models.architectures import check_lm_head, shared_prompt_cache_ok
from masktrl.models.loading import tokenizer_fingerprint
from masktrl.models.lora import apply_lora
from masktrl.models.lowprec import apply_training_quantization
from masktrl.models.packing import packing_unsupported
from masktrl.rl import checks
from masktrl.rl import train_state as ckpt
from masktrl.rl.collect import Batch, CollectSettings, batch_changes, collect_rollouts, reward_failures
from masktrl.rl.distributed import Dist, launch_rank, launched
from masktrl.rl.evaluation import heldout_accuracy, periodic_eval
from masktrl.rl.lab_stats import LabStats
from masktrl.rl.mismatch import UpdateLogp, measure_mismatch, mismatch_source
from masktrl.rl.policy import PolicyForward
from masktrl.rl.reference import Reference, make_reference, micro_batch_size, penalise_kl, reference_logprobs
from masktrl.rl.rollout_source import RolloutSource
from masktrl.rl.schedule import age_metrics, sample_now, staleness_cap
from masktrl.rl.signals import GracefulStop, Interrupted, graceful_stop
from masktrl.rl.tracking import Trackers, open_trackers
from masktrl.rl.update import UpdateSettings, make_optimizer, policy_update
from masktrl.rl.warmstart import prepare_policy
from masktrl.rollout import make_engine
from masktrl.rollout.base import RolloutEngine, Sample
from masktrl.runs import retention
from masktrl.runs.faults import maybe_crash
from masktrl.runs.plan import Plan, RunRequest, plan_run, plan_start
from masktrl.runs.store import LORA_BASE_KEY, RunStore, done_steps, rollout_key, update_key
from masktrl.tasks import Example, Task
from masktrl.tasks.prompts import wraps_chat

if TYPE_CHECKING:
    from rich.progress import Progress
    from transformers import PreTrainedTokenizerBase


@dataclass
class TrainResult:
    summary: dict
    store: RunStore
    is_main: bool = True  # False on the other processes of a multi-process run (they print nothing)
    note: str | None = None  # what the command says before the summary (a complete run resumed: nothing was done)


@dataclass
class ModelParts:
    """What a step computes with: the policy, its optimizer, the engine sampling from it, the method."""

    model: torch.nn.Module  # the (unwrapped) language model
    tokenizer: PreTrainedTokenizerBase
    policy: torch.nn.Module  # its training forward, wrapped for DDP / DeepSpeed when launched
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    engine: RolloutEngine
    method: Method  # its parameters: cfg.method_params
    reference: Reference | None = None  # the reference-KL term's policy (rl/reference.py); None without one


@dataclass
class RunServices:
    """Where a step's inputs come from and its results go."""

    cfg: Config
    store: RunStore
    dist: Dist
    task: Task
    collect: CollectSettings
    update: UpdateSettings
    source: RolloutSource | None  # --rollouts-from: stored batches instead of generation
    rollout_meta: dict  # written with every rollout batch
    test_set: list[Example]  # the task's held-out split (eval_before, eval_after, train.eval_every)
    lab: LabStats | None  # train.lab_stats: the before-update hook and the rows' lab/* entries
    trackers: Trackers  # train.report_to (main process)
    progress: Progress | None


@dataclass
class Counters:
    """Where the run stands."""

    start: int  # the last step already done (resume), 0 for a new run
    steps: int  # the last step to do
    t_start: float
    wall_before: float = 0.0  # wall time of the run's earlier sessions (resume)
    eval_before: float = float("nan")
    nonfinite_total: int = 0  # steps so far with an update skipped for a non-finite loss or gradient norm
    nonfinite_run: int = 0  # ... of them in a row, up to the last step
    ahead: dict[int, Batch] = field(default_factory=dict)  # rollout.staleness: batches sampled ahead, not yet trained on

    def wall_time(self) -> float:
        return self.wall_before + time.time() - self.t_start


@dataclass
class State:
    """Everything a run's steps share, built once by ``setup``."""

    parts: ModelParts
    run: RunServices
    count: Counters
    warmstart: dict  # where the starting policy came from (prepare_policy's info)
    rollouts_from: str | None

    @property
    def cfg(self) -> Config:
        return self.run.cfg

    @property
    def store(self) -> RunStore:
        return self.run.store


class NonFiniteError(MasktrlError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


def run(request: RunRequest, progress: Progress | None = None, on_start: Callable[[Plan], None] | None = None) -> TrainResult:
    """``masktrl train``: resolve the request (``plan_run``: the folder, the config, what to do
    with the folder), run every check before anything is written, then ``train``. ``on_start``
    sees the plan confirmed under the run's lock, before the first write. An ``Interrupted``
    leaving here carries ``run`` (its name) and ``checkpoints`` (its complete checkpoints)."""
    plan = plan_run(request, main=launch_rank() == 0)
    checked = checks.check(plan.cfg, rollouts_from=plan.rollouts_from, out=Path(request.out))
    store = RunStore(plan.root)
    try:
        return train(plan.cfg, store, progress, rollouts_from=plan.rollouts_from, checked=checked, plan=plan, on_start=on_start)
    except Interrupted as exc:
        exc.run, exc.checkpoints = plan.root.name, store.checkpoints() if store.exists() else []
        raise


def _complete(plan: Plan) -> TrainResult | None:
    """``--resume`` of a complete run with its own config: nothing to do, nothing written (its
    summary is returned as it is); None for anything else."""
    if not plan.explicit_resume or plan.forced_changes:
        return None
    store = RunStore(plan.root, writable=False)
    if store.status() != "complete" or store.summary() is None:
        return None
    summary = store.summary()
    note = (f"run {plan.root.name} is complete ({summary.get('steps')} of {plan.cfg.train.steps} steps): nothing to do "
            "(--resume NAME --force --set train.steps=N extends it)")
    return TrainResult(summary, store, launch_rank() == 0, note)


def train(cfg: Config, store: RunStore, progress: Progress | None = None, *, resume: bool = False, restart: bool = False,
          rollouts_from: str | None = None, dist: Dist | None = None, checked: checks.Checked | None = None,
          forced_changes: list[str] | None = None, plan: Plan | None = None,
          on_start: Callable[[Plan], None] | None = None) -> TrainResult:
    """The whole run under the run's lock: the checks (``checked``: already done by the caller),
    the plan confirmed (``plan``; else ``resume`` / ``restart`` as given: ``restart`` starts a
    failed or interrupted run with no checkpoint again from scratch), setup, the RL steps, then
    ``finish``. ``forced_changes``: the keys ``--resume --force`` changed, recorded with the new
    config once the checkpoint is known to fit this launch."""
    dist = dist or (Dist.from_launch(cfg.train) if launched() else Dist())  # a bad launch config fails here, before any write
    checked = checked or checks.check(cfg, rollouts_from=rollouts_from)  # before anything is written
    if not dist.is_main:
        store, progress = store.read_only(), None
    s = None
    try:
        with store.writing(), graceful_stop(graceful=False) as stop:  # one writer per run; SIGTERM = Ctrl-C
            if dist.is_main:
                store.settle()  # what a crash cut short (a run.yaml rename, a restart's deletions) is finished first
            if plan is not None:
                plan = confirm(plan, store, checked.vocab_size) if dist.is_main else plan
                done = _complete(plan)  # checked like any resume (the lock, every artifact), then left as it is
                if done is not None:
                    return done
                resume, restart, forced_changes = plan.start.mode == "resume", plan.start.mode == "restart", plan.forced_changes
            resume, restart = dist.broadcast((resume, restart))  # the main process decided what to do with the folder
            if on_start is not None and plan is not None and dist.is_main:  # the header once, not once per process
                on_start(plan)
            s = setup(cfg, store, checked, progress, resume=resume, restart=restart, rollouts_from=rollouts_from, dist=dist,
                      forced_changes=forced_changes)
            with s.store.recording_failure(lambda: {"wall_time_s": s.count.wall_time()}):
                run_steps(s, stop)
                return finish(s)
    finally:
        checked.task.close()  # reward / grading processes
        if s is not None:
            s.run.trackers.close()  # flushed and closed however the run ends (finish closed them already when it completed)


def confirm(plan: Plan, store: RunStore, vocab_size: int) -> Plan:
    """The plan again under the run's lock (another process may have moved the run on since it
    was made), and for a resume every artifact the resumed run reads checked, before any write."""
    if plan.start.mode == "new":
        return plan  # setup refuses a folder that another process created meanwhile
    if not plan.explicit_resume:
        plan = replace(plan, start=plan_start(plan.root, plan.cfg))
    if plan.start.mode == "resume":
        store.check_resumable()
        store.resume_step(vocab_size)
    return plan


def progress_info(row: dict, cfg: Config) -> str:
    """The RL bar's text: reward and throughput, and, when the engine samples from something other
    than the model itself (another dtype, FP8, vLLM), the step's mean |log μ − log π_old| of the
    sampled tokens (``mismatch/logp_abs_mean``, rl/mismatch.py)."""
    info = f"reward {row['reward_mean']:.3f}  {row['tokens_per_s']:.0f} tok/s"
    r = cfg.rollout
    other = r.engine != "hf" or r.quantization is not None or r.dtype not in (None, cfg.model.dtype)
    gap = row.get("mismatch/logp_abs_mean")
    if other and isinstance(gap, float) and gap == gap:  # nan when no token was measured
        info += f"  |Δlogp| {gap:.3f}"
    return info


def run_steps(s: State, stop: GracefulStop) -> None:
    """``rl_step`` for every step left: a checkpoint every ``train.checkpoint_every``, at each of
    ``train.keep_steps``, at the end, and when Ctrl-C or SIGTERM asks to stop (retention applied
    after each)."""
    t, p, c = s.cfg.train, s.parts, s.count
    progress = s.run.progress
    bar = progress.add_task("RL", total=c.steps, completed=c.start, info="") if progress else None
    stop.graceful = True  # a signal now finishes the step and checkpoints it
    for step in range(c.start + 1, c.steps + 1):
        row = rl_step(s, step)
        stopping = s.run.dist.broadcast(stop.requested)  # every process stops after the same step
        if step % t.checkpoint_every == 0 or step == c.steps or step in t.keep_steps or stopping:
            ckpt.save_step(s.store, step, p.model, p.tokenizer, p.optimizer, p.scheduler, s.run.dist, p.policy)
            s.store.set_info(wall_time_s=c.wall_time())
            apply_retention(s)
        if progress:
            progress.update(bar, advance=1, info=progress_info(row, s.cfg))
        if stopping:
            raise Interrupted(stop.signum)
    stop.graceful = False


def setup(cfg: Config, store: RunStore, checked: checks.Checked, progress: Progress | None = None, *, resume: bool = False,
          restart: bool = False, rollouts_from: str | None = None, dist: Dist | None = None,
          forced_changes: list[str] | None = None) -> State:
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
    if resume and forced_changes:
        _drop_stale_batches(store, start, forced_changes, progress, dist)
    dist.barrier()
    if resume and forced_changes and not store.writable:
        store.reload()  # the main process may have dropped stored batches
    wall_before = store.recorded_wall_time() if resume else 0.0
    # The run's entries go in the same manifest write as the config record: no kill window
    # between them (docs/RELIABILITY.md, Fault injection).
    running = dict(method=cfg.method_name, seed=cfg.seed, steps_planned=cfg.train.steps, status="running", pid=os.getpid(),
                   processes=dist.world, reason=None)
    if store.writable and not resume:
        if restart:
            store.restart(cfg, run=running)
        elif store.exists():
            raise MasktrlError(f"run folder {store.root} was started by another process meanwhile; choose another --run (nothing was changed)")
        else:
            store.record_config(cfg, run=running)
    elif store.writable and forced_changes:
        store.record_config(cfg, run=running, forced_changes=forced_changes)  # --resume --force with another config
    else:
        store.set_info(**running)
    count = Counters(start=start, steps=cfg.train.steps, t_start=t_start, wall_before=wall_before)
    with store.recording_failure(lambda: {"wall_time_s": count.wall_time()}):
        return build_state(cfg, store, checked, progress, count, resumed=resume, rollouts_from=rollouts_from, dist=dist)


def _drop_stale_batches(store: RunStore, start: int, changed: list[str], progress: Progress | None, dist: Dist) -> None:
    """``--resume --force`` with keys that made the batches stored after the checkpoint (the
    sampling, the reward, the seed...: ``collect.batch_changes``): those batches are deleted and
    sampled again with the new settings, and the command says which."""
    keys = batch_changes(changed)
    later = [s for s in done_steps(store.manifest["stages"], "rollout") if s > start] if keys else []
    if not later:
        return
    store.drop_rollouts_after(start)
    what = f"batch of step {later[0]} was" if len(later) == 1 else f"batches of steps {later[0]}-{later[-1]} were"
    them = "it" if len(later) == 1 else "them"
    _note(progress, dist, f"the stored rollout {what} sampled with other settings ({', '.join(keys)}): sampling {them} again")


def build_state(cfg: Config, store: RunStore, checked: checks.Checked, progress: Progress | None, count: Counters, *,
                resumed: bool, rollouts_from: str | None, dist: Dist) -> State:
    """The model parts (the policy warm-started or restored), the run's services, the counters;
    then held-out accuracy of the starting policy."""
    task = checked.task
    model, tokenizer, ws_info = load_policy(cfg, store, task, progress, dist)
    method = get_method(cfg.method_name)
    reference = None  # the starting policy, frozen before a resumed run loads its checkpoint (LoRA: adapters off)
    if method.needs_reference(cfg.method_params):
        reference = make_reference(model, cfg.rollout.temperature, cfg.train.logprob_chunk)
    optimizer, scheduler = make_optimizer(model, cfg.train)
    n_params = retention.count_parameters(model, trainable_only=cfg.model.lora.rank is not None)  # LoRA: the adapters are checkpointed
    projection = retention.project(cfg, n_params, deepspeed_stage=dist.zero_stage)
    if resumed:
        restore(store, count, model, optimizer, scheduler, dist)
    vocab_size = model.get_output_embeddings().weight.shape[0]  # lab_stats; read before ZeRO-3 partitions it
    policy, optimizer = dist.prepare(PolicyForward(model), optimizer)  # model stays the (unwrapped) LM
    if count.start:
        ckpt.restore_engine_state(store.checkpoint_dir(count.start), dist, policy)  # DeepSpeed: optimizer shards, fp32 master weights
    store.set_info(disk_projection={"per_step": projection.rollout_step, "per_checkpoint": projection.checkpoint_total,
                                    "per_run": projection.per_run, "bytes_per_token": projection.bytes_per_token})
    _note(progress, dist, projection.summary())
    engine = make_engine(cfg.rollout, model, tokenizer, ws_info.get("path", cfg.model.path), dtype=cfg.model.dtype, seed=cfg.seed)
    if count.start or getattr(engine, "copy", None) is not None:  # a low-precision copy is made from whole weights (ZeRO-3)
        sync_weights(engine, model, dist)
    source = checked.source
    collect = replace(CollectSettings.from_config(cfg), chat_template=wraps_chat(task, cfg.model.chat_template))
    meta = source.meta if source else {"engine": engine.name, "tokenizer": tokenizer_fingerprint(tokenizer), **collect.sampling.__dict__,
                                       "rollout_dtype": cfg.rollout.dtype, "quantization": cfg.rollout.quantization}
    if source:
        count.steps = min(cfg.train.steps, source.num_steps)
    parts = ModelParts(model, tokenizer, policy, optimizer, scheduler, engine, method, reference)
    services = RunServices(cfg, store, dist, task, collect, UpdateSettings.from_config(cfg), source, meta, task.test_examples(),
                           LabStats(vocab_size, cfg.rollout.logprobs_k) if cfg.train.lab_stats else None,
                           Trackers((), Path("."), ""), progress)
    s = State(parts, services, count, ws_info, rollouts_from)
    count.eval_before = _heldout_once(s, "eval/before", 0)
    services.trackers = open_trackers(cfg.train.report_to, store.root, store.name, cfg.to_dict(), dist.is_main)
    services.trackers.log({"eval/heldout/accuracy": count.eval_before}, step=0)
    return s


def load_policy(cfg: Config, store: RunStore, task: Task, progress: Progress | None, dist: Dist):
    """(model, tokenizer, info): the warm-started tiny model or the configured one, recorded as
    stage ``warmstart``, its head checked, LoRA adapters on it when ``model.lora`` asks;
    gradient checkpointing switched on when asked."""
    with dist.loading():  # the main process first: it fills the warm-start cache, the others read it
        model, tokenizer, ws_info = prepare_policy(cfg, task, store.root.parent, progress)
    if not store.is_done("warmstart"):
        store.mark_done("warmstart", [], config_hash=cfg.hash("model", "task", "warmstart"), info=ws_info)
    if cfg.train.packing and (reason := packing_unsupported(model)):
        raise MasktrlError(f"train.packing: {reason}; set train.packing=false")
    check_lm_head(model)  # the chunked log-probs assume logits = h W^T: a soft-capped or scaled head is refused
    if cfg.model.lora.rank is not None:
        apply_lora(model, checks.lora_settings(cfg), seed=cfg.seed, base=lora_base(cfg, store, model, tokenizer, dist))
    shareable, why = shared_prompt_cache_ok(model.base_model)
    if not shareable:
        _note(progress, dist, f"warning: the shared-prompt forward is off for this model ({why}): every response runs with its "
              "own prompt (metrics column shared_prompt_frac = 0)")
    apply_training_quantization(model, cfg.train.quantization, cfg.train.quantization_backend)  # FP8 training (models/lowprec.py)
    if cfg.train.gradient_checkpointing:
        checkpointing.enable(model)
        if not checkpointing.shared_prompt_supported(model.base_model):
            _note(progress, dist, "warning: train.gradient_checkpointing: this transformers version drops the KV cache in "
                  "checkpointed layers, so the policy forward runs every response with its own prompt (no prompt sharing; "
                  "metrics column shared_prompt_frac = 0)")
    return model, tokenizer, ws_info


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


def restore(store: RunStore, count: Counters, model, optimizer, scheduler, dist: Dist) -> None:
    """A resumed run: the checkpoint ``count.start`` loaded (none at step 0), what happened after
    it forgotten, and the non-finite counters read back from the metrics rows."""
    if count.start:
        with dist.loading():  # ZeRO-3: the checkpoint loads whole (no zero.Init), prepare shards it
            ckpt.restore(store.checkpoint_dir(count.start), model, optimizer, scheduler)
    store.rewind(count.start)  # forget the updates and metrics after that checkpoint
    dist.barrier()
    if count.start:
        count.nonfinite_total, count.nonfinite_run = nonfinite_counts(store.read_metrics())


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
    """One RL step: rollout -> reward -> advantages (``rollout_batch``) -> update -> record;
    returns its metrics row (also appended to metrics.jsonl)."""
    t0 = time.time()
    batch = rollout_batch(s, step)  # rollout -> reward -> advantages (or the stored batch)
    sample_ahead(s, step)
    t_rollout = time.time() - t0
    maybe_crash("update", step)
    stats = update(s, batch.samples, step)
    row = record(s, step, batch, stats, t0=t0, t_rollout=t_rollout)
    check_finite(s, step)
    return row


def update(s: State, samples: list[Sample], step: int) -> dict:
    """The policy update on the batch (nothing to train on: no update), the engine given the new
    weights, the step's update recorded."""
    p, r = s.parts, s.run
    params = s.cfg.method_params
    penalty = {}
    if params.kl_in_reward and samples:  # docs/METHODS.md §13.2: the rewards, then the advantages, before the update
        micro = micro_batch_size(len(samples), r.update.minibatches, r.update.grad_accum)
        penalty = penalise_kl(samples, reference_logprobs(p.reference, samples, micro), p.method, params)
    logp = UpdateLogp(then=r.lab) if samples and mismatch_from(s) == "update" else None  # mismatch/* at no extra forward
    stats = policy_update(p.policy, p.optimizer, p.scheduler, samples, p.method, params, r.update, s.cfg.seed, step,
                          r.dist, before=logp or r.lab, reference=p.reference) if samples else {}
    stats.update(penalty)
    if logp is not None:
        stats.update(logp.stats(samples))
    sync_weights(p.engine, p.model, r.dist)
    s.store.mark_done(update_key(step), [], defer=True)  # written with the next manifest write
    return stats


def record(s: State, step: int, batch: Batch, stats: dict, *, t0: float, t_rollout: float) -> dict:
    """The step's metrics row: the rollout's statistics, the update's, timings, the learning
    rate, the non-finite counters, lab statistics and the evaluations due; appended to
    metrics.jsonl and sent to the trackers."""
    c = s.count
    row = {
        "step": step,
        **batch.stats,
        **stats,
        "clip_frac": stats.get("mask_frac"),
        "rollout_time_s": t_rollout,
        "step_time_s": time.time() - t0,
        "tokens_per_s": batch.stats["tokens"] / max(time.time() - t0, 1e-9),
        "lr": s.parts.scheduler.get_last_lr()[0],
    }
    skipped = stats.get("skipped_updates", 0)
    c.nonfinite_total += bool(skipped)
    c.nonfinite_run = c.nonfinite_run + 1 if skipped else 0
    row.update(skipped_updates=skipped, nonfinite_steps=c.nonfinite_total)
    row.update(age_metrics(s.cfg.rollout.staleness, s.cfg.seed, step))  # rollout.staleness as a distribution: the batch's age
    if s.run.lab is not None:  # rl/lab_stats.py: can the methods differ here?
        row.update(s.run.lab.row(batch.samples, s.run.dist))
    row.update(step_evals(s, step))
    s.store.append_metrics(row)
    s.run.trackers.log(row)
    return row


def check_finite(s: State, step: int) -> None:
    """NonFiniteError after ``train.max_nonfinite_steps`` steps in a row whose update was not applied."""
    run, limit = s.count.nonfinite_run, s.cfg.train.max_nonfinite_steps
    if run >= limit:
        raise NonFiniteError(
            f"steps {step - run + 1}-{step}: {run} steps in a row with a non-finite loss or gradient norm (not applied); "
            f"the run stops (train.max_nonfinite_steps={limit}): lower train.lr or check the rollouts"
        )


def finish(s: State) -> TrainResult:
    """Evaluate the final policy, write summary.json and mark the run complete."""
    cfg, c = s.cfg, s.count
    eval_after = _heldout_once(s, "eval/after", c.steps)
    s.run.trackers.log({"eval/heldout/accuracy": eval_after}, step=c.steps)
    s.run.trackers.close()
    summary = {
        "run": s.store.name,
        "method": cfg.method_name,
        "method_params": cfg.method_params.__dict__,
        "seed": cfg.seed,
        "steps": c.steps,
        "eval_before": c.eval_before,
        "eval_after": eval_after,
        "eval_split": f"{s.run.task.name} held-out, n={len(s.run.test_set)}",
        "eval_decoding": "greedy" if cfg.eval.greedy else f"sampled (T={cfg.rollout.temperature})",
        "warmstart": {k: s.warmstart.get(k) for k in ("source", "cached", "time_s", "final_loss", "steps_done")},
        "rollouts_from": s.rollouts_from,
        "wall_time_s": c.wall_time(),  # every session of the run (resumes included)
    }
    if s.run.lab is not None:
        summary["lab_stats"] = s.run.lab.summary(s.store.read_metrics())
    s.store.write_summary(summary, step=c.steps)
    s.run.dist.barrier()
    return TrainResult(summary, s.store, s.run.dist.is_main)


def sample_ahead(s: State, step: int) -> None:
    """``rollout.staleness`` = k: collect and store now, with the policy after step ``step`` - 1,
    the batches of steps ``step`` + 1 .. ``step`` + k that are neither sampled yet nor stored (by
    the run before a resume). Every process takes the same decisions: from the batches it holds
    and the manifest as read at setup (the other processes' view is not updated)."""
    if s.run.source:
        return  # --rollouts-from: the batches are used as stored
    for ahead in sample_now(s.cfg.rollout.staleness, s.cfg.seed, step, s.count.steps):  # rl/schedule.py: the batch ages
        if ahead not in s.count.ahead and not s.store.is_done(rollout_key(ahead)):
            s.count.ahead[ahead] = rollout_batch(s, ahead)


def rollout_batch(s: State, step: int) -> Batch:
    """The step's batch with rewards and advantages, and its statistics: sampled ahead
    (``sample_ahead``), stored (a resumed run reuses it, hash checked), replayed from
    ``--rollouts-from``, or collected; stored if new."""
    p, r = s.parts, s.run
    if step in s.count.ahead:
        return s.count.ahead.pop(step)
    if s.store.is_done(rollout_key(step)):
        samples, meta = s.store.read_rollouts(step, vocab_size=p.model.config.vocab_size)
        return Batch(samples, meta["stats"])
    if r.source:
        batch = r.source.batch(step)
    else:
        batch = collect_rollouts(p.engine, p.tokenizer, r.task, p.method, s.cfg.method_params, r.collect, step, r.dist)
        warning = reward_failures(r.task, batch, step, s.cfg.rollout.n, s.cfg.task.max_reward_error_frac)  # past it: stops
        if warning:
            _note(r.progress, r.dist, f"warning: {warning}")
        u, how = r.update, mismatch_from(s)  # the engine's gap to the trainer, at the weights that sampled the batch (rl/mismatch.py)
        if how is not None:  # "update": log pi_old comes from the update's own forward; only MoE routing flips here
            batch.stats.update(measure_mismatch(p.policy, p.model, p.engine, batch.samples, u.temperature, u.logprob_chunk,
                                                u.minibatches * u.grad_accum, routing_only=how == "update"))
    maybe_crash("rollout-write", step)
    s.store.write_rollouts(step, batch.samples, {**r.rollout_meta, "stats": batch.stats})
    return batch


def mismatch_from(s: State) -> str | None:
    """Where this run's ``mismatch/*`` come from (``rollout.mismatch``; rl/mismatch.py ``mismatch_source``)."""
    r = s.run
    return mismatch_source(s.cfg.rollout.mismatch, staleness=staleness_cap(s.cfg.rollout.staleness), minibatches=r.update.minibatches,
                           replay=r.source is not None, world=r.dist.world)


def step_evals(s: State, step: int) -> dict:
    """The evaluations due after ``step``: held-out accuracy every ``train.eval_every`` steps and
    the ``train.eval_benchmarks`` (``periodic_eval``)."""
    row = {}
    if s.cfg.train.eval_every and step % s.cfg.train.eval_every == 0 and step < s.count.steps:
        row["eval/heldout/accuracy"] = _heldout(s)
    row.update(periodic_eval(s.cfg, s.store, s.parts.engine, s.parts.tokenizer, step, s.count.steps, write=s.store.writable))
    return row


def apply_retention(s: State) -> None:
    """After a checkpoint is recorded: delete what ``train.keep_checkpoints`` / ``keep_steps`` and
    ``rollout.store`` no longer keep (``runs/retention.py``). The defaults keep everything."""
    t = s.cfg.train
    if s.store.writable and (t.keep_checkpoints is not None or s.cfg.rollout.store != "all"):
        retention.prune(s.store, t.keep_checkpoints, t.keep_steps, s.cfg.rollout.store)


def _note(progress: Progress | None, dist: Dist, text: str) -> None:
    """One line for the user, from the main process (above the progress bar when there is one)."""
    if not dist.is_main:
        return
    console = getattr(progress, "console", None)  # a rich Progress; other progress objects have none
    if console is not None:
        console.print(text, highlight=False, markup=False)
    else:
        print(text, flush=True)


def sync_weights(engine: RolloutEngine, model: torch.nn.Module, dist: Dist) -> None:
    with dist.gathered(model):  # ZeRO-3: the engine reads whole weights
        engine.sync_weights(model)


def _heldout(s: State) -> float:
    cfg, p, r = s.cfg, s.parts, s.run
    return heldout_accuracy(p.engine, p.tokenizer, r.task, r.test_set, r.collect.sampling, cfg.eval.greedy,
                            r.collect.chat_template, cfg.seed)


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
