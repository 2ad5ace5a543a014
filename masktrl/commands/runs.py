"""``masktrl runs``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from masktrl.commands.options import DEFAULT_OUT, OutOpt
from masktrl.commands.ui import console, err_console

STATUS_STYLE = {"complete": "green", "running": "cyan", "interrupted": "yellow", "failed": "red", "damaged": "red"}


def runs(
    out: OutOpt = DEFAULT_OUT,
    folder: Annotated[
        Path | None,
        typer.Argument(metavar="DIR", help="Deprecated spelling of --out DIR.", show_default=False, hidden=True),
    ] = None,
) -> None:
    """List runs: name, method, seed, steps done / planned, last reward, last eval accuracy, status."""
    from rich.markup import escape

    from masktrl.runs.listing import advice, list_runs

    if folder is not None:
        err_console.print(f"[yellow]deprecated:[/] masktrl runs DIR; use masktrl runs --out {folder}", highlight=False)
        out = folder
    folder = out
    from masktrl.runs.store import is_run_folder

    if is_run_folder(folder):  # it said "no runs in out/r", exit 0
        from masktrl.errors import MasktrlError

        raise MasktrlError(
            f"{folder} is a run folder, not a folder of runs: masktrl runs --out {folder.parent} lists it"
        )
    rows = list_runs(folder)
    table = Table(title=f"runs in {folder}")
    for col in ("run", "method", "seed", "steps", "last reward", "last eval", "status"):
        # a narrow terminal folds a run's name instead of cutting it: runs differ in their last characters
        table.add_column(
            col,
            justify="right" if col in ("seed", "steps", "last reward", "last eval") else "left",
            overflow="fold" if col in ("run", "method") else "ellipsis",
        )
    for r in rows:
        style = STATUS_STYLE.get(r["status"], "white")
        table.add_row(
            Text(r["name"]),
            Text(str(r["method"] or "-")),
            str(r["seed"] if r["seed"] is not None else "-"),
            f"{r['steps_done']} / {r['steps_planned'] or '?'}",
            _fmt(r["last_reward"]),
            _fmt(r["last_eval"]),
            f"[{style}]{r['status']}[/]",
        )
    console.print(table if rows else f"no runs in {folder}")
    for r in rows:
        line = advice(r, folder)
        if line:
            word, rest = line.split(" ", 1)
            console.print(
                f"[{STATUS_STYLE['damaged' if word == 'damaged' else 'interrupted']}]{word}[/] {escape(rest)}",
                highlight=False,
                soft_wrap=True,
            )


def _fmt(x) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"
