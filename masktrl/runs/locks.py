"""One writer per run: an exclusive OS lock on the run folder itself (``fcntl.flock`` on the
directory, opened read-only), held by the process that trains the run (``masktrl train``,
``--resume``, each run of ``masktrl sweep``) for as long as it works on it.

The lock lives on the folder, not on a file inside it, so deleting any file of the run while it
trains does not release it: a second writer is still refused. The kernel drops it when the
process ends, however it ends (SIGKILL and a machine reboot included), so a dead process leaves
nothing to clean up. Nothing is written for it: the holder's pid, which the message a second
writer gets names, is read from the kernel's lock table (``/proc/locks``), so a refused command
changes no byte of the run. A process takes a run's lock once (``train`` does,
for the whole run); taking it again while holding it is a bug, refused.

``holder`` asks, without waiting, whether some process holds a run's lock: ``masktrl runs`` and
``RunStore.status`` tell a live run from a dead one by it (a pid can be reused; a lock cannot
outlive its process). Its probe takes a shared lock for an instant, so ``acquire`` retries for
a second before it reports a run busy.

Commands that write *into* a run without training it do not take this lock: ``masktrl eval``
writes ``eval/<bench>-step<S>.json`` atomically and records it in the manifest, whose
read-modify-write is serialised by a second, short lock on ``<run>/.manifest.lock``
(``manifest_lock``), so evaluating a running run is safe; the analyses write only their own files under ``analysis/``,
atomically.

``exclusive`` is the one wait-for-it flock of masktrl: the manifest lock and the warm-start
cache's entry locks (``<out>/.cache/locks/``) are both made of it.

On NFS, Linux implements flock with the server's byte-range locks (NFSv4), which also work
across nodes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from pathlib import Path

from masktrl.errors import MasktrlError
from masktrl.io import file_mode

LOCK_NAME = ".lock"  # the writer lock's file of older versions (a fresh folder may still hold one)
MANIFEST_LOCK_NAME = ".manifest.lock"
WAIT_S = 1.0  # how long ``acquire`` retries: longer than any ``holder`` probe holds its shared lock

_held: dict[Path, int] = {}  # resolved run folder -> the open lock file's descriptor


class RunBusyError(MasktrlError):
    """Another process holds the run's lock."""


def acquire(root: Path, *, wait_s: float = WAIT_S) -> None:
    """Take the run's writer lock (creating the folder if needed) or raise ``RunBusyError``."""
    root = Path(root)
    key = _key(root)
    if key in _held:
        raise MasktrlError(f"{root}: this process holds the run's lock already")
    path = root
    try:
        root.mkdir(parents=True, exist_ok=True)
        refuse_symlink(root)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise MasktrlError(f"{path}: cannot open the run folder to lock it ({exc.strerror or exc})") from None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() >= deadline:
                pid = _holder_pid(fd)
                os.close(fd)
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise MasktrlError(f"{path}: cannot lock the run ({exc.strerror or exc})") from None
                who = f"pid {pid}" if pid else "another process"
                raise RunBusyError(
                    f"{root}: this run is being written by {who} (it holds the run folder's "
                    "lock); wait for it to finish "
                    "or stop it (nothing was changed)"
                ) from None
            time.sleep(0.05)
    _held[key] = fd


def refuse_symlink(root: Path) -> None:
    """MasktrlError when the run folder ``root`` is a symbolic link: no command writes through one
    (its files would land outside ``--out``); ``acquire`` and every other writer of a run call this."""
    if Path(root).is_symlink():
        raise MasktrlError(f"{root}: the run folder is a symbolic link; refused (not followed)")


def release(root: Path) -> None:
    """Drop the run's lock (closing the file releases the flock)."""
    fd = _held.pop(_key(Path(root)), None)
    if fd is not None:
        os.close(fd)


@contextlib.contextmanager
def holding(root: Path):
    """The run's writer lock for the duration of the block."""
    acquire(root)
    try:
        yield
    finally:
        release(root)


def holds(root: Path) -> bool:
    """Whether this process holds the run's lock."""
    return _key(Path(root)) in _held


def holder(root: Path) -> int | None:
    """The pid holding the run's lock (-1 if the kernel does not say), or None if nobody holds it."""
    root = Path(root)
    if holds(root):
        return os.getpid()
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _holder_pid(fd) or -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


@contextlib.contextmanager
def manifest_lock(root: Path):
    """A short exclusive lock (flock on ``<run>/.manifest.lock``) around one read-modify-write of
    the manifest, taken by the trainer and by any other process recording a stage in the same run
    (``masktrl eval``). Not the writer lock: that one is held for the whole run on the folder."""
    path = Path(root) / MANIFEST_LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, file_mode())
    except OSError:  # no folder yet (the write creates it) or no access (the write will say so)
        yield
        return
    with exclusive(fd):
        yield


def cache_lock(path: Path):
    """An exclusive lock on the lock file ``path`` (created, with its folder), waited for."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return exclusive(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, file_mode()))


@contextlib.contextmanager
def exclusive(fd: int):
    """Hold an exclusive flock on the open file ``fd`` for the block, waiting for it; the file is
    closed after (which releases the lock)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _holder_pid(fd: int) -> int | None:
    """The pid holding an exclusive flock on the file open as ``fd``, from /proc/locks (Linux;
    None elsewhere or if it is not listed)."""
    st = os.fstat(fd)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()  # 1: FLOCK  ADVISORY  WRITE 12345 fe:00:2146490 0 EOF  (waiters carry "->")
        if len(parts) >= 6 and "->" not in parts and parts[1] == "FLOCK" and parts[3] == "WRITE" and parts[5] == device:
            return int(parts[4]) if parts[4].isdigit() else None
    return None


def _key(root: Path) -> Path:
    return Path(root).resolve()
