"""The options of ``masktrl analyze estimators`` (commands/analyze/estimators.py)."""

from __future__ import annotations

from typing import Annotated

import typer

KOpt = Annotated[
    str,
    typer.Option(
        "--k",
        metavar="K,...",
        help="List sizes K (re-cut from the stored list up to its size, else from the recomputed μ).",
    ),
]
