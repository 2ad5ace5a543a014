"""Ctrl-C during training: the first one finishes the current step, checkpoints it and stops;
a second one stops at once."""

from __future__ import annotations

import contextlib
import signal


class GracefulStop:
    """``requested`` turns True at the first SIGINT; the second raises KeyboardInterrupt."""

    def __init__(self):
        self.requested = False
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread (e.g. a notebook worker): keep default behaviour
            self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\ninterrupt: finishing this step and saving a checkpoint (Ctrl-C again to stop now)", flush=True)

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


@contextlib.contextmanager
def graceful_stop():
    """A ``GracefulStop`` for the duration of the block; the previous handler is restored after."""
    stop = GracefulStop()
    try:
        yield stop
    finally:
        stop.restore()
