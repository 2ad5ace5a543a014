"""The command classes whose help shows no value type for flags (``Command``, ``Group``)."""

from __future__ import annotations

from typer.core import TyperArgument, TyperCommand, TyperGroup


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
