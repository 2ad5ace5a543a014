"""``masktrl check-method``: the conformance check of one rule (docs/METHODS.md §17)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from masktrl.commands.ui import console

MethodSetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="KEY=VALUE",
        show_default=False,
        help="A parameter of the method, repeatable: --set method.tau_pos=2 (its keys: "
        "masktrl config keys method "
        "--method NAME).",
    ),
]
RESULT = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "[cyan]info[/]"}


def check_method(
    spec: Annotated[
        str,
        typer.Argument(
            metavar="METHOD",
            help="A registered method name (masktrl config keys method.name "
            "lists them) or path/to/rules.py:name; its "
            "parameters go as --set method.KEY=VALUE.",
            show_default=False,
        ),
    ],
    set_: MethodSetOpt = None,
) -> None:
    """Check a rule's contract on small random float64 batches, in seconds on CPU: its gradient
    against its value, stop-gradient lists, invalid tokens, finiteness at ratios 1e-30..1e30, the
    on-policy limit, sequence order, packed = padded, and its params through run.yaml. One row per
    property; exit code 1 if any property fails, 2 on bad input. Writes nothing."""
    from masktrl.analysis.conformance import check_method as run_check
    from masktrl.analysis.conformance import passed

    method = _resolve(spec, set_ or [])
    bound = method.bind()
    name = method.rule
    rows = run_check(bound.method, bound.params, spec=method.rule)
    table = Table(title=f"check-method {escape(spec)}")
    for col in ("property", "result", "detail"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r.name, RESULT[r.ok], escape(r.detail))
    console.print(table)
    if not passed(rows):
        failed = ", ".join(r.name for r in rows if r.ok is False)
        console.print(f"[red]{escape(name)} fails:[/] {escape(failed)}", highlight=False)
        raise typer.Exit(1)
    console.print(f"[green]{escape(name)} conforms[/]", highlight=False)


def _resolve(spec: str, overrides: list[str]):
    """The bound method ``spec`` names (a registered name, or ``path/to/rules.py:name`` for a rule
    of your own, docs/METHODS.md "Writing your own rule") with its params validated from ``--set
    method.KEY=VALUE`` overrides, as a run's config builds them; anything wrong raises ConfigError
    (one line, exit 2)."""
    from masktrl.config import ConfigError, load_config

    bad = [o for o in overrides if not o.startswith("method.") or o.startswith("method.name=")]
    if bad:
        raise ConfigError(f"check-method --set takes method.KEY=VALUE (not the name), got {bad[0]!r}")
    if any(o.startswith("method.correction") for o in overrides):
        raise ConfigError(
            "check-method checks the rule itself; method.correction (docs/METHODS.md §14) composes "
            "with any "
            "rule and is checked by its own tests"
        )
    if ":" in spec and not spec.split(":")[0].endswith(".py"):
        raise ConfigError(
            f"check-method takes a method name or path/to/rules.py:name, got {spec!r}; its "
            "parameters go as "
            "--set method.KEY=VALUE"
        )
    return load_config(None, list(overrides), method=spec.strip()).method
