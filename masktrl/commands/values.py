"""Parsers and callbacks for option values that several commands share: a value that names a
run, a file or a folder is never empty (an unset shell variable), ``--out`` is a folder, and an
analysis's ``--output`` is a folder outside the runs."""

from __future__ import annotations

from pathlib import Path

import typer


def not_empty(hint: str):
    """A parser for a value option that names something (a run, a file, a model): an empty or
    blank value (an unset shell variable) is refused with ``hint``, not read as "not given" or
    as the current folder."""

    def parse(value: str) -> str:
        if not str(value).strip():
            raise typer.BadParameter(f"is empty; {hint}")
        return value

    return parse


def file_path(hint: str):
    """A parser for an option that names a file or a folder: a Path; an empty value is refused with ``hint``
    (it was read as the current folder: ". is a folder", ". no such file")."""
    parse = not_empty(hint)

    def to_path(value: str | Path) -> Path:
        return Path(parse(str(value)))

    return to_path


out_folder = file_path("give the folder that holds runs (default: outputs)")
"""--out as a Path; an empty one (an unset shell variable: ``--out "$OUT"``) is refused, not read
as the current folder."""

config_file = file_path("give a YAML file or a preset name (lab, tiny, methods/pdm-agg)")
"""--config as a Path; an empty one is refused, not read as the current folder."""

output_folder = file_path("give the folder to write the analysis to, or leave --output out")
"""An analysis's --output as a Path; an empty one (an unset shell variable) is refused, not read as
the current folder (the analysis wrote its files there)."""


def outside_runs(value: Path | None) -> Path | None:
    """An analysis's ``--output`` (a typer callback): a folder, never inside a run folder, but its
    analysis/."""
    if value is not None:
        from masktrl.errors import ConfigError
        from masktrl.runs.resolve import refuse_inside_run

        if value.exists() and not value.is_dir():  # it said "<file>: File exists"
            raise ConfigError(f"--output {value} is a file; an analysis writes a folder: give a folder's path")
        refuse_inside_run(value, analysis_ok=True)
    return value
