"""The run folder: one place that knows its layout, its manifest and what a complete artifact is.

A stage (warm start, a step's rollout, a step's train update, a checkpoint, an eval) is done
only when ``manifest.json`` says so, and the manifest records the sha256 of every file the
stage wrote. The manifest is always replaced atomically (temporary file, fsync, rename), so a
crash at any moment leaves either the old or the new manifest, never a torn one.

Layout::

    <out>/<run>/run.yaml  manifest.json  metrics.jsonl  summary.json
                steps/<step>/rollouts.parquet  checkpoints/<step>/  eval/  analysis/

Every command reads runs through this module: ``resolve_run`` (a name under ``--out`` or a
path), ``RunStore.config`` (run.yaml), ``status`` (with the trainer's pid checked),
``checkpoints`` (complete ones), ``starting_policy`` (step 0), ``policy_path``,
``rollout_steps`` / ``read_rollouts``, and resume's ``resume_step`` / ``rewind``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

from masktrl.config import Config, from_dict, save_config
from masktrl.errors import ArtifactError, ConfigError, MasktrlError
from masktrl.io import atomic_write_text, json_default, sha256_file
from masktrl.rollout.storage import read_rollouts, write_rollouts

MANIFEST = "manifest.json"


def is_run_folder(path: str | Path) -> bool:
    """Whether ``path`` is a masktrl run folder (it has its run.yaml)."""
    return (Path(path) / "run.yaml").is_file()


def resolve_run(run: str | Path, out: Path | None = None) -> Path:
    """A run folder from a path, or from a name under ``out``; ArtifactError if neither exists."""
    candidates = [Path(run)]
    if out is not None:
        candidates.append(Path(out) / str(run))
    for path in candidates:
        if is_run_folder(path):
            return path
    for path in candidates:
        if path.is_dir():
            raise ArtifactError(f"{path}: not a masktrl run folder (no run.yaml)")
    where = f" (looked in . and {out})" if out is not None else ""
    raise ArtifactError(f"unknown run {run}: no such folder{where}")


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
        self._resume_from: int | None = None  # resume_step's answer, once its checks passed

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

    # -- config, summary, status
    def config(self) -> Config:
        """The resolved config the run was started with (run.yaml)."""
        path = self.root / "run.yaml"
        try:
            return from_dict(yaml.safe_load(path.read_text()) or {})
        except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
            raise ArtifactError(f"{path}: unreadable run config ({str(exc).splitlines()[0]})") from None
        except ConfigError as exc:
            raise ArtifactError(f"{path}: invalid run config ({exc})") from None

    def record_config(self, cfg: Config, **info: Any) -> None:
        """Write run.yaml and record it as stage ``config`` with the config's hash."""
        if not self.writable:
            return
        save_config(cfg, self.root / "run.yaml")
        self.mark_done("config", [self.root / "run.yaml"], config_hash=cfg.hash(), **info)

    def summary(self) -> dict | None:
        """summary.json, written when the run completed (None before)."""
        path = self.root / "summary.json"
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ArtifactError(f"{path}: unreadable (corrupted)") from None

    def status(self) -> str:
        """running | interrupted | failed | complete | unknown; a run whose trainer died without a
        chance to say so (status running, no such process) is interrupted."""
        status = self.manifest.get("status", "unknown")
        if status == "running" and not process_alive(self.manifest.get("pid")):
            return "interrupted"
        return status

    @contextlib.contextmanager
    def recording_failure(self):
        """Record status ``interrupted`` (Ctrl-C) or ``failed`` (any other exception) if the block raises."""
        try:
            yield
        except KeyboardInterrupt:
            self.set_info(status="interrupted")
            raise
        except BaseException:
            self.set_info(status="failed")
            raise

    def is_complete(self) -> bool:
        return (self.root / "summary.json").is_file() and self.exists() and self.manifest.get("status") == "complete"

    def check_resumable(self) -> None:
        """Refuse to resume from a folder that is not a masktrl run or whose config file changed."""
        if not self.root.is_dir():
            raise MasktrlError(f"no run folder {self.root}")
        if not self.exists():
            raise ArtifactError(f"{self.root / MANIFEST}: missing, cannot resume this run")
        self.verify("config")

    # -- policies: step 0 (where RL started) and the checkpoints
    def checkpoints(self) -> list[int]:
        """Steps with a complete checkpoint: recorded done in the manifest and the folder present."""
        return [s for s in self._recorded_checkpoints() if self.checkpoint_dir(s).is_dir()]

    def _recorded_checkpoints(self) -> list[int]:
        return sorted(int(k.split("/")[1]) for k, v in self.manifest["stages"].items() if k.startswith("checkpoint/") and v.get("status") == "done")

    def starting_policy(self) -> str:
        """Where the run's RL started (step 0): its warm-start cache entry (also found beside the
        run if the outputs folder moved), or the model folder / hub id it loaded."""
        info = (self.stage("warmstart") or {}).get("info") or {}
        path = info.get("path") or info.get("source")
        if not path or path == "tiny":
            raise ArtifactError(f"{self.root}: the warm start is not recorded in the manifest; no starting policy (step 0)")
        if info.get("path"):
            for candidate in (Path(path), self.root.parent / ".cache" / "warmstart" / Path(path).name):
                if (candidate / "config.json").is_file():
                    return str(candidate)
            raise ArtifactError(f"{path}: the run's warm-start model is gone (was the .cache folder removed?)")
        if Path(path).exists() and not (Path(path) / "config.json").is_file():
            raise ArtifactError(f"{path}: the run's starting model is gone")
        return str(path)

    def policy_steps(self) -> list[int]:
        """Every step whose policy can be loaded: 0 (when the starting policy is known) and the checkpoints."""
        try:
            self.starting_policy()
            start = [0]
        except ArtifactError:
            start = []
        return start + self.checkpoints()

    def policy_path(self, step: int) -> str:
        """The weights after ``step`` updates (0: the starting policy), verified by hash."""
        if step == 0:
            return self.starting_policy()
        if step not in self.checkpoints():
            avail = ", ".join(["0 (starting policy)", *map(str, self.checkpoints())])
            raise ConfigError(f"run {self.root} has no checkpoint {step} (none complete at that step); available steps: {avail}")
        self.verify(f"checkpoint/{step:06d}")
        return str(self.checkpoint_dir(step))

    # -- rollouts
    def rollout_path(self, step: int) -> Path:
        return self.step_dir(step) / "rollouts.parquet"

    def rollout_steps(self) -> list[int]:
        steps_dir = self.root / "steps"
        if not steps_dir.is_dir():
            return []
        return sorted(int(p.name) for p in steps_dir.iterdir() if p.name.isdigit() and (p / "rollouts.parquet").is_file())

    def read_rollouts(self, step: int, *, verify: bool = False):
        """(samples, metadata) of step ``step``'s rollout batch; ``verify``: check its hash first."""
        path = self.rollout_path(step)
        if verify:
            self.verify(f"step/{step:06d}/rollout")
        elif not path.is_file():
            have = self.rollout_steps()
            span = f"{have[0]}..{have[-1]}" if have else "none"
            raise ArtifactError(f"{self.root}: no rollouts for step {step} (stored steps: {span})")
        return read_rollouts(path)

    def write_rollouts(self, step: int, samples, meta: dict) -> None:
        """Store step ``step``'s rollout batch and record it as stage ``step/<step>/rollout``."""
        path = self.rollout_path(step)
        if self.writable:
            write_rollouts(path, samples, meta)
        self.mark_done(f"step/{step:06d}/rollout", [path])

    # -- resume
    def resume_step(self) -> int:
        """The newest checkpoint the manifest records (0: none yet), after checking everything a
        resumed run will read (the stored rollout batches after it, the checkpoint's files) and
        before anything is changed. Reads only; the answer is kept, so the command can check a
        run before it records anything and training does not hash the files again."""
        if self._resume_from is not None:
            return self._resume_from
        step = (self._recorded_checkpoints() or [0])[-1]
        for key, entry in self.manifest["stages"].items():
            if entry.get("status") == "done" and key.startswith("step/") and key.endswith("/rollout") and int(key.split("/")[1]) > step:
                self.verify(key)
                read_rollouts(self.root / next(iter(entry["files"])))
        if step:
            self.verify(f"checkpoint/{step:06d}")
        self._resume_from = step
        return step

    def rewind(self, step: int) -> None:
        """Forget what happened after ``step``'s checkpoint: the update records (lost with the
        process) and the metrics rows (the steps are redone and write them again)."""
        self._resume_from = None
        for key in [k for k in self.manifest["stages"] if k.startswith("step/") and k.endswith("/train")]:
            if int(key.split("/")[1]) > step:
                del self.manifest["stages"][key]
        self.write_manifest()
        if self.writable:
            rows = [r for r in self.read_metrics() if r["step"] <= step]
            atomic_write_text(self.metrics_path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
