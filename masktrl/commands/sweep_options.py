"""The options of ``masktrl sweep`` (commands/sweep.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from masktrl.commands.values import file_path

MethodsOpt = Annotated[
    str,
    typer.Option(
        "--methods",
        metavar="LIST",
        help="Comma-separated methods; NAME:KEY=VALUE gives one its parameters, so a sweep can "
        "hold variants: pdm:tail=agg,pdm:tail=uniform (run pdm-tail-uniform-seed<k>); a rule "
        "of your own as path/to/rules.py:NAME[:KEY=VALUE] (run NAME-seed<k>). Parameters for "
        "all via --set method.X=....",
    ),
]
SeedsOpt = Annotated[str, typer.Option("--seeds", metavar="N|LIST", help="A count (3: seeds 0,1,2) or a list (0,4,7).")]
BaselineOpt = Annotated[
    str | None,
    typer.Option(
        "--baseline",
        metavar="METHOD",
        help="Method the compare table tests against (default: grpo if swept, else the first).",
        show_default=False,
    ),
]
LauncherOpt = Annotated[
    str,
    typer.Option(
        "--launcher",
        metavar="local|slurm",
        help="local: train the runs one after another here; slurm: one sbatch job per run.",
    ),
]
PrintCommandsOpt = Annotated[
    bool,
    typer.Option(
        "--print-commands", help="Print the masktrl train command of every run still to do, and start nothing."
    ),
]
SlurmOptsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--slurm",
        metavar="KEY=VALUE",
        help="slurm: an #SBATCH option KEY=VALUE, repeatable: --slurm partition=gpu --slurm "
        "gres=gpu:8 --slurm time=72:00:00.",
        show_default=False,
    ),
]
AccelerateConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--accelerate-config",
        metavar="FILE",
        parser=file_path("give accelerate's config file, or leave --accelerate-config out"),
        help="Run each training under accelerate launch --config_file FILE.",
        show_default=False,
    ),
]
NoSubmitOpt = Annotated[bool, typer.Option("--no-submit", help="slurm: write the sbatch scripts, submit nothing.")]
ResubmitOpt = Annotated[
    bool,
    typer.Option(
        "--resubmit", help="slurm: submit runs whose earlier job squeue cannot rule out as still queued or running."
    ),
]
