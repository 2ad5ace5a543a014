"""Where the libraries masktrl uses keep their caches: under ``--out``, never in ``$HOME``.

``masktrl`` (``cli.main``) calls ``contain`` before any of those libraries is imported:
matplotlib's config and font cache (``MPLCONFIGDIR``) go to ``<out>/.cache/matplotlib``, and
the ``datasets`` arrow cache of local data files (``task.source``, ``--data``) to
``<out>/.cache/datasets`` (``datasets_dir``, passed to ``load_dataset`` as ``cache_dir``). A
dataset named by its hub id is read from the hub's own cache, where it lives (masktrl never
downloads). ``<out>`` is the command's ``--out`` (``outputs`` when it is not given), so a
read-only home changes nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "MASKTRL_CACHE_DIR"


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
    """Point the libraries' caches under the command's ``--out``; returns the cache folder."""
    root = Path(os.path.abspath(out_from_argv(argv))) / ".cache"
    os.environ[ENV] = str(root)
    os.environ["MPLCONFIGDIR"] = str(root / "matplotlib")
    return root


def datasets_dir() -> str | None:
    """The ``cache_dir`` for ``datasets.load_dataset`` of local files (None: the library's own,
    when masktrl is used as a library rather than as the ``masktrl`` command)."""
    root = os.environ.get(ENV)
    return str(Path(root) / "datasets") if root else None
