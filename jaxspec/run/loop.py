"""The loop every training command runs (`jaxspec train`, `jaxspec pretrain`, `jaxspec draft
train`): steps until the run's last, metrics, progress, a clean stop, the end of the run.

Each command supplies its part as a `Program`: one step (which evaluates and checkpoints when its
schedule says so), a checkpoint now, the evaluations before the first step and after the last,
and the export of a finished run. `RunLoop` does the rest, the same way for every command:

- metrics.jsonl: one writer (`MetricsLog`, process 0 alone) for every record the program returns;
  a resumed run first drops the records after its checkpoint (`truncate_metrics`), a new run all;
- progress (`Progress`) and messages (`jaxspec.distributed.say`: process 0 alone);
- stopping: SIGTERM or Ctrl-C (`StopSignals`) on any process, or the job's time limit
  (JAXSPEC_STOP_BY, `Deadline`: one more step and a checkpoint would end after it), makes every
  process checkpoint at the same step boundary and return without exporting; the command exits
  EXIT_CHECKPOINTED (`jaxspec.exits`) and continues with --resume;
- the end: the program's resources, the metrics file and the checkpointer are closed (waiting for
  the checkpoint in flight); when the run fails, the first error is the one raised and closing
  stays silent.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from jaxspec.distributed import any_process, is_main, say
from jaxspec.run.checkpoints import Checkpointer
from jaxspec.run.deadline import Deadline
from jaxspec.run.metrics_log import MetricsLog, truncate_metrics
from jaxspec.run.progress import Progress
from jaxspec.run.signals import StopSignals


class Program(Protocol):
    """A training command's part of the loop.

    name: the progress label ("grpo", "pretrain", "draft"); steps: the run's last step
    (train.steps); step: the steps done; resumed: whether the run restored a checkpoint;
    checkpointer: where its checkpoints go.
    """

    name: str
    steps: int
    step: int
    resumed: bool
    checkpointer: Checkpointer

    def run_step(self) -> tuple[list[dict], dict[str, str]]:
        """One step, with the evaluation and checkpoint it has due: (the metrics records to log,
        the progress fields, formatted)."""
        ...

    def save(self) -> None:
        """Checkpoints the run at its current step (a stop before the end)."""
        ...

    def evaluate(self, final: bool) -> dict | None:
        """The evaluation record to log before the first step of a new run (final False) or after
        the last step (final True); None when the program evaluates nothing then."""
        ...

    def export(self, seconds: float) -> None:
        """Writes the finished run's outputs and says the end-of-run line (seconds: the loop's
        wall time in this process)."""
        ...

    def close(self) -> None:
        """Releases what the program holds besides its checkpointer (e.g. a rollout worker)."""
        ...


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """finished: the run reached its last step and exported (False: it checkpointed and stopped
    early); last: the last record logged ({} if none); seconds: the loop's wall time."""

    finished: bool
    last: dict
    seconds: float


class RunLoop:
    """Runs a `Program` to its last step (see the module doc).

    Made before the program loads anything, so that a malformed JAXSPEC_STOP_BY fails first.
    progress: show progress (process 0); tensorboard: mirror the records' scalars into
    run_dir/tensorboard; time_stamps: stamp each record with time_unix_s; on_record: called on
    process 0 with each record as it is logged.
    """

    def __init__(
        self,
        run_dir: Path,
        progress: bool = True,
        tensorboard: bool = False,
        time_stamps: bool = True,
        on_record: Callable[[dict], None] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.progress, self.tensorboard, self.time_stamps = progress, tensorboard, time_stamps
        self.on_record = on_record if is_main() else None
        self.deadline = Deadline.from_env()

    def run(self, program: Program) -> RunOutcome:
        path = self.run_dir / "metrics.jsonl"
        # the records up to the restored step: those after it are dropped, and a new run drops all
        # (an attempt that never reached a checkpoint, a validation before its first step included)
        history = truncate_metrics(path, program.step if program.resumed else -1) if is_main() else []
        self.deadline.record(history[-3:])
        log = MetricsLog(
            path,
            self.run_dir / "tensorboard" if self.tensorboard else None,
            enabled=is_main(),
            time_stamps=self.time_stamps,
        )
        last: dict = {}

        def write(record: dict | None) -> None:
            nonlocal last
            if record is None:
                return
            log.write(record)
            last = record
            if self.on_record is not None:
                self.on_record(record)

        start, finished, failed = time.perf_counter(), False, True
        try:
            with (
                StopSignals(announce=is_main()) as stop,
                Progress(program.name, program.steps, program.step, self.progress and is_main()) as bar,
            ):
                if program.step == 0:
                    write(program.evaluate(final=False))
                while program.step < program.steps and not any_process(stop.requested or self._too_late(program)):
                    began = self.deadline.clock()
                    records, fields = program.run_step()
                    self.deadline.step_took(self.deadline.clock() - began)
                    for record in records:
                        write(record)
                    bar.update(1, **fields)
                finished = program.step >= program.steps
                if finished:
                    write(program.evaluate(final=True))
                else:
                    if program.checkpointer.latest_step() != program.step:
                        program.save()
                    why = stop.name or (
                        f"time limit ({self.deadline.reason()})" if self.deadline.too_late() else "SIGTERM"
                    )
                    say(
                        f"{why}: checkpointed step {program.step} in {self.run_dir / 'checkpoints'}; "
                        f"continue with --resume"
                    )
            failed = False
        finally:
            _close([program.close, log.close, program.checkpointer.close], quietly=failed)
        seconds = time.perf_counter() - start
        if finished:
            program.export(seconds)
        return RunOutcome(finished, last, seconds)

    def _too_late(self, program: Program) -> bool:
        self.deadline.checkpoint_written(program.checkpointer.longest_write_s)
        return self.deadline.too_late()


def _close(closers: list[Callable[[], None]], quietly: bool) -> None:
    """Calls every closer; raises the first error, unless `quietly` (the run is failing: its first
    error is the one to report)."""
    first = None
    for close in closers:
        try:
            close()
        except Exception as err:
            first = first or err
    if first is not None and not quietly:
        raise first
