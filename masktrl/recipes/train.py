"""``masktrl train`` as a recipe: setup, the loop, the RL step and evaluation. ``train(plan)``
is the one way in (a plan from ``runs/plan.py``): every check before anything is written
(``rl/checks.py``), then the run's session (``runs/session.py``: the lock, the plan confirmed,
the run recorded, the status on any way out, retention, the summary) around ``setup`` (builds
everything once), ``rl_step`` per step (rollout -> reward -> advantages -> update -> record)
and ``finish`` (evaluates, writes the summary), with Ctrl-C and checkpoints around the steps.

Every random draw comes from a stream named by (seed, purpose, step) (``masktrl.seeding``), so a
resumed run reproduces an uninterrupted one: it restarts from the newest complete checkpoint
(``rl/start.py: restore_run``; every artifact it reads checked first by the store), cuts
``metrics.jsonl`` back to that step and reuses the rollout batches stored for later steps. On
CPU with the same seed the final weights are bit-identical to an uninterrupted run, with one
process, DDP, ZeRO-2 and ZeRO-3.

With ``rollout.staleness`` = s the batches are sampled s steps ahead: step S first stores the
batches of steps S+1..S+s not stored yet, sampled by the policy after step S-1, so step S trains
on a batch sampled by the policy after step S-1-s (the starting policy for the first ones).
``train.lab_stats`` adds whether the methods can differ to every row (``rl/lab_stats.py``).
Under ``accelerate launch`` (``rl/distributed.py``, docs/CLUSTER.md) every process generates
its share of the prompt groups, all hold the whole batch, and ``policy_update`` trains each on
its part of every minibatch; only the main process writes. SIGTERM is a Ctrl-C
(``rl/signals.py``); ``train.max_nonfinite_steps`` steps in a row whose update was not applied
(a non-finite loss or gradient norm) stop the run (docs/RELIABILITY.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from masktrl.models.loading import tokenizer_fingerprint
from masktrl.rl import checks, partial
from masktrl.rl import train_state as ckpt
from masktrl.rl.agentic import with_environment
from masktrl.rl.collect import Batch, CollectSettings, collect_rollouts, reward_failures
from masktrl.rl.distributed import Dist, accelerated
from masktrl.rl.evaluation import heldout_accuracy, no_tool_accuracy, periodic_eval
from masktrl.rl.lab_stats import LabStats
from masktrl.rl.mismatch import UpdateLogp, batch_mismatch, mismatch_source, progress_info
from masktrl.rl.policy import PolicyForward, enable_routing_replay
from masktrl.rl.reference import make_reference, micro_batch_size, penalise_kl, reference_logprobs
from masktrl.rl.run_state import Counters, ModelParts, NonFiniteError, RunServices, State, TrainResult
from masktrl.rl.schedule import age_metrics, staleness_cap, token_age_metrics
from masktrl.rl.signals import GracefulStop, Interrupted, graceful_stop
from masktrl.rl.start import load_policy, restore_run
from masktrl.rl.tracking import Trackers, open_trackers
from masktrl.rl.update import Hooks, Learner, UpdateSettings, make_optimizer, policy_update
from masktrl.rollout import make_engine
from masktrl.rollout.base import RolloutEngine, Sample
from masktrl.rollout.partial import PartialEngine
from masktrl.runs import provenance, retention
from masktrl.runs.faults import maybe_crash
from masktrl.runs.plan import Plan
from masktrl.runs.session import Decision, Session
from masktrl.runs.store import EVAL_AFTER_KEY, EVAL_BEFORE_KEY, RunStore, rollout_key, update_key
from masktrl.tasks.prompts import wraps_chat

if TYPE_CHECKING:
    from rich.progress import Progress


def train(
    plan: Plan,
    progress: Progress | None = None,
    *,
    on_start: Callable[[Plan], None] | None = None,
    dist: Dist | None = None,
) -> TrainResult:
    """The one way into training (``masktrl train``, a sweep's run, the Python API: a plan of
    ``runs/plan.py``): the checks, the session opened (``on_start`` sees the plan it confirmed,
    before the first write), setup, the steps, finish. An ``Interrupted`` leaving here carries
    ``run`` (its name) and ``checkpoints`` (its complete checkpoints)."""
    # a bad launch config fails here, before any write
    dist = dist or (Dist.from_launch(plan.cfg.train) if accelerated() else Dist())
    checked = checks.check(plan.cfg, rollouts_from=plan.rollouts_from)  # before anything is written
    session = Session(RunStore(plan.root), plan, dist)
    progress = progress if dist.is_main else None
    s = None
    try:
        with session.locked(), graceful_stop(graceful=False) as stop:  # one writer per run; SIGTERM = Ctrl-C
            decision = session.open(
                checked.vocab_size,
                check=lambda start: checks.check_start(plan, checked, dist, start),
                on_start=on_start,
                say=lambda text: _note(progress, dist, text),
            )
            if decision.mode == "complete":  # checked like any resume (the lock, every artifact), then left as it is
                return TrainResult(decision.summary, session.store, dist.is_main, decision.note)
            with session.recording():  # interrupted or failed, with the reason: never left running
                s = setup(session, decision, checked, progress, dist)
                run_steps(s, stop)
                return finish(s)
    except Interrupted as exc:
        exc.run, exc.checkpoints = plan.root.name, session.store.checkpoints() if session.store.exists() else []
        raise
    finally:
        checked.task.close()  # reward / grading processes
        if s is not None:
            # flushed and closed however the run ends (finish closed them already when it completed)
            s.run.trackers.close()


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
            s.session.checkpointed(step)  # the wall time, then retention
        if progress:
            progress.update(bar, advance=1, info=progress_info(row, s.cfg))
        if stopping:
            raise Interrupted(stop.signum)
    stop.graceful = False


def setup(
    session: Session, decision: Decision, checked: checks.Checked, progress: Progress | None, dist: Dist
) -> State:
    """Everything the steps share, built once on the recorded run (``build_state``)."""
    cfg = session.cfg
    torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.seed)
    count = Counters(start=decision.start, steps=cfg.train.steps)
    return build_state(session, checked, progress, count, resumed=decision.mode == "resume", dist=dist)


def build_state(
    session: Session, checked: checks.Checked, progress: Progress | None, count: Counters, *, resumed: bool, dist: Dist
) -> State:
    """The model parts (``build_parts``), the run's services, the counters; then held-out
    accuracy of the starting policy."""
    cfg, store, task, source = session.cfg, session.store, checked.task, checked.source
    parts, ws_info, vocab_size = build_parts(session, checked, progress, count, resumed=resumed, dist=dist)
    collect = replace(CollectSettings.from_config(cfg), chat_template=wraps_chat(task, cfg.model.chat_template))
    meta = (
        source.meta
        if source
        else {
            "engine": parts.engine.name,
            "tokenizer": tokenizer_fingerprint(parts.tokenizer),
            **collect.sampling.__dict__,
            "rollout_dtype": cfg.rollout.dtype,
            "quantization": cfg.rollout.quantization,
        }
    )
    if source:
        count.steps = min(cfg.train.steps, source.num_steps)
    services = RunServices(
        cfg,
        store,
        dist,
        task,
        collect,
        UpdateSettings.from_config(cfg),
        source,
        meta,
        task.test_examples(),
        LabStats(vocab_size, cfg.rollout.logprobs_k) if cfg.train.lab_stats else None,
        Trackers((), Path("."), ""),
        progress,
    )
    s = State(parts, services, count, ws_info, session.plan.rollouts_from, session)
    count.eval_before = _heldout_once(s, EVAL_BEFORE_KEY, 0)
    services.trackers = open_trackers(cfg.train.report_to, store.root, store.name, cfg.to_dict(), dist.is_main)
    services.trackers.log({"eval/heldout/accuracy": count.eval_before}, step=0)
    return s


def build_parts(
    session: Session, checked: checks.Checked, progress: Progress | None, count: Counters, *, resumed: bool, dist: Dist
) -> tuple[ModelParts, dict, int]:
    """(the model parts, the warm start's info, the logits' width): the policy warm-started or
    restored (``resumed``: from checkpoint ``count.start``), its optimizer, the engine."""
    cfg, store = session.cfg, session.store
    model, tokenizer, ws_info = load_policy(
        cfg, store, checked.task, progress, dist, say=lambda text: _note(progress, dist, text)
    )
    if split := checks.minibatch_split_note(cfg):
        _note(progress, dist, f"warning: {split}")
    method = cfg.method.bind()
    reference = None  # the starting policy, frozen before a resumed run loads its checkpoint (LoRA: adapters off)
    if method.needs_reference:
        reference = make_reference(model, cfg.rollout.temperature, cfg.train.logprob_chunk)
    optimizer, scheduler = make_optimizer(model, cfg.train)
    # LoRA: the adapters are checkpointed
    n_params = retention.count_parameters(model, trainable_only=cfg.model.lora.rank is not None)
    projection = retention.project(cfg, n_params, deepspeed_stage=dist.zero_stage)
    if resumed:  # the checkpoint loaded, what happened after it forgotten, the non-finite counters read back
        count.nonfinite_total, count.nonfinite_run = restore_run(store, count.start, model, optimizer, scheduler, dist)
    vocab_size = model.get_output_embeddings().weight.shape[0]  # lab_stats; read before ZeRO-3 partitions it
    policy, optimizer = dist.prepare(PolicyForward(model), optimizer)  # model stays the (unwrapped) LM
    if count.start:
        # DeepSpeed: optimizer shards, fp32 master weights
        ckpt.restore_engine_state(store.checkpoint_dir(count.start), dist, policy, optimizer)
    store.set_info(disk_projection=projection.info())
    _note(progress, dist, projection.summary())
    engine = make_engine(
        cfg.rollout, model, tokenizer, ws_info.get("path", cfg.model.path), dtype=cfg.model.dtype, seed=cfg.seed
    )
    engine = with_environment(engine, tokenizer, cfg.task)  # task.env: multi-turn episodes
    if cfg.model.routing_replay is not None:  # R3: the engine records its experts, the training forward replays them
        enable_routing_replay(model, engine)
    # a low-precision copy is made from whole weights (ZeRO-3)
    if count.start or getattr(engine, "copy", None) is not None:
        sync_weights(engine, model, dist)
    return ModelParts(model, tokenizer, policy, optimizer, scheduler, engine, method, reference), ws_info, vocab_size


def rl_step(s: State, step: int) -> dict:
    """One RL step: rollout -> reward -> advantages (``rollout_batch``) -> update -> record;
    returns its metrics row (also appended to metrics.jsonl)."""
    t0 = time.time()
    batch = rollout_batch(s, step)  # rollout -> reward -> advantages (or the stored batch)
    sample_ahead(s, step)
    old = partial.snapshot(s, step)  # rollout.partial: the policy the batches a sync lands in start with
    t_rollout = time.time() - t0
    maybe_crash("update", step)
    stats = update(s, batch.samples, step)
    sample_ahead(s, step, old)
    row = record(s, step, batch, stats, t0=t0, t_rollout=t_rollout)
    check_finite(s, step)
    return row


def update(s: State, samples: list[Sample], step: int) -> dict:
    """The policy update on the batch (nothing to train on: no update), the engine given the new
    weights, the step's update recorded."""
    p, r = s.parts, s.run
    penalty = {}
    # docs/METHODS.md §13.2: the rewards, then the advantages, before the update
    if p.method.params.kl_in_reward and samples:
        micro = micro_batch_size(len(samples), r.update.minibatches, r.update.grad_accum)
        penalty = penalise_kl(samples, reference_logprobs(p.reference, samples, micro), p.method)
    # mismatch/* at no extra forward
    logp = UpdateLogp(then=r.lab) if samples and mismatch_from(s) == "update" else None
    stats = (
        policy_update(
            Learner(p.policy, p.optimizer, p.scheduler),
            samples,
            r.update,
            step,
            r.dist,
            hooks=Hooks(before=logp or r.lab, old=logp.old if logp is not None else None),
            reference=p.reference,
        )
        if samples
        else {}
    )
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
        "rollout_time_s": t_rollout,
        "step_time_s": time.time() - t0,
        "tokens_per_s": batch.stats["tokens"] / max(time.time() - t0, 1e-9),
        "lr": s.parts.scheduler.get_last_lr()[0],
    }
    skipped = stats.get("skipped_updates", 0)
    c.nonfinite_total += bool(skipped)
    c.nonfinite_run = c.nonfinite_run + 1 if skipped else 0
    row.update(skipped_updates=skipped, nonfinite_steps=c.nonfinite_total)
    # rollout.staleness as a distribution: the batch's age
    row.update(age_metrics(s.cfg.rollout.staleness, s.cfg.seed, step))
    row.update(token_age_metrics([x.gen.version for x in batch.samples], step))  # rollout.partial
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
            f"steps {step - run + 1}-{step}: {run} steps in a row with a non-finite loss or "
            "gradient norm (not applied); "
            f"the run stops (train.max_nonfinite_steps={limit}): lower train.lr or check the "
            "rollouts"
        )


