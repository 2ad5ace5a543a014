"""``masktrl config``: every config key with its documentation, and the resolved config."""

from __future__ import annotations

from typing import Annotated

import typer
import yaml
from rich.markup import escape
from rich.table import Table

from masktrl.commands.help_format import Command, Group
from masktrl.commands.options import ConfigOpt, MethodOpt, SeedOpt, SetOpt
from masktrl.commands.ui import console

app = typer.Typer(
    cls=Group,
    help="The config: every key with its documentation (keys), the resolved config (show).",
    no_args_is_help=True,
)


@app.command(cls=Command)
def keys(
    prefix: Annotated[
        str | None,
        typer.Argument(
            metavar="PREFIX", help="Only keys starting with this, e.g. rollout or train.lr.", show_default=False
        ),
    ] = None,
    method: MethodOpt = None,
) -> None:
    """Every config key (--set KEY=VALUE, YAML presets): type, default and what it does; method.*
    lists the parameters of --method (default grpo)."""
    from masktrl.config import config_keys
    from masktrl.errors import ConfigError

    every = config_keys(method)
    shown = [k for k in every if prefix is None or k.key.startswith(prefix)]
    if not shown:  # it printed an empty table and exited 0
        sections = sorted({k.key.split(".", 1)[0] for k in every})
        raise ConfigError(f"no config key starts with {prefix!r}; the sections: {', '.join(sections)}")
    table = Table(title=f"config keys (method.* of {method or 'grpo'})", show_lines=False)
    for col in ("key", "type", "default", "what it does"):
        table.add_column(col, overflow="fold")
    for k in shown:
        table.add_row(k.key, k.type, escape(_show(k.default)), escape(k.doc))
    console.print(table)


@app.command(cls=Command)
def show(config: ConfigOpt = None, method: MethodOpt = None, seed: SeedOpt = None, set_: SetOpt = None) -> None:
    """The resolved config as YAML (defaults < --config < --method/--seed <
    --set), as a run would save it in run.yaml."""
    from masktrl.config import load_config

    cfg = load_config(config, set_ or [], method=method, seed=seed)
    console.print(yaml.safe_dump(cfg.to_dict(), sort_keys=False).rstrip(), highlight=False, markup=False)


def _show(value) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
