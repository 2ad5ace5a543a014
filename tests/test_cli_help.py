"""Every command's help renders cleanly: a metavar for each value option, nothing for flags
(typer alone prints ``--help <bool>``, ``--force <bool>``, ``--set <list[str]>``)."""

import re

import pytest
import typer.main
from typer.testing import CliRunner

from masktrl.cli import app

runner = CliRunner()
PYTHON_TYPES = re.compile(r"<(bool|str|int|float|path|list\[[a-z]+\])>")


def _commands(group, prefix=()):
    yield prefix
    for name, cmd in getattr(group, "commands", {}).items():
        if not cmd.hidden:
            yield from _commands(cmd, (*prefix, name))


COMMANDS = list(_commands(typer.main.get_command(app)))


def test_every_command_is_covered():
    names = {" ".join(c) for c in COMMANDS}
    assert {"train", "rollout", "eval", "runs", "sweep", "config keys", "analyze compare"} <= names


@pytest.mark.parametrize("path", COMMANDS, ids=lambda c: " ".join(c) or "masktrl")
def test_help_shows_metavars_not_python_types(path):
    r = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert not PYTHON_TYPES.search(r.output), PYTHON_TYPES.search(r.output).group(0)
    assert "--help" in r.output


@pytest.mark.parametrize("path", [c for c in COMMANDS if c and c != ("analyze",) and c != ("config",)], ids=" ".join)
def test_every_value_option_has_an_upper_case_metavar(path):
    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    for p in cmd.params:
        if getattr(p, "is_flag", False):
            continue
        assert p.metavar and p.metavar == p.metavar.upper() or "|" in (p.metavar or ""), (path, p.name, p.metavar)
