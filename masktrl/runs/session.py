"""A run's lifecycle, everything of a training run that is not training: the one owner of the
run folder from the lock to the summary (``recipes/train.py`` holds the loop).

``Session(store, plan, processes)``, then, inside ``session.locked()`` (the run's one-writer
lock, ``runs/locks.py``):

* ``open`` settles what a crash cut short (``RunStore.settle``), confirms the plan under the lock
  (another process may have moved the run on since it was made: ``confirm``), answers a complete
  run resumed with its own config with "complete: nothing to do" (nothing written), checks every
  artifact a resume reads (``RunStore.resume_step``) and whatever else the caller checks before
  a write (``check``: the checkpoint fits the model and the launch), and only then writes: the
  stored batches a ``--resume --force`` made stale are dropped (``stale_batch_keys``), and the
  run is recorded as new, restarted in place, resumed, or resumed with forced changes (the new
  config and the keys it changed). It returns what it decided (``Decision``).
* ``recording()`` records the status on any way out (``interrupted`` or ``failed`` with the
  reason, and the wall time), never leaving ``running`` behind.
* ``checkpointed(step)`` records the wall time and applies retention after each checkpoint
  (``runs/retention.py``); ``complete(summary, step)`` writes the summary and marks the run
  complete. ``wall_time()`` counts every session of the run (resumes included).

Under ``accelerate launch`` only the main process decides and writes; the others follow its
decision (``processes.broadcast``) through a read-only view of the store.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Protocol

from masktrl.errors import MasktrlError
from masktrl.runs import retention
from masktrl.runs.plan import Plan, check_steps_cover, plan_start, source_digest, stale_batch_keys, task_file_digests
from masktrl.runs.store import RunStore, done_steps


class Processes(Protocol):
    """The processes of a launch as the session needs them (``rl.distributed.Dist`` is one)."""

    is_main: bool
    world: int

    def barrier(self) -> None: ...

    def broadcast(self, value): ...


class OneProcess:
    """A launch of one process: nothing to wait for, nothing to share."""

    is_main, world = True, 1

    def barrier(self) -> None:
        pass

    def broadcast(self, value):
        return value


@dataclass
class Decision:
    """What ``Session.open`` decided and did."""

    plan: Plan  # the plan as confirmed under the lock
    mode: str  # new | resume | restart | complete (a complete run resumed with its own config: nothing was done)
    start: int = 0  # the checkpoint the run continues from (0: the starting policy)
    dropped: list[int] = field(default_factory=list)  # stored batches dropped as stale (--resume --force)
    summary: dict | None = None  # complete: the run's summary, as stored
    note: str | None = None  # complete: what the command says


def confirm(plan: Plan, store: RunStore, vocab_size: int | None) -> Plan:
    """The plan again under the run's lock, and for a resume every artifact the resumed run
    reads checked (``RunStore.resume_step``), before any write."""
    if plan.start.mode == "new":
        return plan  # record refuses a folder that another process created meanwhile
    if not plan.explicit_resume:
        plan = replace(plan, start=plan_start(plan.root, plan.cfg))
    if plan.start.mode == "resume":
        store.check_resumable()
        check_steps_cover(plan.cfg, plan.root, store.resume_step(vocab_size))
    return plan


def complete_run(plan: Plan, store: RunStore) -> Decision | None:
    """``--resume`` of a complete run with its own config: nothing to do, nothing written (its
    summary is returned as it is); None for anything else."""
    if not plan.explicit_resume or plan.forced_changes:
        return None
    view = RunStore(plan.root, writable=False)
    if view.status() != "complete" or view.summary() is None:
        return None
    summary = view.summary()
    note = (
        f"run {plan.root.name} is complete ({summary.get('steps')} of {plan.cfg.train.steps} steps): "
        "nothing to do "
        "(--resume NAME --force --set train.steps=N extends it)"
    )
    return Decision(plan, "complete", summary=summary, note=note)


class Session:
    """One run's lifecycle (see the module doc)."""

    def __init__(self, store: RunStore, plan: Plan, processes: Processes | None = None):
        self.processes = processes or OneProcess()
        self.store = store if self.processes.is_main else store.read_only()
        self.plan = plan
        self.t_start = time.time()
        self.wall_before = 0.0  # the wall time of the run's earlier sessions (resume)

    @property
    def cfg(self):
        return self.plan.cfg

    @contextlib.contextmanager
    def locked(self) -> Iterator[Session]:
        """The run's one-writer lock for the block (the main process; the others take none)."""
        with self.store.writing():
            yield self

    def open(
        self,
        vocab_size: int | None,
        *,
        check: Callable[[int], None] | None = None,
        on_start: Callable[[Plan], None] | None = None,
        say: Callable[[str], None] | None = None,
    ) -> Decision:
        """Settle, confirm, check, then record (module doc). ``check(start)`` runs after every
        artifact of the resume was checked and before anything is written; ``on_start`` sees the
        confirmed plan (main process) before the first write; ``say`` tells the user which stored
        batches were dropped."""
        p, store = self.processes, self.store
        if p.is_main:
            store.settle()  # what a crash cut short (a run.yaml rename, a restart's deletions) is finished first
            self.plan = confirm(self.plan, store, vocab_size)
        done = complete_run(self.plan, store)  # checked like any resume (the lock, every artifact), then left as it is
        if done is not None:
            return done
        mode = p.broadcast(self.plan.start.mode)  # the main process decided what to do with the folder
        if on_start is not None and p.is_main:  # the header once, not once per process
            on_start(self.plan)
        self.t_start = time.time()
        store.manifest  # noqa: B018  every process reads the run's state before the main one changes it
        start = (
            store.resume_step(vocab_size) if mode == "resume" else 0
        )  # every stored artifact it reads, before any write
        if check is not None:
            check(start)
        decision = Decision(self.plan, mode, start)
        if mode == "resume" and self.plan.forced_changes:
            decision.dropped = self._drop_stale_batches(start, say)
        p.barrier()
        if mode == "resume" and self.plan.forced_changes and not store.writable:
            store.reload()  # the main process may have dropped stored batches
        self.wall_before = store.recorded_wall_time() if mode == "resume" else 0.0
        self._record(mode)
        return decision

    def _drop_stale_batches(self, start: int, say: Callable[[str], None] | None) -> list[int]:
        """``--resume --force`` with keys that made the batches stored after the checkpoint (the
        sampling, the reward, the seed...: ``stale_batch_keys``): those batches are deleted and
        sampled again with the new settings, and the command says which."""
        keys = stale_batch_keys(self.plan.forced_changes)
        later = [s for s in done_steps(self.store.manifest["stages"], "rollout") if s > start] if keys else []
        if not later:
            return []
        self.store.drop_rollouts_after(start)
        what = f"batch of step {later[0]} was" if len(later) == 1 else f"batches of steps {later[0]}-{later[-1]} were"
        them = "it" if len(later) == 1 else "them"
        if say is not None and self.processes.is_main:
            say(f"the stored rollout {what} sampled with other settings ({', '.join(keys)}): sampling {them} again")
        return later

    def _record(self, mode: str) -> None:
        """The run recorded as it starts: its entries (status ``running``, pid, processes) go in the
        same manifest write as the config record, so no kill window lies between them
        (docs/RELIABILITY.md, Fault injection)."""
        cfg, store = self.cfg, self.store
        running = dict(
            method=cfg.method_name,
            seed=cfg.seed,
            steps_planned=cfg.train.steps,
            status="running",
            pid=os.getpid(),
            processes=self.processes.world,
            reason=None,
            # what it trains on, so that --resume NAME continues on the same rollouts
            rollouts_from=os.path.abspath(self.plan.rollouts_from) if self.plan.rollouts_from else None,
            rollouts_from_sha256=source_digest(self.plan.rollouts_from),  # a file's content, checked on --resume
            task_files=task_file_digests(cfg),  # the reward, environment and data files' content, alike
        )
        if store.writable and mode != "resume":
            if mode == "restart":
                store.restart(cfg, run=running)
            elif store.exists():
                raise MasktrlError(
                    f"run folder {store.root} was started by another process meanwhile; choose "
                    "another --run "
                    "(nothing was changed)"
                )
            else:
                store.record_config(cfg, run=running)
        elif store.writable and self.plan.forced_changes:
            store.record_config(
                cfg, run=running, forced_changes=self.plan.forced_changes
            )  # --resume --force with another config
        else:
            store.set_info(**running)

    def wall_time(self) -> float:
        """Wall time of every session of the run so far."""
        return self.wall_before + time.time() - self.t_start

    def recording(self):
        """Status ``interrupted`` or ``failed`` (with the reason and the wall time) recorded on any
        way out of the block."""
        return self.store.recording_failure(lambda: {"wall_time_s": self.wall_time()})

    def checkpointed(self, step: int) -> None:
        """After checkpoint ``step`` was recorded: the wall time, then what ``train.keep_checkpoints``
        / ``keep_steps`` and ``rollout.store`` no longer keep is deleted (the defaults keep all)."""
        self.store.set_info(wall_time_s=self.wall_time())
        t = self.cfg.train
        if self.store.writable and (t.keep_checkpoints is not None or self.cfg.rollout.store != "all"):
            retention.prune(self.store, t.keep_checkpoints, t.keep_steps, self.cfg.rollout.store)

    def complete(self, summary: dict, step: int) -> None:
        """summary.json written and recorded at ``step``; the run is complete."""
        self.store.write_summary(summary, step=step)
        self.processes.barrier()