def finish(s: State) -> TrainResult:
    """Evaluate the final policy, write summary.json and mark the run complete."""
    cfg, c = s.cfg, s.count
    eval_after = _heldout_once(s, EVAL_AFTER_KEY, c.steps)
    s.run.trackers.log({"eval/heldout/accuracy": eval_after}, step=c.steps)
    s.run.trackers.close()
    summary = {
        "run": s.store.name,
        "method": cfg.method_name,
        "method_params": cfg.method.params.__dict__,
        "seed": cfg.seed,
        "steps": c.steps,
        "eval_before": c.eval_before,
        "eval_after": eval_after,
        "eval_split": f"{s.run.task.name} held-out, n={len(s.run.test_set)}",
        "eval_decoding": "greedy" if cfg.eval.greedy else f"sampled (T={cfg.rollout.temperature})",
        "warmstart": {k: s.warmstart.get(k) for k in ("source", "cached", "time_s", "final_loss", "steps_done")},
        "rollouts_from": s.rollouts_from,
        "wall_time_s": s.session.wall_time(),  # every session of the run (resumes included)
        "machine": provenance.machine(cfg.train.threads),  # CPU model, threads, commit: "same machine" is checkable
    }
    if (no_tool := _heldout(s, no_tool_accuracy)) is not None:  # task kb: the policy forbidden to call the tool
        summary["eval_after_no_tool"] = no_tool
    if s.run.lab is not None:
        summary["lab_stats"] = s.run.lab.summary(s.store.read_metrics())
    s.session.complete(summary, c.steps)
    return TrainResult(summary, s.store, s.run.dist.is_main)


