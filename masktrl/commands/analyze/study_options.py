"""The options of the replay studies, ``analyze disagreement`` and ``analyze estimators``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from masktrl.commands.values import output_folder, outside_runs

StudyRunsOpt = Annotated[
    list[str],
    typer.Option(
        "--run",
        metavar="RUN",
        help="Run folder, run name under --out, or a folder of runs (a sweep); repeat to pool runs.",
        show_default=False,
    ),
]
StepsOpt = Annotated[
    str | None,
    typer.Option(
        "--steps",
        "--step",
        metavar="STEPS",
        help="Rollout steps S: 600 | 600,650,700 | 600:700:50 (inclusive) "
        "(default: each run's latest S whose checkpoint S-1 exists).",
        show_default=False,
    ),
]
UpdateOpt = Annotated[
    str,
    typer.Option(
        "--update-method",
        metavar="NAME",
        help="The replayed update: unmasked (importance-weighted PG, no trust-region mask: "
        "favours no criterion), run (the run's own method) or a method name or "
        "path/to/rules.py:NAME (its defaults).",
    ),
]
PartitionsOpt = Annotated[
    int,
    typer.Option(
        "--partitions",
        metavar="N",
        help="Replays of each batch with other minibatch partitions (seed values run seed + 0..N-1).",
    ),
]
PolicyStepOpt = Annotated[
    int | None,
    typer.Option(
        "--policy-step",
        metavar="P",
        help="Checkpoint the update starts from (one run, one step; default S-1; later = staler rollouts).",
        show_default=False,
    ),
]
MinibatchesOpt = Annotated[
    int | None,
    typer.Option(
        "--minibatches",
        metavar="M",
        help="Minibatch updates in the step (default: the run's; 4 if it used 1 without staleness).",
        show_default=False,
    ),
]
StudyOutputOpt = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        metavar="DIR",
        help="Where to write JSON, parquet and PNG (default: <run>/analysis/, "
        "or the first run's parent analysis/ when runs are pooled).",
        show_default=False,
        parser=output_folder,
        callback=outside_runs,
    ),
]
ReplayOptimizerOpt = Annotated[
    str,
    typer.Option(
        "--replay-optimizer",
        metavar="run|sgd|adamw",
        help="The optimizer of the replayed update: run (the run's AdamW with its "
        "stored moments and schedule: what training did), adamw (fresh moments, "
        "constant lr), sgd (plain, constant lr).",
    ),
]
ReplayLrOpt = Annotated[
    float | None,
    typer.Option(
        "--replay-lr",
        metavar="LR",
        help="Constant learning rate of the replayed update (default: the run's rate at the "
        "checkpoint; with run it replaces the schedule).",
        show_default=False,
    ),
]
ResetMomentsOpt = Annotated[
    bool,
    typer.Option(
        "--reset-moments", help="Clear the Adam state before every minibatch update (each update a first Adam step)."
    ),
]
