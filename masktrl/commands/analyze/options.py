"""The option types the analyses share (commands/analyze/*.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from masktrl.commands.values import output_folder, outside_runs

RunArg = Annotated[
    str, typer.Option("--run", metavar="RUN", help="Run folder, or a run name under --out.", show_default=False)
]
RunsArg = Annotated[
    list[str],
    typer.Argument(metavar="RUN", help="Run folders or names under --out, or folders of runs.", show_default=False),
]
ResultOpt = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        metavar="DIR",
        help="Where to write JSON + PNG (default: the first run's parent analysis/; "
        "never inside a run folder but its analysis/).",
        show_default=False,
        parser=output_folder,
        callback=outside_runs,
    ),
]
StepOpt = Annotated[
    int | None,
    typer.Option(
        "--step",
        metavar="S",
        help="Rollout step S (default: the latest S whose checkpoint S-1 exists).",
        show_default=False,
    ),
]
DeltaOpt = Annotated[
    float,
    typer.Option("--delta", metavar="D", help="Trust-region threshold δ on the top-K KL D (the paper's main value)."),
]
RecutKsOpt = Annotated[
    str | None,
    typer.Option(
        "--k",
        metavar="K,...",
        help="Also the study at these list sizes (the stored lists "
        "re-cut, at most their K): D, Ḋ and ΔD of "
        "the top-K KL at each K.",
        show_default=False,
    ),
]
