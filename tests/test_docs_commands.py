"""Every ``masktrl …`` command written in README.md and docs/*.md names a real subcommand and
only options that subcommand has, so the docs cannot drift from the CLI unnoticed.

Commands are taken from fenced code blocks (``bash``/``sh``/unlabelled) and from inline code
spans; ``accelerate launch … -m masktrl.cli train …`` counts as ``masktrl train …``."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer.main

from masktrl.cli import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
INLINE = re.compile(r"(?<!`)`(masktrl [^`\n]+)`(?!`)")
# `masktrl …` at the start of a shell line, after `&&`/`;`/`VAR=value`, or `-m masktrl.cli …`
ENTRY = re.compile(r"(?:^(?:\w+=\S+\s+)*|(?:&&|;)\s*)masktrl\s+(.*)$|-m masktrl\.cli\s+(.*)$")


def _commands_in(text: str) -> list[str]:
    found = []
    for lang, body in FENCE.findall(text):
        if lang not in ("", "bash", "sh", "console", "shell"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip().lstrip("$ ")
            m = ENTRY.search(line)
            if m and not line.startswith("#"):
                found.append(m.group(1) or m.group(2))
    found += [m[len("masktrl "):] for m in INLINE.findall(text)]
    return found


def _cases():
    for doc in DOCS:
        for cmd in _commands_in(doc.read_text()):
            yield pytest.param(cmd, id=f"{doc.name}: masktrl {cmd}"[:120])


def _tokens(cmd: str) -> list[str]:
    cmd = re.split(r"\s(?:&&|\|\||\||;|>|2>)\s", f" {cmd} ")[0]
    try:
        return shlex.split(cmd)
    except ValueError:  # an unbalanced quote inside prose: split on spaces
        return cmd.split()


def _is_group(cmd) -> bool:
    return hasattr(cmd, "get_command")


def _context(cmd):
    return cmd.context_class(cmd)


def _options(cmd) -> set[str]:
    names = {"--help"}
    for p in cmd.get_params(_context(cmd)):
        names.update(getattr(p, "opts", []))
        names.update(getattr(p, "secondary_opts", []))
    return names


CASES = list(_cases())
CLI = typer.main.get_command(app)


def test_the_docs_hold_commands():
    assert len(CASES) > 50  # the extraction itself works


@pytest.mark.parametrize("cmd", CASES)
def test_documented_command_uses_only_real_subcommands_and_options(cmd):
    group = CLI
    words = _tokens(cmd)
    node, rest = group, list(words)
    while _is_group(node) and rest and node.get_command(_context(node), rest[0]) is not None:
        node = node.get_command(_context(node), rest.pop(0))
    if _is_group(node):
        # `masktrl --help`, or a placeholder such as `masktrl <command>` in prose
        if not rest or rest[0].startswith("-") or rest[0].startswith("<") or rest[0] in ("…", "..."):
            return
        pytest.fail(f"masktrl {cmd!r}: no subcommand {rest[0]!r} (have {', '.join(sorted(node.commands))})")
    known = _options(node)
    for word in rest:
        if word.startswith("--") and len(word) > 2:
            name = word.split("=", 1)[0]
            if name.endswith("…") or name.endswith("..."):
                continue
            assert name in known, f"masktrl {cmd!r}: {name} is not an option of this command ({', '.join(sorted(known))})"
