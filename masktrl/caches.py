"""Where the libraries masktrl uses keep their caches: under ``--out``, never in ``$HOME``, the
current folder or ``/tmp``.

``masktrl`` (``cli.main``) calls ``contain`` before any of those libraries is imported. With
``--out``, matplotlib's config and font cache (``MPLCONFIGDIR``) go to ``<out>/.cache/matplotlib``.
Without it, nothing is decided up front: an analysis draws its figure into a folder it has just
written to (its ``--output``, or the run's ``analysis/``), and ``settle_matplotlib`` puts the cache
in that folder's ``.cache/matplotlib`` just before matplotlib is imported; so an analysis of runs
given by path never creates ``./outputs`` in the current folder. When the cache folder named by
``--out`` cannot be written (a read-only ``--out`` with a writable ``--output``) the figure's
folder is used instead: matplotlib never falls back to a temporary folder with a warning. The
``datasets`` arrow cache of a local data file is built in a temporary folder (``scratch``: under
``<out>/.cache`` with ``--out``) that is deleted once its rows are read (``tasks/dataset.py``);
a dataset named by its hub id is read from the hub's own cache, where it lives (masktrl never
downloads). torch's inductor folder (made when a model generates) goes to
``<out>/.cache/torchinductor``, or without ``--out`` to a temporary folder removed when the process
exits. So a read-only home changes nothing. A command that fails, is
refused or is a ``--dry-run`` removes again the empty folders the imports made there (``tidy``),
so it leaves no ``--out``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_scratch_root: Path | None = None  # <out>/.cache once contain() found --out
_mode: str | None = (
    None  # None: contain() did not run (a library caller); "out": --out holds the cache; "figure": no --out
)
_made: list[Path] = []  # --out and --out/.cache when contain() found them missing (highest first): tidy()'s


def out_from_argv(argv: list[str]) -> str | None:
    """The value of ``--out`` in a command line (the last one given), else None."""
    out = None
    for i, arg in enumerate(argv):
        if arg == "--out" and i + 1 < len(argv):
            out = argv[i + 1]
        elif arg.startswith("--out="):
            out = arg.split("=", 1)[1]
    return out


def contain(argv: list[str]) -> Path | None:
    """Point the libraries' caches under the command's ``--out``; returns the cache folder
    (created by a library only when it writes there), or None when the command has no ``--out``
    (``settle_matplotlib`` decides at the figure)."""
    global _mode, _scratch_root
    out = out_from_argv(argv)
    if out is None:
        _mode, _scratch_root = "figure", None
        _inductor_in_temporary_folder()
        return None
    _mode = "out"
    root = Path(os.path.abspath(out)) / ".cache"
    _made[:] = [d for d in (root.parent, root) if not d.exists()]
    os.environ["MPLCONFIGDIR"] = str(root / "matplotlib")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "torchinductor")  # torch makes it when it generates (else /tmp)
    _scratch_root = root
    return root


def _inductor_in_temporary_folder() -> None:
    """Without ``--out``: torch's inductor folder, which importing torch's dynamo makes (transformers'
    ``generate`` does), in a temporary folder of its own that is removed when the process exits, so
    the command leaves no ``torchinductor_<user>`` in the system's temporary folder. masktrl
    compiles nothing, so the folder holds no cache worth keeping. When no temporary folder can be
    made (a read-only ``TMPDIR``), torch is left to its own choice."""
    try:
        folder = tempfile.mkdtemp(prefix="masktrl-inductor-")
    except OSError:
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    atexit.register(shutil.rmtree, folder, ignore_errors=True)


@contextmanager
def scratch(prefix: str) -> Iterator[str]:
    """A temporary folder, deleted on exit: under ``<out>/.cache`` when the command has ``--out``
    (nothing in ``/tmp``), else the system's temporary folder (a library caller, or a command
    without ``--out``). Folders it had to create on the way are removed again when empty, so a
    command refused after reading its data leaves no ``--out`` behind."""
    parent, made = None, []
    if _scratch_root is not None:
        made = [d for d in (_scratch_root.parent, _scratch_root) if not d.exists()]
        try:
            _scratch_root.mkdir(parents=True, exist_ok=True)
            parent = str(_scratch_root)
        except OSError:  # a read-only --out: the command's own write will say so
            parent = None
    try:
        with tempfile.TemporaryDirectory(prefix=prefix, dir=parent) as folder:
            yield folder
    finally:
        for d in reversed(made):
            try:
                d.rmdir()  # only if still empty: the run may have written there meanwhile
            except OSError:
                pass


def tidy() -> None:
    """After a command that wrote nothing it means to keep (it was refused, failed, or was a
    ``--dry-run``): remove the empty folders under ``--out`` that the libraries' imports made as
    they loaded (torch's dynamo cache folder under ``.cache/torchinductor``, vLLM's), when ``--out``
    or its ``.cache`` did not exist before the command, so the command leaves no ``--out`` behind.
    Only empty folders are removed, children before parents; a file is never touched."""
    for top in _made[:1]:  # the highest folder the command made: everything under it is ours
        for folder, _, _ in os.walk(top, topdown=False):
            try:
                os.rmdir(folder)  # only if empty
            except OSError:
                pass


def settle_matplotlib(folder: Path) -> None:
    """Before matplotlib is imported to draw a figure into ``folder`` (a folder the command has
    just written to): the cache under ``--out`` when it can be written, else ``folder/.cache/
    matplotlib``. Only under ``cli.main`` (a library caller's environment is left alone) and only
    before matplotlib's first import."""
    import sys

    if _mode is None or "matplotlib" in sys.modules:
        return
    if _mode == "out" and _writable(Path(os.environ["MPLCONFIGDIR"])):
        return
    cache = Path(os.path.abspath(folder)) / ".cache" / "matplotlib"
    if _writable(cache):
        os.environ["MPLCONFIGDIR"] = str(cache)


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


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
