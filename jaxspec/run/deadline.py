"""Stopping before a job's time limit: a run told when it must be done (JAXSPEC_STOP_BY, Unix
seconds; configs/slurm/grpo.sbatch sets it from the job's end time) checkpoints and stops at the
last step boundary from which one more step and a checkpoint would still finish in time.

The estimates are measured, never configured: a step takes as long as the longest of the last
three (this process's, or the time_step_s of the run's metrics.jsonl from earlier starts), a checkpoint as
long as the longest one measured from its start until it was complete on disk (orbax writes in the
background), or as a step when none was measured yet. Before any step is known the run only stops
when the time is already up.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Iterable

STOP_BY_ENV = "JAXSPEC_STOP_BY"
_RECENT_STEPS = 3


class Deadline:
    """When to stop for a time limit `stop_by` (Unix seconds; None: never). `clock` returns Unix
    seconds."""

    def __init__(self, stop_by: float | None, clock: Callable[[], float] = time.time):
        self.stop_by, self.clock = stop_by, clock
        self.step_seconds: collections.deque[float] = collections.deque(maxlen=_RECENT_STEPS)
        self.checkpoint_s: float | None = None

    @classmethod
    def from_env(cls) -> Deadline:
        """From JAXSPEC_STOP_BY; ValueError naming it when it is not a number."""
        raw = os.environ.get(STOP_BY_ENV, "").strip()
        if not raw:
            return cls(None)
        try:
            return cls(float(raw))
        except ValueError:
            raise ValueError(
                f"{STOP_BY_ENV}={raw!r}: expected the time to stop by, in seconds since the epoch "
                f"(e.g. $(date -d '2 hours' +%s))"
            ) from None

    def record(self, records: Iterable[dict]) -> None:
        """Takes the step times of metrics records (time_step_s: an earlier start's)."""
        self.step_seconds.extend(float(r["time_step_s"]) for r in records if "time_step_s" in r)

    def step_took(self, seconds: float) -> None:
        """Takes the time of a step measured in this process."""
        self.step_seconds.append(seconds)

    def checkpoint_written(self, seconds: float | None) -> None:
        """Takes the longest complete checkpoint write measured so far (None: none yet)."""
        if seconds is not None:
            self.checkpoint_s = max(self.checkpoint_s or 0.0, seconds)

    def needed_s(self) -> tuple[float, float]:
        """(seconds of one more step, seconds of a checkpoint), as estimated (see the module doc)."""
        step = max(self.step_seconds, default=0.0)
        return step, self.checkpoint_s if self.checkpoint_s is not None else step

    def too_late(self) -> bool:
        """Whether one more step and a checkpoint would end after stop_by."""
        return self.stop_by is not None and self.clock() + sum(self.needed_s()) > self.stop_by

    def reason(self) -> str:
        step, checkpoint = self.needed_s()
        at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.stop_by))
        if not self.step_seconds:
            return f"the job must stop by {at} ({STOP_BY_ENV}), which has passed"
        return (
            f"the job must stop by {at} ({STOP_BY_ENV}): one more step (~{step:.0f} s) and a checkpoint "
            f"(~{checkpoint:.0f} s) would end after it"
        )
