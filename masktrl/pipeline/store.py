"""The run directory: atomic writes, content hashes and the manifest of completed stages.

A stage (warm start, a step's rollout, a step's train update, a checkpoint, an eval) is done
only when ``manifest.json`` says so, and the manifest records the sha256 of every file the
stage wrote. The manifest is always replaced atomically (temporary file, fsync, rename), so a
crash at any moment leaves either the old or the new manifest, never a torn one.

Layout::

    outputs/<run>/run.yaml  manifest.json  metrics.jsonl  summary.json
                  steps/<step>/rollouts.parquet  checkpoints/<step>/  eval/  analysis/
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from masktrl.errors import ArtifactError
from masktrl.io import atomic_write_text, json_default, sha256_file

MANIFEST = "manifest.json"


def process_alive(pid: object) -> bool:
    """Whether a process with this id exists (a run's manifest records its trainer's pid)."""
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunStore:
    """One run's directory and its manifest."""

    def __init__(self, root: Path, *, writable: bool = True):
        self.root = Path(root)
        self.writable = writable
        self._manifest: dict | None = None
        self._written: tuple | None = None  # (mtime, size, inode) of the manifest this object last wrote
        self._pending: dict[str, dict] = {}  # deferred stages not yet written (mark_done(defer=True))

    def read_only(self) -> "RunStore":
        """A view that reads this run and writes nothing (the non-main processes of a
        multi-process run: only the main one writes). Its manifest is read now and kept, so
        every process takes its decisions from the same state."""
        view = RunStore(self.root, writable=False)
        view.manifest  # noqa: B018  (load it now)
        return view

    # -- paths
    @property
    def name(self) -> str:
        return self.root.name

    def step_dir(self, step: int) -> Path:
        return self.root / "steps" / f"{step:06d}"

    def checkpoint_dir(self, step: int) -> Path:
        return self.root / "checkpoints" / f"{step:06d}"

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    # -- manifest
    @property
    def manifest(self) -> dict:
        if self._manifest is None:
            path = self.root / MANIFEST
            if path.exists():
                try:
                    self._manifest = json.loads(path.read_text())
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise ArtifactError(f"{path}: manifest is unreadable (corrupted)") from None
            else:
                self._manifest = {"version": 1, "stages": {}}
            self._manifest["stages"].update(self._pending)  # re-read from disk: keep what is deferred
        return self._manifest

    def exists(self) -> bool:
        return (self.root / MANIFEST).exists()

    def is_done(self, stage: str) -> bool:
        return self.manifest["stages"].get(stage, {}).get("status") == "done"

    def stage(self, stage: str) -> dict | None:
        return self.manifest["stages"].get(stage)

    def mark_done(self, stage: str, files: list[Path], config_hash: str = "", defer: bool = False, **info: Any) -> None:
        """Record ``stage`` as complete with the sha256 of each of its files (paths under root).

        ``defer=True`` records it in memory only; it is written with the next manifest write.
        For stages whose loss costs nothing, like a step's update: it only becomes durable with
        the next checkpoint anyway (resume drops update records after the last checkpoint)."""
        if not self.writable:
            return
        hashes = {}
        for f in files:
            f = Path(f)
            for p in sorted(f.rglob("*")) if f.is_dir() else [f]:
                if p.is_file():
                    hashes[str(p.relative_to(self.root))] = sha256_file(p)
        entry = {"status": "done", "time": time.time(), "config_hash": config_hash, "files": hashes}
        entry.update(info)
        self.reload()
        self.manifest["stages"][stage] = entry
        if defer:
            self._pending[stage] = entry
        else:
            self.write_manifest()

    def set_info(self, **info: Any) -> None:
        if not self.writable:
            return
        self.reload()
        self.manifest.update(info)
        self.write_manifest()

    def reload(self) -> None:
        """Re-read the manifest if another process changed it since this one last wrote it (an
        eval of this run, say), so its stages are kept when this one writes."""
        path = self.root / MANIFEST
        try:
            st = path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp is None or stamp != self._written:
            self._manifest = None

    def write_manifest(self) -> None:
        if not self.writable:
            return
        # Compact: the manifest grows with every step and is rewritten at every stage; the
        # indented form was ~4x slower to encode (benchmarks/profile_step.py, io_share).
        text = json.dumps(self.manifest, separators=(",", ":"), sort_keys=True, default=json_default)
        path = self.root / MANIFEST
        atomic_write_text(path, text)
        st = path.stat()
        self._written = (st.st_mtime_ns, st.st_size, st.st_ino)
        self._pending.clear()

    def verify(self, stage: str) -> None:
        """Raise ArtifactError naming the first file of ``stage`` that is missing or changed."""
        entry = self.stage(stage)
        if entry is None or entry.get("status") != "done":
            raise ArtifactError(f"{self.root}: stage {stage} is not complete")
        for rel, digest in entry["files"].items():
            path = self.root / rel
            if not path.is_file():
                raise ArtifactError(f"{path}: missing (stage {stage})")
            if sha256_file(path) != digest:
                raise ArtifactError(f"{path}: content hash mismatch, file is corrupted (stage {stage})")

    # -- metrics
    def append_metrics(self, row: dict) -> None:
        if not self.writable:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        # No fsync: rows after the last checkpoint are recomputed on resume (and a torn last
        # line is skipped by read_metrics), so durability here buys nothing.
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row, sort_keys=True, default=json_default) + "\n")

    def read_metrics(self) -> list[dict]:
        if not self.metrics_path.exists():
            return []
        rows = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line from a crash; everything before it is intact
        return rows
