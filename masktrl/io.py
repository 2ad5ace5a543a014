"""Atomic file writes and content hashes: the low-level I/O every package may use.

A write goes to a temporary file in the same folder, is fsynced, renamed over the target and
the folder is fsynced: readers see the old or the new file, never a torn one, whatever kills
the process or the machine. ``atomic_dir`` does the same for a whole folder. Files get the
mode an ordinary ``open`` gives under the user's umask (``tempfile`` and safetensors create
them 0600).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from masktrl.errors import shown


def file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0o666 less the process's umask."""
    return 0o666 & ~_umask()


@functools.lru_cache(maxsize=1)
def _umask() -> int:
    """The process's umask, read once (it is set at start-up by the shell or the scheduler)."""
    try:  # Linux: read it without changing it (os.umask can only be read by setting it)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a temporary file, fsync, rename, fsync the folder."""
    path = Path(path)
    with naming(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            os.fchmod(fd, file_mode())
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)


@contextlib.contextmanager
def naming(path: Path):
    """An OSError raised in the block without a file name (a failed ``write`` or ``fsync``:
    ENOSPC, EIO) is raised again naming ``path``."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path)) from exc


@contextlib.contextmanager
def importing_user_file():
    """Import a user's file (a rule, an environment) without writing ``__pycache__`` beside it
    (nothing is written outside ``--out``), what it prints going to stderr: a command's stdout is
    its output (``masktrl config show``'s YAML began with the file's print)."""
    import sys

    before, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.dont_write_bytecode = before


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=json_default) + "\n")


@contextlib.contextmanager
def atomic_dir(dest: Path):
    """Fill a folder atomically: yields ``<dest>.tmp`` to write into, then replaces ``dest``
    with it, so a folder that exists under its final name is complete."""
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with disk_errors(tmp):
            yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk gets its space back
        raise
    mode = file_mode()
    for p in tmp.rglob("*"):
        if p.is_file() and not p.is_symlink():
            os.chmod(p, mode)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    fsync_dir(dest.parent)


@contextlib.contextmanager
def disk_errors(dest: Path):
    """Writers outside masktrl report a full or read-only disk in their own words: raised as
    the ``OSError`` they are, naming ``dest``, whatever the size of the file.

    * safetensors: ``SafetensorError('Error while serializing: I/O error: No space left on
      device (os error 28)')``: the OS error's number is in the message (and the partial file
      is already gone, so the disk no longer looks full);
    * ``torch.save``: ``RuntimeError('[enforce fail at inline_container.cc:…] . unexpected pos
      576 vs 534')`` or ``file write failed``: no number; ENOSPC or EROFS when the file system
      under ``dest`` is full (under 1 MiB free) or read-only, else EIO quoting the writer;
    * any other exception, when the file system under ``dest`` is read-only or full."""
    try:
        yield
    except OSError:
        raise
    except Exception as exc:
        problem = writer_os_error(exc, dest)
        if problem is None:
            raise
        raise problem  # noqa: B904  (the writer's own exception stays attached as the context)


_OS_ERROR_NUMBER = re.compile(r"\(os error (\d+)\)")
_TORCH_WRITE_FAILED = ("unexpected pos", "file write failed", "PytorchStreamWriter failed")


def writer_os_error(exc: BaseException, dest: Path) -> OSError | None:
    """The ``OSError`` behind a writer's own exception (see ``disk_errors``), or None."""
    text = str(exc)
    found = _OS_ERROR_NUMBER.search(text)
    if found and "safetensor" in type(exc).__name__.lower():
        number = int(found.group(1))
        return OSError(number, os.strerror(number), str(dest))
    problem = disk_problem(dest)
    if problem is None and isinstance(exc, RuntimeError) and any(s in text for s in _TORCH_WRITE_FAILED):
        first = (text.strip().splitlines() or [type(exc).__name__])[0][:200]
        return OSError(errno.EIO, f"the write failed ({first})", str(dest))
    return problem


PSEUDO_FILE_SYSTEMS = frozenset(
    {
        "proc",
        "sysfs",
        "cgroup",
        "cgroup2",
        "devpts",
        "debugfs",
        "tracefs",
        "securityfs",
        "pstore",
        "bpf",
        "configfs",
        "fusectl",
        "mqueue",
        "binfmt_misc",
        "autofs",
        "efivarfs",
        "rpc_pipefs",
        "nsfs",
    }
)
"""File systems of the kernel's own (no storage): ``statvfs`` reports 0 bytes free on them."""


def disk_problem(path: Path, min_free: int = 1 << 20) -> OSError | None:
    """An OSError describing why nothing can be written under ``path`` (a virtual file system
    such as ``/proc``, a read-only file system, or one with less than ``min_free`` bytes free),
    or None."""
    for folder in [Path(path), *Path(path).parents]:
        if folder.exists():
            break
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    if st.f_blocks == 0:  # no storage at all: the kernel's own file systems report 0 free
        kind = file_system_type(folder)
        if kind in PSEUDO_FILE_SYSTEMS:
            return OSError(errno.EPERM, f"not a writable folder (a {kind} file system, the kernel's own)", str(path))
        return None  # a file system that reports no sizes (some FUSE mounts) is not "full"
    if st.f_flag & os.ST_RDONLY:
        return OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
    if st.f_bavail * st.f_frsize < min_free:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return None


def file_system_type(path: Path) -> str | None:
    """The type of the file system holding ``path`` (from ``/proc/self/mountinfo``), or None."""
    try:
        where = os.path.realpath(path)
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    best, kind = "", None
    for fields in mounts:
        if "-" not in fields or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[fields.index("-") + 1]
    return kind


def memory_error_line(exc: BaseException, options: str | None = None) -> str | None:
    """One line for running out of memory (a ``MemoryError``, torch's ``OutOfMemoryError``, the
    CPU allocator's ``can't allocate memory``), or None for any other exception. ``options``:
    what to lower, in the command's own terms (default: the training keys)."""
    text = (shown(exc).strip().splitlines() or [""])[0]
    hint = (
        "the model or a batch does not fit: use a smaller model, or "
        f"{options or 'lower rollout.batch_size or raise train.grad_accum'}"
    )
    if isinstance(exc, MemoryError):
        return f"out of memory ({type(exc).__name__}{': ' + text[:200] if text else ''}): {hint}"
    if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in text.lower() or "can't allocate memory" in text:
        detail = re.sub(r"^\[enforce fail at [^\]]*\]\W*(err == 0\.\s*)?", "", text)
        detail = detail.split(" Including non-PyTorch memory")[0].split(" Of the allocated memory")[0]
        return f"out of memory ({detail[:240].rstrip('. ')}): {hint}"
    return None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def json_default(obj: Any) -> Any:
    """``json.dumps(default=...)`` for numpy/torch scalars, sets, tuples and paths."""
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
