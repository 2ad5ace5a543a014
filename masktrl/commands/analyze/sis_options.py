"""The options of ``masktrl analyze sis`` (commands/analyze/sis.py)."""

from __future__ import annotations

from typing import Annotated

import typer

TopOpt = Annotated[int, typer.Option("--top", metavar="N", help="How many accepted / rejected tokens to list.")]
BiasOpt = Annotated[
    bool,
    typer.Option(
        "--bias",
        help="Also the gradient bias on the step's batch: top-K SIS vs exact-envelope SIS, the "
        "base "
        "objective and the on-policy gradient, against "
        "the residual mass (needs the behaviour "
        "checkpoint).",
    ),
]
KOpt = Annotated[
    str | None,
    typer.Option(
        "--k",
        metavar="K,...",
        show_default=False,
        help="With --bias: envelope list sizes, re-cut "
        "from the stored lists (at most their K; "
        "default 5,10,20, with the stored K in "
        "place of those above it).",
    ),
]
