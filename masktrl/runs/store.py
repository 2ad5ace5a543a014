"""The run folder: one place that knows its layout, its manifest and what a complete artifact is.

A stage (warm start, a step's rollout, a step's train update, a checkpoint, an eval) is done
only when ``manifest.json`` says so, and the manifest records the sha256 of every file the
stage wrote. The manifest is always replaced atomically (temporary file, fsync, rename), so a
crash at any moment leaves either the old or the new manifest, never a torn one.

Layout::

    <out>/<run>/run.yaml  manifest.json  metrics.jsonl  summary.json
                steps/<step>/rollouts.parquet  checkpoints/<step>/  eval/  analysis/

A checkpoint's stage also lists its folder (``dirs``), so a file added to it fails ``verify``
like a changed or missing one; each checkpoint and the summary record a digest of the metrics
lines up to them (``metrics_digest``), which every ``read_metrics`` checks. Every path read from
the manifest goes through ``RunStore.path`` (``inside``): no absolute path, no ``..``, no
symbolic link on the way. Each write operation is ordered so that a SIGKILL between any two of
its writes leaves a state the same command continues (``record_config``, ``restart``,
``write_summary``, ``rewind``; docs/RELIABILITY.md).

Every command reads runs through this module: ``resolve_run`` (a name under ``--out`` only, or a
path), ``RunStore.config`` (run.yaml), ``status`` (with the trainer's pid checked),
``checkpoints`` (complete ones), ``starting_policy`` (step 0), ``policy_path``,
``rollout_steps`` / ``read_rollouts``, and resume's ``resume_step`` / ``rewind``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import time
import unicodedata
from pathlib import Path, PurePosixPath
from typing import Any

from masktrl.config import Config, from_dict, save_config
from masktrl.errors import ArtifactError, ConfigError, MasktrlError
from masktrl.io import atomic_write_json, atomic_write_text, json_default, memory_error_line, naming, sha256_file
from masktrl.methods.corrections import RATIO_KINDS
from masktrl.readers import MAX_DEPTH, json_depth, read_json, read_yaml
from masktrl.rollout.storage import read_rollouts, write_rollouts
from masktrl.runs import locks
from masktrl.runs.faults import maybe_crash_nth

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1  # the manifest layout this masktrl writes and reads
MAX_NAME_BYTES = 200
PENDING_CONFIG = "run.yaml.new"  # a new run.yaml the manifest already records, not yet renamed into place


def relative_problem(rel: str) -> str | None:
    """Why a path read from a file (a manifest entry, a cache record) cannot name a file inside
    its folder: absolute, empty, or holding ``..`` or a backslash. None if it can."""
    if not isinstance(rel, str) or not rel or rel.startswith(("/", "\\")) or "\\" in rel or "\x00" in rel:
        return "not a relative path"
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or any(p in ("..", ".") for p in parts) or rel != "/".join(parts):
        return "it leaves the folder (absolute, '..' or not a plain relative path)"
    return None


def inside(root: Path, rel: str, *, what: str) -> Path:
    """``root / rel`` for a path ``rel`` read from a file, refused (ArtifactError naming ``what``)
    when it leaves ``root``: lexically (``..``, absolute) or through a symbolic link on the way
    (a symlinked ``eval/`` or ``checkpoints/`` is refused, never followed)."""
    problem = relative_problem(rel)
    if problem:
        raise ArtifactError(f"{what}: path {rel!r} refused: {problem}")
    path = Path(root)
    for part in PurePosixPath(rel).parts:
        path = path / part
        if path.is_symlink():
            raise ArtifactError(f"{path}: a symbolic link inside {root}; refused (not followed)")
    return path


def folder_files(folder: Path) -> list[str]:
    """Every file under ``folder`` as a relative POSIX path, sorted; ArtifactError on a symbolic
    link (a folder whose files are hashed holds plain files only)."""
    folder = Path(folder)
    names = []
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():
            raise ArtifactError(f"{p}: a symbolic link inside {folder}; refused (not followed)")
        if p.is_file():
            names.append(p.relative_to(folder).as_posix())
    return names


def folder_problem(folder: Path, recorded: dict, ignore: tuple[str, ...] = ()) -> str | None:
    """Why ``folder`` is not exactly the files ``recorded`` (relative path -> sha256): a file
    added, missing or changed (named); None if it matches."""
    if not isinstance(recorded, dict) or not recorded:
        return "no file hashes recorded"
    for rel in recorded:
        if relative_problem(rel):
            return f"recorded path {rel!r} leaves the folder"
    try:
        present = [n for n in folder_files(folder) if n not in ignore]
    except ArtifactError as exc:
        return str(exc)
    for name in present:
        if name not in recorded:
            return f"{name} was added (not among the files recorded)"
    for name, digest in recorded.items():
        path = Path(folder) / name
        if not path.is_file():
            return f"{name} is missing"
        if sha256_file(path) != digest:
            return f"{name} fails its sha256 check (changed since it was written)"
    return None


def check_run_name(name: str) -> str:
    """A run name is one folder directly under ``--out``: no path separators, not hidden (no
    leading dot, so not ``.`` or ``..``: ``.cache`` holds the warm starts), no control
    characters, at most 200 bytes. Returns the name; ConfigError otherwise."""
    bad = None
    if not name or not name.strip():
        bad = "it is empty"
    elif not _is_utf8(name):
        bad = "it holds bytes that are not UTF-8"
    elif "/" in name or "\\" in name or (os.altsep and os.altsep in name):
        bad = "it holds a path separator; a run is one folder under --out (use --out to choose where)"
    elif name.startswith("."):
        bad = "it starts with a dot"
    elif ".." in name:
        bad = "it holds '..'"
    elif any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in name):
        bad = "it holds a control character"
    elif len(name.encode()) > MAX_NAME_BYTES:
        bad = f"it is longer than {MAX_NAME_BYTES} bytes"
    if bad:
        raise ConfigError(f"invalid run name {name!r}: {bad}")
    return name


def _is_utf8(text: str) -> bool:
    """Whether ``text`` is valid text (a command-line argument with bytes that are not UTF-8
    holds lone surrogates: Python's ``surrogateescape``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_fresh_folder(path: str | Path) -> bool:
    """A folder that does not exist, or holds nothing a run recorded: at most a writer's lock
    file, a run.yaml without a manifest, and temporary files of writes that never finished."""
    path = Path(path)
    if not path.exists():
        return True
    if not path.is_dir():
        return False
    return all(
        p.name in (locks.LOCK_NAME, locks.MANIFEST_LOCK_NAME, "run.yaml")
        or (p.name.startswith(".") and p.name.endswith(".tmp"))
        for p in path.iterdir()
    )


def is_run_folder(path: str | Path) -> bool:
    """Whether ``path`` is a masktrl run folder (it has its run.yaml)."""
    return (Path(path) / "run.yaml").is_file()


def is_path_like(run: str | Path) -> bool:
    """Whether ``run`` was given as a path (holds a separator, or starts with ``.`` or ``~``)
    rather than as a run's name: a name resolves under ``--out`` only, never in the current folder."""
    text = str(run)
    return (
        isinstance(run, Path)
        or "/" in text
        or (os.altsep is not None and os.altsep in text)
        or text.startswith((".", "~"))
    )


def resolve_run(run: str | Path, out: Path | None = None) -> Path:
    """A run folder from a path (``./NAME``, ``out/NAME``, an absolute path), or from a name under
    ``out`` (only there: ``--resume r0`` never picks ``./r0``); ArtifactError if it is not a run."""
    if is_path_like(run) or out is None:
        path = Path(run).expanduser()
        where = ""
    else:
        path = Path(out) / str(run)
        where = f" under {out} (a run elsewhere is given as a path: ./{run})"
    if is_run_folder(path):
        return path
    if path.is_dir():
        raise ArtifactError(f"{path}: not a masktrl run folder (no run.yaml)")
    if path.exists():
        raise ArtifactError(f"{path}: a file, not a run folder")
    raise ArtifactError(f"unknown run {run}: no such folder{where}")


def warmstart_cache(out: str | Path) -> Path:
    """Where the warm starts of the runs under ``out`` are cached: ``<out>/.cache/warmstart/``."""
    return Path(out) / ".cache" / "warmstart"


# -- stage keys: the one place that formats and parses them
def step_name(step: int) -> str:
    """A step's folder name under ``steps/`` and ``checkpoints/``: ``000012``."""
    return f"{step:06d}"


def rollout_key(step: int) -> str:
    """The stage of a step's stored rollout batch: ``step/000012/rollout``."""
    return f"step/{step_name(step)}/rollout"


def update_key(step: int) -> str:
    """The stage of a step's policy update: ``step/000012/train``."""
    return f"step/{step_name(step)}/train"


def checkpoint_key(step: int) -> str:
    """The stage of a checkpoint: ``checkpoint/000012``."""
    return f"checkpoint/{step_name(step)}"


LORA_BASE_KEY = "lora-base"
"""The stage of a LoRA run's base weights (``RunStore.lora_base_dir``), saved once."""

WARMSTART_KEY = "warmstart"
"""The stage of the run's starting policy (where it came from: ``prepare_policy``'s info)."""

EVAL_BEFORE_KEY, EVAL_AFTER_KEY = "eval/before", "eval/after"
"""The stages of held-out accuracy before the first update and after the last one."""


def eval_key(bench: str, step: int) -> str:
    """The stage of a benchmark eval of the policy after ``step`` updates: ``eval/math500/000012``."""
    return f"eval/{bench}/{step_name(step)}"


def key_step(key: str) -> int:
    """The step a ``step/...`` or ``checkpoint/...`` stage names."""
    return int(key.split("/")[1])


def stage_kind(key: str) -> str | None:
    """``rollout``, ``train`` or ``checkpoint`` for the stages of a step; None for others."""
    if key.startswith("checkpoint/"):
        return "checkpoint"
    if key.startswith("step/"):
        return key.rsplit("/", 1)[-1]
    return None


def done_steps(stages: dict, kind: str, status: str | None = "done") -> list[int]:
    """The steps whose ``kind`` stage (rollout | train | checkpoint) has ``status`` (None: any), sorted."""
    return sorted(key_step(k) for k, v in stages.items() if stage_kind(k) == kind and status in (None, v.get("status")))


def eval_steps(stages: dict, bench: str) -> list[int]:
    """The steps of the done ``eval/<bench>/<S>`` stages (a run's benchmark evals), sorted."""
    prefix = f"eval/{bench}/"
    return sorted(
        int(k.removeprefix(prefix))
        for k, v in stages.items()
        if k.startswith(prefix) and k.removeprefix(prefix).isdigit() and v.get("status") == "done"
    )


def legacy_ratio_ref(raw: Any) -> Any:
    """A run.yaml written before ``method.correction.ref`` existed (every config records it since,
    for the ratio kinds): its bypass-mode ratio correction took rho against the current policy,
    so it reads as ``ref: current`` (docs/METHODS.md §14), the rule it trained with. Decoupled mode
    always took rho against pi_old, the default."""
    corr = (
        raw.get("method", {}).get("correction")
        if isinstance(raw, dict) and isinstance(raw.get("method"), dict)
        else None
    )
    if (
        isinstance(corr, dict)
        and corr.get("kind") in RATIO_KINDS
        and "ref" not in corr
        and corr.get("mode", "bypass") == "bypass"
    ):
        corr["ref"] = "current"
    return raw


class RunStore:
    """One run's directory and its manifest."""

    def __init__(self, root: Path, *, writable: bool = True):
        self.root = Path(root)
        self.writable = writable
        self._manifest: dict | None = None
        self._written: tuple | None = None  # (mtime, size, inode) of the manifest this object last wrote
        self._pending: dict[str, dict] = {}  # deferred stages not yet written (mark_done(defer=True))
        self._resume_from: int | None = None  # resume_step's answer, once its checks passed

    def read_only(self) -> RunStore:
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

    def path(self, rel: str) -> Path:
        """``root / rel`` for a path read from the manifest (or a layout path), refused when it
        leaves the run folder (``..``, absolute, or a symbolic link on the way)."""
        return inside(self.root, rel, what=str(self.root / MANIFEST))

    def step_dir(self, step: int) -> Path:
        return self.path(f"steps/{step_name(step)}")

    def checkpoint_dir(self, step: int) -> Path:
        return self.path(f"checkpoints/{step_name(step)}")

    def eval_path(self, bench: str, step: int) -> Path:
        """``eval/<bench>-step<S>.json``: where an eval of the policy after ``step`` updates is stored."""
        return self.path(f"eval/{bench}-step{step}.json")

    @property
    def lora_base_dir(self) -> Path:
        """``<run>/base/``: the tiny model's base weights of a LoRA run, which its adapter
        checkpoints name as ``../../base``."""
        return self.root / "base"

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    # -- manifest
    @property
    def manifest(self) -> dict:
        if self._manifest is None:
            path = self.root / MANIFEST
            if path.exists():
                self._manifest = _read_manifest(path)
            else:
                self._manifest = {"version": MANIFEST_VERSION, "stages": {}}
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
        hashes, dirs = {}, []
        for f in files:
            f = Path(f)
            if f.is_dir():
                dirs.append(f.relative_to(self.root).as_posix())
                for name in folder_files(f):
                    hashes[f"{dirs[-1]}/{name}"] = sha256_file(f / name)
            elif f.is_file():
                hashes[f.relative_to(self.root).as_posix()] = sha256_file(f)
        entry = {"status": "done", "time": time.time(), "config_hash": config_hash, "files": hashes}
        if dirs:
            entry["dirs"] = dirs  # a folder's stage: a file added to it fails verify too
        entry.update(info)
        if defer:
            self.reload()
            self.manifest["stages"][stage] = entry
            self._pending[stage] = entry
            return
        with self.updating() as manifest:
            manifest["stages"][stage] = entry

    def set_info(self, **info: Any) -> None:
        if not self.writable:
            return
        with self.updating() as manifest:
            manifest.update(info)

    @contextlib.contextmanager
    def updating(self):
        """Read-modify-write of the manifest: yields it (re-read if another process changed it)
        and writes it after the block, under the run's manifest lock, so a stage that another
        process records meanwhile (an eval of this run) is never lost."""
        with locks.manifest_lock(self.root):
            self.reload()
            manifest = self.manifest
            yield manifest
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
        maybe_crash_nth("manifest-write")
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
            path = self.path(rel)
            if stage == "config" and rel == "run.yaml":
                path = self._config_file(digest)
            if not path.is_file():
                raise ArtifactError(f"{path}: missing (stage {stage})")
            if sha256_file(path) != digest:
                raise ArtifactError(f"{path}: content hash mismatch, file is corrupted (stage {stage})")
        for folder in entry.get("dirs", []):
            for name in folder_files(self.path(folder)):
                if f"{folder}/{name}" not in entry["files"]:
                    raise ArtifactError(
                        f"{self.root / folder / name}: not a file of stage {stage} (added after it "
                        "was recorded); "
                        "remove it or restore the folder"
                    )

    # -- metrics
    def append_metrics(self, row: dict) -> None:
        if not self.writable:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        # No fsync: rows after the last checkpoint are recomputed on resume (and a torn last
        # line is skipped by read_metrics), so durability here buys nothing.
        with naming(self.metrics_path), open(self.metrics_path, "a") as f:
            f.write(json.dumps(row, sort_keys=True, default=json_default) + "\n")

    def sync_metrics(self) -> None:
        """Make the rows appended so far durable (fsync): done before a checkpoint is recorded,
        so a checkpoint never exists without the metrics rows of its steps."""
        if not self.writable:
            return
        try:
            fd = os.open(self.metrics_path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            with naming(self.metrics_path):
                os.fsync(fd)
        finally:
            os.close(fd)

    def _metrics_lines(self) -> list[bytes]:
        """metrics.jsonl's lines, each with its newline (a torn last line without one)."""
        try:
            data = read_regular(self.metrics_path)
        except FileNotFoundError:
            return []
        parts = data.split(b"\n")
        return [p + b"\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])

    def metrics_digest(self) -> dict:
        """``{"lines": n, "sha256": h}`` of metrics.jsonl as it is now (its complete lines):
        recorded with each checkpoint and the summary, checked by every reader."""
        lines = [line for line in self._metrics_lines() if line.endswith(b"\n")]
        return {"lines": len(lines), "sha256": hashlib.sha256(b"".join(lines)).hexdigest()}

    def _metrics_record(self) -> tuple[str, dict] | None:
        """(stage, digest) of the newest metrics digest the manifest records: the summary's, else
        the newest checkpoint's (pruned checkpoints keep theirs)."""
        stages = self.manifest["stages"]
        summary = stages.get("summary") or {}
        if summary.get("status") == "done" and isinstance(summary.get("metrics"), dict):
            return "summary", summary["metrics"]
        for step in reversed(done_steps(stages, "checkpoint", status=None)):
            entry = stages[checkpoint_key(step)]
            if entry.get("status") in ("done", "pruned") and isinstance(entry.get("metrics"), dict):
                return checkpoint_key(step), entry["metrics"]
        return None

    def _check_metrics_digest(self, lines: list[bytes], record: tuple[str, dict] | None) -> int:
        """Raise ArtifactError unless the first lines of ``lines`` are exactly those ``record``
        hashed; returns how many lines it covers."""
        if record is None:
            return 0
        stage, digest = record
        n = digest.get("lines")
        if (
            not isinstance(n, int)
            or n < 0
            or len(lines) < n
            or hashlib.sha256(b"".join(lines[:n])).hexdigest() != digest.get("sha256")
        ):
            raise ArtifactError(
                f"{self.metrics_path}: the rows up to {stage} fail their sha256 check (recorded in "
                "the manifest); "
                "the file was damaged or edited, restore it"
            )
        return n

    def read_metrics(self, *, verify: bool = True) -> list[dict]:
        """The rows of metrics.jsonl, checked against the newest digest the manifest records
        (``verify``) and, after it, one row per step in order (rows of steps after the last
        checkpoint that no digest covers yet). A torn last line (a crash in the middle of an
        append: no newline after it) is left out; any other line that is not a JSON object with
        an integer ``step`` raises ArtifactError naming its line number."""
        raw = self._metrics_lines()
        if not raw:
            return []
        lines = [line[:-1] if line.endswith(b"\n") else line for line in raw]
        if raw[-1].endswith(b"\n"):
            lines.append(b"")
        rows = []
        for number, line in enumerate(lines, 1):
            last = number == len(lines)
            if last and not line.strip():
                break
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                if last:
                    break  # torn by a crash; everything before it is intact
                raise ArtifactError(
                    f"{self.metrics_path}: line {number} is not valid JSON (the file is damaged)"
                ) from None
            if not isinstance(row, dict) or isinstance(row.get("step"), bool) or not isinstance(row.get("step"), int):
                raise ArtifactError(
                    f"{self.metrics_path}: line {number} is not a metrics row (a JSON object with an integer step)"
                )
            rows.append(row)
        if verify and self.exists():
            covered = self._check_metrics_digest(raw, self._metrics_record())
            for number in range(max(covered, 1), len(rows)):
                if rows[number]["step"] != rows[number - 1]["step"] + 1:
                    raise ArtifactError(
                        f"{self.metrics_path}: line {number + 1} is step {rows[number]['step']} "
                        "after step "
                        f"{rows[number - 1]['step']} (one row per step, in "
                        "order); the file was damaged or edited, restore it"
                    )
        return rows

    def check_metrics(self, step: int) -> None:
        """Raise ArtifactError unless metrics.jsonl holds exactly one row for each step 1..``step``,
        in order, whose lines are those checkpoint ``step`` hashed, and after them at most one row
        per later step, in order (what resume keeps: a checkpoint's steps cannot be recomputed;
        rows appended twice are damage, not progress)."""
        rows = self.read_metrics(verify=False)  # a damaged line is named first
        have = [r["step"] for r in rows if r["step"] <= step]
        for expected, got in zip(range(1, step + 1), have + [None]):
            if got != expected:
                what = f"step {got} where step {expected} belongs" if got is not None else f"no row for step {expected}"
                raise ArtifactError(
                    f"{self.metrics_path}: {what} (the rows of steps 1..{step} must precede "
                    f"checkpoint {step}); "
                    "the file was damaged or edited, restore it to resume"
                )
        for a, b in zip(rows, rows[1:]):
            if b["step"] != a["step"] + 1:
                raise ArtifactError(
                    f"{self.metrics_path}: a row of step {b['step']} follows step {a['step']} "
                    "(one row per step, in order); the file was damaged or "
                    "edited, restore it to resume"
                )
        entry = self.stage(checkpoint_key(step)) or {} if step else {}
        if isinstance(entry.get("metrics"), dict):
            self._check_metrics_digest(self._metrics_lines(), (checkpoint_key(step), entry["metrics"]))

    # -- config, summary, status
    def _config_file(self, digest: str | None = None) -> Path:
        """The file holding the run's config: run.yaml or, when a write was cut between recording
        a new run.yaml and renaming it into place, run.yaml.new if that is the one the manifest's
        hash names."""
        path = self.root / "run.yaml"
        pending = self.root / PENDING_CONFIG
        if digest is None:
            digest = ((self.stage("config") or {}).get("files") or {}).get("run.yaml") if self.exists() else None
        if digest and pending.is_file() and not pending.is_symlink() and sha256_file(pending) == digest:
            if not path.is_file() or sha256_file(path) != digest:
                return pending
        return path

    def settle(self) -> None:
        """The writer, under the run's lock, before anything else: finish what a crash cut short
        (a run.yaml rename the manifest already records, the deletion of a restart's stale
        files), or drop a run.yaml.new the manifest never recorded."""
        if not self.writable or not self.exists():
            return
        self._delete_stale()
        pending = self.root / PENDING_CONFIG
        if not pending.exists():
            return
        if self._config_file() == pending:
            os.replace(pending, self.root / "run.yaml")
        else:
            pending.unlink(missing_ok=True)

    def config(self) -> Config:
        """The resolved config the run was started with (run.yaml), checked against the hash the
        manifest records (when it records one)."""
        path = self._config_file()
        digest = ((self.stage("config") or {}).get("files") or {}).get("run.yaml") if self.exists() else None
        if digest and path.is_file() and sha256_file(path) != digest:
            raise ArtifactError(f"{path}: content hash mismatch, file is corrupted (stage config)")
        try:
            return from_dict(
                legacy_ratio_ref(read_yaml(path, error=ArtifactError) or {})
            )  # bounded: depth, aliases, duplicate keys
        except OSError as exc:
            raise ArtifactError(f"{path}: unreadable run config ({str(exc).splitlines()[0]})") from None
        except ConfigError as exc:
            raise ArtifactError(f"{path}: invalid run config ({exc})") from None

    def record_config(self, cfg: Config, *, run: dict | None = None, **info: Any) -> None:
        """Write run.yaml and record it as stage ``config`` with the config's hash, together with
        the run's entries ``run`` (status, pid...) in the same manifest write.

        A run that has a manifest already (``--resume --force``) gets its new config as
        run.yaml.new first, then the manifest records it, then it is renamed into place: a crash
        between any two leaves either the old config recorded (run.yaml.new is dropped) or the
        new one (the rename is finished by the next writer; readers read run.yaml.new meanwhile)."""
        if not self.writable:
            return
        pending = self.exists()
        path = self.root / (PENDING_CONFIG if pending else "run.yaml")
        save_config(cfg, path)
        maybe_crash_nth("config-write")
        entry = {
            "status": "done",
            "time": time.time(),
            "config_hash": cfg.hash(),
            "files": {"run.yaml": sha256_file(path)},
            **info,
        }
        for (
            key,
            f,
        ) in (
            cfg.method.files.items()
        ):  # a rule from a file: the content it trains with (docs/METHODS.md "Writing your own rule")
            entry["correction_file" if "correction" in key else "rule_file"] = {
                "path": f.path,
                "sha256": f.recorded or f.sha256,
            }
        with self.updating() as manifest:
            manifest["stages"]["config"] = entry
            manifest.update(run or {})
        if pending:
            maybe_crash_nth("config-rename")
            os.replace(path, self.root / "run.yaml")

    def summary(self) -> dict | None:
        """summary.json, written when the run completed (None before, and while the manifest does
        not record it), checked against the sha256 the manifest records."""
        if not self.is_done("summary"):
            return None
        # Recorded: missing, a symbolic link, not a regular file (a device, a FIFO) or changed is one
        # line, checked before the file is read (a deleted summary read as "not complete yet", one
        # linked to /dev/zero too, and one linked outside the run was read before it was refused).
        self.verify("summary")
        path = self.path("summary.json")
        summary = read_json(path, error=ArtifactError, finite=False)  # one line for broken or too deep JSON
        if not isinstance(summary, dict):
            raise ArtifactError(f"{path}: not a run summary (a JSON {type(summary).__name__}, not an object)")
        return summary

    def status(self) -> str:
        """running | interrupted | failed | complete | unknown; a run whose trainer died without a
        chance to say so (status running, nobody holds the run's lock) is interrupted."""
        status = self.manifest.get("status", "unknown")
        if status == "running" and not self.writer_alive():
            return "interrupted"
        return status

    def writer_alive(self) -> bool:
        """Whether a process is writing this run: it holds the run's lock."""
        if locks.holds(self.root):  # this process: alive if it is the trainer the manifest names
            return self.manifest.get("pid") == os.getpid()
        return locks.holder(self.root) is not None

    # -- one writer
    @contextlib.contextmanager
    def writing(self):
        """This process is the run's only writer for the block (``runs/locks.py``): the
        folder is created and locked, or RunBusyError names the process that writes it. A
        read-only view takes nothing."""
        if not self.writable:
            yield
            return
        with locks.holding(self.root):
            yield

    @contextlib.contextmanager
    def recording_failure(self, extra=None):
        """Record status ``interrupted`` (Ctrl-C, SIGTERM) or ``failed`` with the reason (any
        other exception, ``SystemExit`` included) if the block raises, with ``extra()``'s entries.
        Best effort: a full or read-only disk that stopped the run may refuse this write too,
        and the original error is what the user must see."""
        try:
            yield
        except KeyboardInterrupt:
            self._record_end(extra, status="interrupted")
            raise
        except BaseException as exc:
            self._record_end(extra, status="failed", reason=failure_reason(exc))
            raise

    def _record_end(self, extra, **info: Any) -> None:
        try:
            self.set_info(**info, **(extra() if extra else {}))
        except Exception:  # (see recording_failure)
            pass

    def recorded_wall_time(self) -> float:
        """Wall time of the run's earlier sessions, as the last of them recorded it (at each
        checkpoint and when it ended)."""
        return float(self.manifest.get("wall_time_s") or 0.0)

    def write_summary(self, summary: dict, *, step: int) -> None:
        """Write summary.json (after making the metrics rows durable), record it as stage
        ``summary`` at ``step`` and mark the run complete."""
        path = self.root / "summary.json"
        if not self.writable:
            return
        self.sync_metrics()
        atomic_write_json(path, summary)
        maybe_crash_nth("summary-write")
        entry = {
            "status": "done",
            "time": time.time(),
            "config_hash": "",
            "files": {"summary.json": sha256_file(path)},
            "step": step,
            "metrics": self.metrics_digest(),
        }
        with self.updating() as manifest:  # one write: the summary recorded and the run complete
            manifest["stages"]["summary"] = entry
            manifest.update(status="complete", wall_time_s=summary["wall_time_s"])

    def restart(self, cfg: Config, *, run: dict | None = None) -> None:
        """Start this folder's run again from scratch with ``cfg``: a failed or interrupted run
        without a completed checkpoint, re-run with another config (``runs/plan.py``). The files
        its stages recorded (stored rollouts, evals) and its metrics are deleted, as nothing of
        them can be reused; the manifest keeps how each earlier attempt ended.

        The order leaves a way back at every point, and never a stage recorded without its
        files: every path is checked first; the new config goes to run.yaml.new (a crash here
        leaves the old run, which the same command restarts again); one manifest write resets
        the stages, records the new config with the run's entries ``run`` and lists the old
        files as ``stale`` (a crash after it leaves a run of the new config with nothing done,
        which the same command continues: ``settle`` deletes the stale files first); the files
        are deleted; run.yaml.new is renamed into place."""
        if not self.writable:
            return
        old = self.manifest
        stale = [rel for name, entry in old["stages"].items() if name != "config" for rel in entry.get("files", {})]
        stale += [rel for rel in ("metrics.jsonl", "summary.json") if rel not in stale]
        for rel in stale:
            self.path(rel)  # every path checked before anything is written or deleted
        pending = self.root / PENDING_CONFIG
        save_config(cfg, pending)
        maybe_crash_nth("config-write")
        attempts = [
            *old.get("attempts", []),
            {"status": old.get("status"), "reason": old.get("reason"), "restarted": time.time()},
        ]
        config = {
            "status": "done",
            "time": time.time(),
            "config_hash": cfg.hash(),
            "files": {"run.yaml": sha256_file(pending)},
        }
        self._manifest = {
            "version": MANIFEST_VERSION,
            "stages": {"config": config},
            "attempts": attempts,
            "status": old.get("status"),
            "reason": old.get("reason"),
            "stale": stale,
            **(run or {}),
        }
        self._pending.clear()
        with locks.manifest_lock(self.root):
            self.write_manifest()
        maybe_crash_nth("restart-delete")
        self._delete_stale()
        maybe_crash_nth("config-rename")
        os.replace(pending, self.root / "run.yaml")

    def _delete_stale(self) -> None:
        """Delete the files a restart left as ``stale`` (none of them is recorded by a stage any
        more); the list goes with the next manifest write."""
        stale = self.manifest.get("stale")
        if not isinstance(stale, list):
            return
        recorded = {rel for entry in self.manifest["stages"].values() for rel in entry.get("files", {})}
        for rel in stale:
            if isinstance(rel, str) and rel not in recorded:
                self.path(rel).unlink(missing_ok=True)
        self.manifest.pop("stale", None)

    def is_complete(self) -> bool:
        return (self.root / "summary.json").is_file() and self.exists() and self.manifest.get("status") == "complete"

    def verify_config(self) -> None:
        """run.yaml against the hash the manifest records, when it records one (``masktrl runs``
        lists a run that fails it as damaged, as every reader of the run refuses it)."""
        if self.is_done("config"):
            self.verify("config")

    def check_resumable(self) -> None:
        """Refuse to resume from a folder that is not a masktrl run or whose config file changed."""
        if not self.root.is_dir():
            raise MasktrlError(f"no run folder {self.root}")
        if not self.exists():
            raise ArtifactError(f"{self.root / MANIFEST}: missing, cannot resume this run")
        self.verify("config")

    # -- policies: step 0 (where RL started) and the checkpoints
    def checkpoints(self) -> list[int]:
        """Steps with a complete checkpoint: recorded done in the manifest and the folder present
        (a symlinked ``checkpoints/`` is refused)."""
        return [s for s in self._recorded_checkpoints() if self.checkpoint_dir(s).is_dir()]

    def _recorded_checkpoints(self) -> list[int]:
        return done_steps(self.manifest["stages"], "checkpoint")

    def starting_policy(self) -> str:
        """Where the run's RL started (step 0): its warm-start cache entry, read from the run's
        own outputs folder (``<out>/.cache/warmstart/<key>``, also when the outputs folder moved;
        never from wherever the manifest's path points), or the model folder / hub id it loaded."""
        info = (self.stage(WARMSTART_KEY) or {}).get("info") or {}
        path = info.get("path") or info.get("source")
        if not path or path == "tiny":
            raise ArtifactError(
                f"{self.root}: the warm start is not recorded in the manifest; no starting policy (step 0)"
            )
        if info.get("path"):
            entry = inside(warmstart_cache(self.root.parent), Path(str(path)).name, what=str(self.root / MANIFEST))
            if entry.is_symlink():
                raise ArtifactError(f"{entry}: a symbolic link in the warm-start cache; refused (not followed)")
            if not (entry / "config.json").is_file():
                raise ArtifactError(f"{entry}: the run's warm-start model is gone (was the .cache folder removed?)")
            problem = folder_problem(
                entry, info.get("files") or {}, ignore=("warmstart.json",)
            )  # as the run recorded it
            if problem:
                raise ArtifactError(
                    f"{entry}: the run's warm-start model changed or is gone ({problem}; fails its sha256 check)"
                )
            return str(entry)
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
            raise ConfigError(
                f"run {self.root} has no checkpoint {step} (none complete at that step); available steps: {avail}"
            )
        self.verify(checkpoint_key(step))
        return str(self.checkpoint_dir(step))

    # -- rollouts
    def rollout_path(self, step: int) -> Path:
        return self.step_dir(step) / "rollouts.parquet"

    def rollout_steps(self) -> list[int]:
        """The steps whose rollout batch the manifest records as stored. A recorded batch whose file
        is gone is not left out (an analysis then ran on the other steps without a word): reading it
        names the file (``read_rollouts``)."""
        return done_steps(self.manifest["stages"], "rollout")

    def read_rollouts(self, step: int, *, verify: bool = True, vocab_size: int | None = None):
        """(samples, metadata) of step ``step``'s rollout batch, checked against the sha256 the
        manifest records (every reader: a batch the manifest does not record is not read) and
        validated row by row (token ids below ``vocab_size`` when it is given)."""
        path = self.rollout_path(step)
        if not self.is_done(rollout_key(step)):
            have = self.rollout_steps()
            span = f"{have[0]}..{have[-1]}" if have else "none"
            raise ArtifactError(f"{self.root}: no rollouts recorded for step {step} (stored steps: {span})")
        self.verify(rollout_key(step))
        return read_rollouts(path, vocab_size=vocab_size)

    def write_rollouts(self, step: int, samples, meta: dict) -> None:
        """Store step ``step``'s rollout batch and record it as stage ``step/<step>/rollout``."""
        path = self.rollout_path(step)
        if self.writable:
            write_rollouts(path, samples, meta)
        self.mark_done(rollout_key(step), [path])

    # -- resume
    def resume_step(self, vocab_size: int | None = None) -> int:
        """The newest checkpoint the manifest records (0: none yet), after checking everything a
        resumed run will read (the stored rollout batches after it, by hash and row by row with
        token ids below ``vocab_size``; the checkpoint's files; the metrics rows up to it) and
        before anything is changed. Reads only; the answer is kept, so the command can check a
        run before it records anything and training does not hash the files again."""
        if self._resume_from is not None:
            return self._resume_from
        step = (self._recorded_checkpoints() or [0])[-1]
        for later in done_steps(self.manifest["stages"], "rollout"):
            if later > step:
                self.verify(rollout_key(later))
                read_rollouts(self.path(next(iter(self.stage(rollout_key(later))["files"]))), vocab_size=vocab_size)
        if step:
            self.verify(checkpoint_key(step))
        self.check_metrics(step)
        self._resume_from = step
        return step

    def drop_rollouts_after(self, step: int) -> list[int]:
        """Delete the stored rollout batches of the steps after ``step`` (their stages first, then
        their files: a kill in between leaves a file no stage names, which nothing reads); the
        steps dropped. For ``--resume --force`` with settings the batches were not made with."""
        later = [s for s in done_steps(self.manifest["stages"], "rollout") if s > step]
        if not later or not self.writable:
            return later
        with self.updating() as manifest:
            for s in later:
                manifest["stages"].pop(rollout_key(s), None)
        for s in later:
            self.rollout_path(s).unlink(missing_ok=True)
        return later

    def rewind(self, step: int) -> None:
        """Forget what happened after ``step``'s checkpoint: the update records (lost with the
        process) and the metrics rows (the steps are redone and write them again)."""
        self._resume_from = None
        if not self.writable:
            return
        with self.updating() as manifest:
            for later in done_steps(manifest["stages"], "train", status=None):
                if later > step:
                    del manifest["stages"][update_key(later)]
        maybe_crash_nth("rewind-metrics")
        lines = self._metrics_lines()
        keep = len(
            [r for r in self.read_metrics(verify=False) if r["step"] <= step]
        )  # they lead the file (check_metrics)
        atomic_write_text(
            self.metrics_path, b"".join(lines[:keep]).decode()
        )  # the lines as written: their digest holds


def failure_reason(exc: BaseException) -> str:
    """The first line of an exception, as ``manifest.json`` records why a run failed."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, MasktrlError) and text:
        return text
    memory = memory_error_line(exc) if isinstance(exc, Exception) else None
    if memory is not None:
        return memory
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def read_regular(path: Path) -> bytes:
    """The bytes of ``path``, a regular file (or a link to one); ArtifactError for a FIFO, a device
    or a folder in its place: reading a FIFO hung and a link to /dev/zero filled memory
    (``masktrl runs``, every reader of the run). FileNotFoundError passes through."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ArtifactError(f"{path}: not a regular file (a FIFO, a device or a folder in its place)")
    return Path(path).read_bytes()


def _read_manifest(path: Path) -> dict:
    """manifest.json, checked for the shape every reader relies on: an object whose ``stages``
    maps names to objects, each with a ``status`` and its ``files`` as path -> sha256."""
    try:
        manifest = json.loads(read_regular(path))
    except (ValueError, RecursionError):
        raise ArtifactError(f"{path}: manifest is unreadable (corrupted)") from None
    except OSError as exc:
        raise ArtifactError(f"{path}: cannot read the manifest ({exc.strerror or exc})") from None
    problem = None
    if json_depth(manifest) > MAX_DEPTH:
        problem = f"JSON nested deeper than {MAX_DEPTH} levels"
    elif not isinstance(manifest, dict):
        problem = f"a JSON {type(manifest).__name__}, not an object"
    elif not isinstance(manifest.get("stages"), dict):
        problem = "no 'stages' object"
    else:
        for name, entry in manifest["stages"].items():
            if not isinstance(entry, dict) or not isinstance(entry.get("status"), str):
                problem = f"stage {name!r} is not an object with a status"
            elif not isinstance(entry.get("files", {}), dict) or not all(
                isinstance(v, str) for v in entry.get("files", {}).values()
            ):
                problem = f"stage {name!r} has no valid file list"
            elif stage_kind(name) is not None and not name.split("/")[1].isdigit():
                problem = f"stage {name!r} names no step"
            elif not isinstance(entry.get("dirs", []), list):
                problem = f"stage {name!r} has no valid folder list"
            elif any(relative_problem(rel) for rel in [*entry.get("files", {}), *entry.get("dirs", [])]):
                bad = next(rel for rel in [*entry.get("files", {}), *entry.get("dirs", [])] if relative_problem(rel))
                problem = f"stage {name!r} lists the path {bad!r}, which leaves the run folder"
            if problem:
                break
    if problem:
        raise ArtifactError(f"{path}: not a masktrl manifest ({problem})")
    if manifest.get("version") != MANIFEST_VERSION:
        raise ArtifactError(
            f"{path}: manifest version {manifest.get('version')!r}; this masktrl reads version {MANIFEST_VERSION}"
        )
    return manifest
