"""Math answer grading with math-verify, in a small pool of killable worker processes.

math-verify (``math_verify.parse`` + ``verify``) times itself out with ``signal.alarm``,
which only works on a process's main thread, and some inputs spend minutes inside one
C-level big-integer operation that no signal interrupts. So grading runs in worker
*processes* (plain ``python _grade_worker.py`` subprocesses talking JSON lines over pipes,
which import math_verify once), and the parent enforces a hard wall-clock timeout per
answer: a worker that overruns is killed, the answer is graded incorrect, and a fresh
worker replaces it. A worker that crashes is treated the same way.

Before anything reaches a worker the parent
  * looks only at the last ``max_chars`` characters of a completion,
  * extracts the content of the last ``\\boxed{...}`` (nested braces handled iteratively),
  * answers cheap cases itself: identical normalised strings, and integer against integer
    ("042" equals "42"; two different integer literals are never equal).
Model output is never passed to eval/exec; only math_verify's parser sees it.
POSIX only (pipes polled without blocking; math-verify's alarms need SIGALRM anyway).
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

from masktrl.errors import MasktrlError

_WORKER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_grade_worker.py")
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_CACHE_LIMIT = 65536  # verdicts remembered across calls (RL repeats answers a lot)
_MAX_START_FAILURES = 3


# --------------------------------------------------------------------------- extraction
def last_boxed(text: str, max_chars: int = 4096) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in the last ``max_chars`` chars.

    Handles nested braces and escaped ``\\{ \\}``; also accepts ``\\boxed 42``. Returns None
    when there is no box or the last box is unbalanced (e.g. a truncated completion).
    Never raises and runs in time linear in ``max_chars``.
    """
    if not isinstance(text, str) or not text:
        return None
    tail = text[-max_chars:] if max_chars > 0 else text
    start = max(tail.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    i = start + len("\\boxed") if tail.startswith("\\boxed", start) else start + len("\\fbox")
    n = len(tail)
    if i < n and tail[i] == " ":  # "\boxed 42" form
        j = i
        while j < n and tail[j] == " ":
            j += 1
        k = j
        while k < n and not tail[k].isspace() and tail[k] not in "$":
            k += 1
        return tail[j:k] if k > j else None
    while i < n and tail[i] in " \t":
        i += 1
    if i >= n or tail[i] != "{":
        return None
    depth, j = 0, i
    while j < n:
        ch = tail[j]
        if ch == "\\":
            j += 2  # skip escaped char, e.g. \{ or \}
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return tail[i + 1 : j]
        j += 1
    return None


def extract_answer(completion: str, max_chars: int = 4096) -> str | None:
    """The answer a completion commits to: its last ``\\boxed{}`` content, stripped (or None)."""
    boxed = last_boxed(completion, max_chars)
    return None if boxed is None else boxed.strip()


def gold_answer(gold: str) -> str:
    """A reference answer as graded: the content of its last box if it has one, else itself."""
    gold = str(gold)
    if "\\boxed" in gold or "\\fbox" in gold:
        boxed = last_boxed(gold, max_chars=len(gold))
        if boxed is not None:
            return boxed.strip()
    return gold.strip()


# --------------------------------------------------------------------------- fast path
_INT_RE = re.compile(r"[+-]?\d+")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(,\d{3})+")
_NOISE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", " ", "\t", "\n")


def normalize(ans: str) -> str:
    """Light, semantics-preserving normalisation used for exact-match shortcuts and votes."""
    s = ans.strip().strip("$").strip()
    for noise in _NOISE:
        s = s.replace(noise, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = s.rstrip(".")
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    if _INT_RE.fullmatch(s):
        sign = "-" if s[0] == "-" else ""
        digits = s.lstrip("+-").lstrip("0") or "0"
        s = ("" if digits == "0" else sign) + digits
    return s


def quick_verdict(pred: str, gold: str) -> bool | None:
    """True/False when decidable without math-verify, else None.

    Identical normalised strings are equal; two integer literals are equal iff their
    values are (compared as digit strings, so 10,000-digit numbers cost nothing).
    """
    p, g = normalize(pred), normalize(gold)
    if not p or not g:
        return False
    if p == g:
        return True
    if _INT_RE.fullmatch(p) and _INT_RE.fullmatch(g):
        return False
    return None


# --------------------------------------------------------------------------- worker pool
class _Worker:
    """One worker subprocess, its pipes and the request it is working on."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buf = b""
        self.ready = False
        self.started = time.monotonic()
        self.key: object = None  # request in progress
        self.deadline = 0.0

    def send(self, key: object, msg: dict, timeout_s: float) -> bool:
        line = json.dumps(msg, default=str) + "\n"
        try:
            self.proc.stdin.write(line.encode("utf-8"))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return False
        self.key, self.deadline = key, time.monotonic() + timeout_s
        return True

    def read_messages(self) -> list[dict] | None:
        """Complete messages now available; None once the worker has exited (EOF)."""
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return []
        except OSError:
            return None
        if not chunk:
            return None
        self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def kill(self) -> None:
        _stop(self.proc, graceful=False)


def _stop(proc: subprocess.Popen, graceful: bool) -> None:
    try:
        if graceful and proc.poll() is None:
            proc.stdin.close()  # worker exits at EOF
            try:
                proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    except Exception:
        pass
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except Exception:
            pass


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        _stop(w.proc, graceful=True)
    workers.clear()


class WorkerPool:
    """Worker subprocesses that answer JSON-line requests, one at a time each, under a hard
    wall-clock timeout per request (the grader's pool; custom rewards run in one too).

    Protocol, one JSON object per line: the worker says ``{"ready": true}`` once started (or
    ``{"error": "..."}`` if it cannot start, then exits); the parent sends one request object,
    the worker answers with one object; the worker exits when stdin closes. A worker that
    overruns its request's deadline is killed and replaced; so is one that crashes. Workers start
    lazily, on the first request.

    Args:
        argv: the command that starts a worker (called at each start, so it may change).
        workers: number of processes.
        name: prefixes errors (``"grader"``).
        kind: names one worker in errors (``"math-verify worker"``).
        start_error: the exception class raised when workers cannot start.
        start_hint: appended to the error when workers keep failing to start.
        startup_timeout_s: how long a worker may take to say it is ready.
    """

    def __init__(
        self,
        argv: Callable[[], list[str]],
        workers: int = 2,
        name: str = "pool",
        kind: str = "worker",
        start_error: type[Exception] = MasktrlError,
        start_hint: str = "",
        startup_timeout_s: float = 60.0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.argv, self.n_workers, self.name, self.kind = argv, workers, name, kind
        self.start_error, self.start_hint, self.startup_timeout_s = start_error, start_hint, startup_timeout_s
        self.workers: list[_Worker] = []
        self.stats = {"timeouts": 0, "crashes": 0}
        self._finalizer = weakref.finalize(self, _shutdown, self.workers)

    def close(self) -> None:
        """Stop all workers. Further requests start new ones."""
        self._finalizer()
        self._finalizer = weakref.finalize(self, _shutdown, self.workers)

    def run(self, requests: dict, timeout_s: float) -> tuple[dict, set]:
        """Answers to ``requests`` (key -> request object), and the keys whose worker timed out
        or crashed (no answer). Raises ``start_error`` when workers cannot start."""
        pending = deque(requests)
        answers: dict = {}
        failed: set = set()
        start_failures = 0
        while pending or any(w.key is not None for w in self.workers):
            while len(self.workers) < self.n_workers:
                self.workers.append(_Worker(self.argv()))
            for w in self.workers:
                if w.ready and w.key is None and pending:
                    key = pending.popleft()
                    if not w.send(key, requests[key], timeout_s):
                        pending.appendleft(key)  # died while idle: replaced below
            now = time.monotonic()
            waits = [w.deadline - now for w in self.workers if w.key is not None]
            waits += [w.started + self.startup_timeout_s - now for w in self.workers if not w.ready]
            timeout = max(0.0, min(waits)) if waits else 0.05
            poller = select.poll()  # not select.select: training processes may hold fds >= 1024
            for w in self.workers:
                poller.register(w.fd, select.POLLIN)
            readable = {fd for fd, _ in poller.poll(timeout * 1000)}
            for w in [w for w in self.workers if w.fd in readable]:
                msgs = w.read_messages()
                if msgs is None:  # exited
                    if w.key is not None:
                        failed.add(w.key)
                        self.stats["crashes"] += 1
                    elif not w.ready:
                        start_failures += 1
                    self._retire(w)
                    continue
                for msg in msgs:
                    if "error" in msg and not w.ready:
                        self._retire(w)
                        raise self.start_error(f"{self.name}: {self.kind} cannot start: {msg['error']}")
                    if msg.get("ready"):
                        w.ready = True
                    elif w.key is not None:
                        answers[w.key] = msg
                        w.key = None
            now = time.monotonic()
            for w in list(self.workers):
                if w.key is not None and now >= w.deadline:
                    failed.add(w.key)
                    self.stats["timeouts"] += 1
                    self._retire(w)
                elif not w.ready and now >= w.started + self.startup_timeout_s:
                    start_failures += 1
                    self._retire(w)
            if start_failures >= _MAX_START_FAILURES:
                raise self.start_error(
                    f"{self.name}: {start_failures} {self.kind}s failed to start "
                    f"within {self.startup_timeout_s:g}s{self.start_hint}"
                )
        return answers, failed

    def _retire(self, w: _Worker) -> None:
        w.kill()
        self.workers.remove(w)


class Grader:
    """Grades (completion, gold) pairs with math-verify under a hard per-answer timeout.

    Use as a context manager (or call :meth:`close`); workers start lazily on the first
    answer the fast path cannot decide, so a Grader that only sees integers never spawns.
    Safe to share between threads: use of the worker pool is serialised by a lock.

    Args:
        workers: number of grading processes (small; each holds sympy in memory).
        require_boxed: if True (default) a completion without a ``\\boxed{}`` answer is
            incorrect; if False its last ``max_chars`` characters go to math-verify's own
            extraction ("the answer is 42", last LaTeX expression, last number).
        max_chars: only the last ``max_chars`` characters of a completion are looked at.
        startup_timeout_s: how long a worker may take to import math_verify.
        extract: ``extract(completion, max_chars)`` -> the answer a completion commits to, or
            None (default: :func:`extract_answer`, the last ``\\boxed{}``).
    """

    def __init__(
        self,
        workers: int = 2,
        require_boxed: bool = True,
        max_chars: int = 4096,
        startup_timeout_s: float = 60.0,
        extract: Callable[[str, int], str | None] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.n_workers = workers
        self.require_boxed = require_boxed
        self.max_chars = max_chars
        self.startup_timeout_s = startup_timeout_s
        self.extract = extract or extract_answer
        self._pool = WorkerPool(
            lambda: [sys.executable, "-u", _WORKER_PATH],  # read at each start: tests swap the worker
            workers,
            name="grader",
            kind="math-verify worker",
            start_hint="; check `python -c 'import math_verify'`",
            startup_timeout_s=startup_timeout_s,
        )
        self._cache: dict[tuple, bool] = {}
        self._lock = threading.Lock()
        self.stats = {"fast": 0, "cached": 0, "pool": 0, "timeouts": 0, "crashes": 0}

    @property
    def _workers(self) -> list[_Worker]:
        return self._pool.workers

    def __enter__(self) -> Grader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop all workers. Further grading starts new ones."""
        self._pool.close()

    # ----------------------------------------------------------------- public API
    def grade(self, completion: str, gold: str, timeout_s: float = 5.0) -> bool:
        """Whether ``completion`` answers ``gold``; see :meth:`grade_many`."""
        return self.grade_many([(completion, gold)], timeout_s=timeout_s)[0]

    def grade_many(self, pairs: list[tuple[str, str]], timeout_s: float = 5.0) -> list[bool]:
        """Grade (model completion, gold answer) pairs; never raises on malformed output.

        An answer that exceeds ``timeout_s`` seconds (wall clock, per answer) or crashes
        its worker is graded False and grading continues with a fresh worker.
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        results: list[bool | None] = [None] * len(pairs)
        todo: dict[tuple, list[int]] = {}
        for i, (completion, gold) in enumerate(pairs):
            key = self._prepare(completion, gold)
            if isinstance(key, bool):
                results[i] = key
                self.stats["fast"] += 1
            elif key in self._cache:
                results[i] = self._cache[key]
                self.stats["cached"] += 1
            else:
                todo.setdefault(key, []).append(i)
        if todo:
            with self._lock:
                verdicts, failed = self._run_pool(list(todo), timeout_s)
            if len(self._cache) + len(verdicts) > _CACHE_LIMIT:
                self._cache.clear()
            self._cache.update((k, v) for k, v in verdicts.items() if k not in failed)  # retry timeouts later
            for key, idxs in todo.items():
                for i in idxs:
                    results[i] = verdicts[key]
        return [bool(r) for r in results]

    # ----------------------------------------------------------------- internals
    def _prepare(self, completion, gold) -> bool | tuple:
        """A verdict, or the (pred, gold, raw) request a worker must decide."""
        if not isinstance(completion, str) or not isinstance(gold, (str, int)):
            return False
        gold = gold_answer(str(gold))
        if not gold:
            return False
        pred = self.extract(completion, self.max_chars)
        if pred is None:
            if self.require_boxed:
                return False
            tail = completion[-self.max_chars :].strip()
            return (tail, gold, True) if tail else False
        verdict = quick_verdict(pred, gold)
        return verdict if verdict is not None else (pred, gold, False)

    def _run_pool(self, keys: list[tuple], timeout_s: float) -> tuple[dict[tuple, bool], set[tuple]]:
        """Verdicts for ``keys``, and the keys whose worker timed out or crashed (graded False)."""
        t = max(1, int(timeout_s / 2))  # math_verify's own alarms: finish before we kill
        requests = {key: {"id": 0, "pred": key[0], "gold": key[1], "raw": key[2], "t": t} for key in keys}
        before = dict(self._pool.stats)
        answers, failed = self._pool.run(requests, timeout_s)
        for name in ("timeouts", "crashes"):
            self.stats[name] += self._pool.stats[name] - before[name]
        self.stats["pool"] += len(answers)
        verdicts = {key: bool(answers[key].get("ok")) if key in answers else False for key in keys}
        return verdicts, failed


def grade_many(pairs: list[tuple[str, str]], timeout_s: float = 5.0, **grader_kwargs) -> list[bool]:
    """One-shot convenience: grade with a temporary :class:`Grader` and stop its workers."""
    with Grader(**grader_kwargs) as grader:
        return grader.grade_many(pairs, timeout_s=timeout_s)
