"""The command classes (``Command``, ``Group``): help that shows no value type for flags, and a
command stopped by Ctrl-C that says so."""

from __future__ import annotations

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup

from masktrl.commands.ui import err_console


def _hide_flag_types(params: list) -> list:
    """Flags (``--force``, ``--help``) take no value: show no type for them (typer would print
    <bool>); an argument shows its metavar, not its Python type as well (<str>, <list[str]>)."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
        elif isinstance(p, TyperArgument) and p.metavar:
            p.display_type_rich = _no_type
    return params


def _no_type(ctx) -> None:
    return None


class Command(TyperCommand):
    """A subcommand whose help shows no value type for flags."""

    def get_params(self, ctx):
        return _hide_flag_types(super().get_params(ctx))


class Group(TyperGroup):
    """A command group whose help shows no value type for flags."""

    def get_params(self, ctx):
        return _hide_flag_types(super().get_params(ctx))

    def invoke(self, ctx):
        """A command stopped by Ctrl-C (a ``KeyboardInterrupt``) prints ``interrupted`` and exits
        130; typer turned it into exit 130 without a word. ``train`` names its run itself
        (commands/train.py)."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            err_console.print("[yellow]interrupted[/]")
            raise typer.Exit(130) from None
