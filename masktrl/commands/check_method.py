"""``masktrl check-method``: the conformance check of one rule (docs/METHODS.md §17)."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from masktrl.commands.ui import console

MethodSetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", metavar="KEY=VALUE", show_default=False,
                 help="A parameter of the method, repeatable: --set method.tau_pos=2 (its keys: masktrl config keys method "
                      "--method NAME)."),
]
RESULT = {True: "[green]pass[/]", False: "[red]FAIL[/]", None: "[cyan]info[/]"}


def check_method(
    spec: Annotated[str, typer.Argument(metavar="METHOD", help="A registered method name (masktrl config keys method.name "
                                        "lists them); its parameters go as --set method.KEY=VALUE.", show_default=False)],
    set_: MethodSetOpt = None,
) -> None:
    """Check a rule's contract on small random float64 batches, in seconds on CPU: its gradient
    against its value, stop-gradient lists, invalid tokens, finiteness at ratios 1e-30..1e30, the
    on-policy limit, sequence order, packed = padded, and its params through run.yaml. One row per
    property; exit code 1 if any property fails, 2 on bad input. Writes nothing."""
    from masktrl.analysis.conformance import check_method as run_check, passed

    name, params = _params(_resolve(spec), set_ or [])
    rows = run_check(name, params)
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


def _resolve(spec: str) -> str:
    """The registered method name that ``spec`` names (registered names now; a rule loaded from
    ``file.py:name`` resolves here too once rules load from files). Unknown: ConfigError."""
    from masktrl.config import ConfigError
    from masktrl.methods import get_method

    try:
        return get_method(spec.strip()).name
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _params(name: str, overrides: list[str]) -> tuple[str, Any]:
    """``name`` and its params validated from ``--set method.KEY=VALUE`` overrides, as a run's
    config would build them; a bad key or value raises ConfigError (one line, exit 2)."""
    from masktrl.config import ConfigError, load_config

    bad = [o for o in overrides if not o.startswith("method.") or o.startswith("method.name=")]
    if bad:
        raise ConfigError(f"check-method --set takes method.KEY=VALUE (not the name), got {bad[0]!r}")
    if any(o.startswith("method.correction") for o in overrides):
        raise ConfigError("check-method checks the rule itself; method.correction (docs/METHODS.md §14) composes with any "
                          "rule and is checked by its own tests")
    cfg = load_config(None, list(overrides), method=name)
    return cfg.method_name, cfg.method_params
