"""Console, progress bar and table helpers shared by the commands."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

# no emoji codes: a run named :smile: (or a path holding one) is printed as it is named
console = Console(emoji=False)
err_console = Console(stderr=True, emoji=False)


def progress_bar() -> Progress:
    """step x/N, a free-text info field (reward, tokens/s), elapsed time and ETA."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
    )


def kv_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in rows:
        table.add_row(key, value)
    return table


def plain(value) -> str:
    """``value`` as text for a console line with markup: a run named ``[bold]q`` (or a path holding
    ``[i]``) printed as ``q`` (or not at all), so the path shown was not the run's."""
    return escape(str(value))
