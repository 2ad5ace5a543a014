"""Fault injection for crash-safety tests: ``MASKTRL_CRASH_AT=point:N`` makes the process
SIGKILL itself when it reaches ``point`` for the N-th time (``maybe_crash_nth``) or, for the
points of a training step, at step N (``maybe_crash``). Unset in normal use; costs one
dictionary lookup per call.

Points at a step: ``rollout-write``, ``update``, ``checkpoint-write``. Points inside the run
store's writes (counted per process, from 1): ``manifest-write`` (before a manifest
replacement), ``config-write`` (run.yaml written, not yet recorded), ``config-rename`` (the
manifest records a new run.yaml still held as ``run.yaml.new``), ``restart-delete`` (a restart's
manifest reset written, its stale files not yet deleted), ``summary-write`` (summary.json written, not yet
recorded), ``rewind-metrics`` (resume's update records dropped, metrics.jsonl not yet cut back).
"""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("MASKTRL_CRASH_AT", "")
STORE_POINTS = ("manifest-write", "config-write", "config-rename", "restart-delete", "summary-write", "rewind-metrics")
_counts: dict[str, int] = {}


def maybe_crash(point: str, step: int) -> None:
    if _SPEC and _SPEC == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_crash_nth(point: str) -> None:
    """Count this visit of ``point`` and crash if it is the one ``MASKTRL_CRASH_AT`` names."""
    if _SPEC and _SPEC.startswith(point + ":"):
        _counts[point] = _counts.get(point, 0) + 1
        maybe_crash(point, _counts[point])
