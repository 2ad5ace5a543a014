"""Ctrl-C and SIGTERM (what a cluster scheduler sends before it preempts a job) during training.

Inside the step loop the first signal lets the current step finish, checkpoints it and stops
the run (status ``interrupted``; ``--resume``, or the same command again, continues it); a second
signal stops at once. Elsewhere (loading, the warm start, the final evaluation) the first
signal stops at once: there is no step to finish, and the last checkpoint is already written.
Either way the run's status is recorded as ``interrupted`` on the way out.
"""

from __future__ import annotations

import contextlib
import signal

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Raised to stop a run on a signal; ``signum`` gives the exit status 128 + signum."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class GracefulStop:
    """``requested`` turns True at the first signal while ``graceful``; any other signal raises
    ``Interrupted``."""

    def __init__(self, graceful: bool = True):
        self.requested = False
        self.signum = signal.SIGINT
        self.graceful = graceful
        self._previous = {}
        try:
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread (e.g. a notebook worker): keep default behaviour
            self.restore()
            self._previous = {}

    def _handle(self, signum, frame):
        if self.requested or not self.graceful:
            raise Interrupted(signum)
        self.requested = True
        self.signum = signum
        how = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"\n{how}: finishing this step and saving a checkpoint (send it again to stop now)", flush=True)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            if previous is not None:
                signal.signal(sig, previous)


@contextlib.contextmanager
def graceful_stop(graceful: bool = True):
    """A ``GracefulStop`` for the duration of the block; the previous handlers are restored after."""
    stop = GracefulStop(graceful)
    try:
        yield stop
    finally:
        stop.restore()