def sample_ahead(s: State, step: int, old: torch.nn.Module | None = None) -> None:
    """``rollout.staleness`` = k: collect and store now, with the policy after step ``step`` - 1,
    the batches of steps ``step`` + 1 .. ``step`` + k that are neither sampled yet nor stored (by
    the run before a resume). Every process takes the same decisions: from the batches it holds
    and the manifest as read at setup (the other processes' view is not updated). ``old``
    (rollout.partial, after the update): the batches a weight sync lands in, from ``old`` (that
    policy, copied) up to the drawn position and from the updated policy after it (rl/partial.py)."""
    for ahead, at in partial.due_batches(s, step):  # rl/schedule.py: the batch ages
        if at is None and old is None:
            s.count.ahead[ahead] = rollout_batch(s, ahead)
        elif at is not None and old is not None:
            engine = PartialEngine(s.parts.engine, old, s.parts.model, at, (step - 1, step))
            s.count.ahead[ahead] = rollout_batch(s, ahead, engine, old)


def rollout_batch(
    s: State, step: int, engine: RolloutEngine | None = None, old: torch.nn.Module | None = None
) -> Batch:
    """The step's batch with rewards and advantages, and its statistics: sampled ahead
    (``sample_ahead``), stored (a resumed run reuses it, hash checked), replayed from
    ``--rollouts-from``, or collected (by ``engine``, default the run's; ``old``: the policy a
    partial batch started with); stored if new."""
    p, r = s.parts, s.run
    if step in s.count.ahead:
        return s.count.ahead.pop(step)
    if s.store.is_done(rollout_key(step)):
        samples, meta = s.store.read_rollouts(step, vocab_size=p.model.config.vocab_size)
        return Batch(samples, meta["stats"])
    if r.source:
        batch = r.source.batch(step)
    else:
        batch = collect_rollouts(engine or p.engine, p.tokenizer, r.task, p.method, r.collect, step, r.dist)
        partial.stamp_versions(s, batch.samples, step)  # rollout.partial: each token's policy version
        # past the limit: stops
        warning = reward_failures(r.task, batch, step, s.cfg.rollout.n, s.cfg.task.max_reward_error_frac)
        if warning:
            _note(r.progress, r.dist, f"warning: {warning}")
        # the engine's gap to the trainer, at the weights that sampled the batch (rl/mismatch.py)
        how = mismatch_from(s)
        if how is not None:  # "update": log pi_old comes from the update's own forward; only MoE routing flips here
            batch.stats.update(batch_mismatch(p.policy, p.model, p.engine, batch.samples, r.update, how, old))
    maybe_crash("rollout-write", step)
    s.store.write_rollouts(step, batch.samples, {**r.rollout_meta, "stats": batch.stats})
    return batch


