"""Stopping a run cleanly: SIGTERM (SLURM preemption, `kill`) and Ctrl-C (the exit status of a run
that checkpointed without finishing is `jaxspec.exits.EXIT_CHECKPOINTED`)."""

from __future__ import annotations

import signal
import sys
import threading


class StopSignals:
    """While installed, SIGTERM and a first SIGINT (Ctrl-C) ask the loop to stop: `requested` turns
    True and `name` says which signal came; the loop checkpoints at the next step boundary. After
    the first Ctrl-C, SIGINT is back to the system's default, so a second one ends the process at
    once (checkpoints are atomic: that loses the step in progress, never a checkpoint).

    Only the main thread can install signal handlers; elsewhere this does nothing.
    """

    def __init__(self, announce: bool = True):
        self.requested = False
        self.name: str | None = None
        self._announce = announce
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.name = self.name or signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if self._announce:
                print(
                    "Ctrl-C: checkpointing at the end of this step and stopping (Ctrl-C again aborts at once)",
                    file=sys.stderr,
                    flush=True,
                )

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
