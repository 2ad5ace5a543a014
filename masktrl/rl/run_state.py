"""What a training run's steps share, built once by ``recipes/train.py: setup``: the model parts
(``ModelParts``), where a step's inputs come from and its results go (``RunServices``), where the
run stands (``Counters``), all three in the run's ``State``; and what ``train`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from masktrl.config import Config
from masktrl.errors import MasktrlError
from masktrl.methods import BoundMethod
from masktrl.rl.collect import Batch, CollectSettings
from masktrl.rl.distributed import Dist
from masktrl.rl.lab_stats import LabStats
from masktrl.rl.reference import Reference
from masktrl.rl.rollout_source import RolloutSource
from masktrl.rl.tracking import Trackers
from masktrl.rl.update import UpdateSettings
from masktrl.rollout.base import RolloutEngine
from masktrl.runs.session import Session
from masktrl.runs.store import RunStore
from masktrl.tasks import Example, Task

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
    method: BoundMethod  # the run's method, bound to its params and correction (cfg.method.bind())
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
    eval_before: float = float("nan")
    nonfinite_total: int = 0  # steps so far with an update skipped for a non-finite loss or gradient norm
    nonfinite_run: int = 0  # ... of them in a row, up to the last step
    # rollout.staleness: batches sampled ahead, not yet trained on
    ahead: dict[int, Batch] = field(default_factory=dict)


@dataclass
class State:
    """Everything a run's steps share, built once by ``recipes/train.py: setup``."""

    parts: ModelParts
    run: RunServices
    count: Counters
    warmstart: dict  # where the starting policy came from (prepare_policy's info)
    rollouts_from: str | None
    session: Session  # the run's lifecycle: wall time, checkpoints' retention, the summary (runs/session.py)

    @property
    def cfg(self) -> Config:
        return self.run.cfg

    @property
    def store(self) -> RunStore:
        return self.run.store


class NonFiniteError(MasktrlError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""
