"""Where the libraries masktrl uses keep their caches: under ``--out``, never in ``$HOME``.

``masktrl`` (``cli.main``) calls ``contain`` before any of those libraries is imported:
matplotlib's config and font cache (``MPLCONFIGDIR``) go to ``<out>/.cache/matplotlib``
(``<out>``: the command's ``--out``, ``outputs`` when it is not given). The ``datasets`` arrow
cache of a local data file is built in a temporary folder that is deleted once its rows are
read (``tasks/dataset.py``); a dataset named by its hub id is read from the hub's own cache,
where it lives (masktrl never downloads). So a read-only home changes nothing.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def out_from_argv(argv: list[str]) -> str:
    """The value of ``--out`` in a command line (the last one given), else ``outputs``."""
    out = "outputs"
    for i, arg in enumerate(argv):
        if arg == "--out" and i + 1 < len(argv):
            out = argv[i + 1]
        elif arg.startswith("--out="):
            out = arg.split("=", 1)[1]
    return out


def contain(argv: list[str]) -> Path:
    """Point the libraries' caches under the command's ``--out``; returns the cache folder
    (created by a library only when it writes there)."""
    root = Path(os.path.abspath(out_from_argv(argv))) / ".cache"
    os.environ["MPLCONFIGDIR"] = str(root / "matplotlib")
    return root


@contextmanager
def temporary_matplotlib_cache() -> Iterator[Path]:
    """matplotlib's config and font cache in a temporary folder, deleted on exit, for a tool
    without ``--out`` (``scripts/mismatch_table.py``); ``MPLCONFIGDIR`` is restored after."""
    before = os.environ.get("MPLCONFIGDIR")
    with tempfile.TemporaryDirectory() as folder:
        os.environ["MPLCONFIGDIR"] = folder
        try:
            yield Path(folder)
        finally:
            if before is None:
                os.environ.pop("MPLCONFIGDIR", None)
            else:
                os.environ["MPLCONFIGDIR"] = before