def mismatch_from(s: State) -> str | None:
    """Where this run's ``mismatch/*`` come from (``rollout.mismatch``; rl/mismatch.py ``mismatch_source``)."""
    r = s.run
    return mismatch_source(
        s.cfg.rollout.mismatch,
        staleness=staleness_cap(s.cfg.rollout.staleness),
        minibatches=r.update.minibatches,
        replay=r.source is not None,
        world=r.dist.world,
        old_forward=r.update.method.correction.needs_old,
    )


def step_evals(s: State, step: int) -> dict:
    """The evaluations due after ``step``: held-out accuracy every ``train.eval_every`` steps and
    the ``train.eval_benchmarks`` (``periodic_eval``)."""
    row = {}
    if s.cfg.train.eval_every and step % s.cfg.train.eval_every == 0 and step < s.count.steps:
        row["eval/heldout/accuracy"] = _heldout(s)
    row.update(
        periodic_eval(s.cfg, s.store, s.parts.engine, s.parts.tokenizer, step, s.count.steps, write=s.store.writable)
    )
    return row


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


def _heldout(s: State, measure=heldout_accuracy) -> float:
    cfg, p, r, c = s.cfg, s.parts, s.run, s.run.collect
    return measure(p.engine, p.tokenizer, r.task, r.test_set, c.sampling, cfg.eval.greedy, c.chat_template, cfg.seed)


def _heldout_once(s: State, stage: str, step: int) -> float:
    """Held-out accuracy of the policy after ``step`` updates, recorded as ``stage`` (eval/before:
    step 0, eval/after: the last step) with its step; a resumed run reads it back if it measured
    the same step (a run extended with more steps measures its new last step)."""
    entry = s.store.stage(stage)
    if (
        entry is not None
        and entry.get("status") == "done"
        and entry.get("step", 0 if stage == EVAL_BEFORE_KEY else None) == step
    ):
        return entry["accuracy"]
    accuracy = _heldout(s)
    s.store.mark_done(stage, [], accuracy=accuracy, step=step)
    return accuracy
