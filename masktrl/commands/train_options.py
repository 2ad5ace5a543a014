"""``masktrl train``'s own options (commands/train.py); the shared ones are in commands/options.py."""

from __future__ import annotations

from typing import Annotated

import typer

from masktrl.commands.values import not_empty

ResumeOpt = Annotated[
    str | None,
    typer.Option(
        "--resume",
        metavar="RUN",
        parser=not_empty("give the run to continue (a name under --out, or a folder)"),
        help="Continue RUN (a name: looked up under --out only; a run elsewhere as a path, ./NAME) "
        "from its last checkpoint.",
        show_default=False,
    ),
]
ForceOpt = Annotated[bool, typer.Option("--force", help="With --resume: accept a config that differs from run.yaml.")]
RolloutsFromOpt = Annotated[
    str | None,
    typer.Option(
        "--rollouts-from",
        metavar="RUN|FILE",
        parser=not_empty("give a run (a name under --out, or a folder) or a rollout parquet file"),
        help="Train on stored rollouts: a run (folder, or name under --out) or a parquet file from `masktrl rollout`.",
        show_default=False,
    ),
]
DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run", help="Run every check, print the resolved config and the projected disk use, write nothing."
    ),
]
