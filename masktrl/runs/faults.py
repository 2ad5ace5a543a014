"""Fault injection for crash-safety tests: ``MASKTRL_CRASH_AT=point:step`` makes the process
SIGKILL itself when it reaches ``point`` (rollout-write, update, checkpoint-write) at ``step``.
Unset in normal use; costs one dictionary lookup per call."""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("MASKTRL_CRASH_AT", "")


def maybe_crash(point: str, step: int) -> None:
    if _SPEC and _SPEC == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
