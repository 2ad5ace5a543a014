"""What a train command does with its run folder (``plan_start``): a new run, a resume, or a
restart in place of a failed or interrupted run. Re-running the command of a run that failed
or was interrupted continues it (same config: as ``--resume`` would) or, when the config
changed and no checkpoint was completed yet, starts it again in the same folder; nothing has to
be deleted by hand."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from masktrl.config import Config, diff_configs
from masktrl.errors import MasktrlError
from masktrl.io import disk_problem
from masktrl.runs import locks
from masktrl.runs.store import RunStore, is_fresh_folder, is_run_folder


@dataclass
class Start:
    """What a train command does with its run folder: ``new``, ``resume`` (``--resume``, or the
    same command re-run after a failure or an interruption) or ``restart`` (re-run with a
    changed config, before any checkpoint: the folder is reused from scratch)."""

    root: Path
    mode: str
    note: str = ""


def plan_start(root: Path, cfg: Config, *, resume: bool = False) -> Start:
    """What to do with ``root`` for a run of ``cfg``; MasktrlError when it must be left alone."""
    root = Path(root)
    if resume:
        return Start(root, "resume", "continuing from its last checkpoint")
    _check_folder_for_writing(root)
    if is_fresh_folder(root):
        return Start(root, "new")
    if not is_run_folder(root) or not (root / "manifest.json").is_file():
        raise MasktrlError(f"run folder {root} already exists: choose another --run, or --resume it (nothing was changed)")
    store = RunStore(root)
    status = store.status()
    if status not in ("failed", "interrupted"):
        what = {"complete": "a complete run", "running": f"a run that is training right now (pid {locks.holder(root)})"}.get(
            status, f"a run (status {status})")
        raise MasktrlError(f"run folder {root} already exists and holds {what}: choose another --run, or --resume it (nothing was changed)")
    changed = diff_configs(store.config(), cfg)
    reason = store.manifest.get("reason")
    why = f"{status}" + (f": {reason}" if reason else "")
    if not changed:
        return Start(root, "resume", f"the run {why}; continuing it from its last checkpoint (same config)")
    if store.checkpoints():
        raise MasktrlError(
            f"run folder {root} holds a {status} run with checkpoints and a different config ({', '.join(changed[:4])}): "
            "--resume it (--force to take the new config), or choose another --run (nothing was changed)"
        )
    return Start(root, "restart", f"the run {why}; no checkpoint yet and the config changed ({', '.join(changed[:4])}): starting it again in place")


def _check_folder_for_writing(root: Path) -> None:
    """The run folder can be created: nothing that is not a folder on the way, and the nearest
    existing folder is writable."""
    for parent in [root, *root.parents]:
        if parent.exists():
            if not parent.is_dir():
                raise MasktrlError(f"{parent}: not a folder (a file is in the way of the run folder {root})")
            problem = disk_problem(parent, min_free=64 << 10)
            if problem is not None:
                raise MasktrlError(f"{parent}: {problem.strerror} (cannot write the run folder {root})")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise MasktrlError(f"{parent}: permission denied (cannot write the run folder {root})")
            return
