"""A run's metrics file, metrics.jsonl: one JSON record per line, written by process 0 alone
(`MetricsLog`), cut back to the checkpointed step when a run resumes (`truncate_metrics`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from jaxspec.distributed import say
from jaxspec.exits import StorageError


class MetricsLog:
    """Appends one JSON object per line to `path`; mirrors numeric scalars to TensorBoard if asked.
    With enabled=False (the other processes of a multi-process job) it writes nothing.

    time_stamps: each record gets time_unix_s, when it was written (seconds since the epoch, to
    the millisecond: lines up runs that share a host).
    """

    def __init__(self, path: Path, tensorboard_dir: Path | None = None, enabled: bool = True, time_stamps: bool = True):
        self.path = Path(path)
        self.time_stamps = time_stamps
        self._file = open(self.path, "a", encoding="utf-8") if enabled else None
        self._writer = None
        if enabled and tensorboard_dir is not None:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(str(tensorboard_dir))

    def write(self, record: dict) -> None:
        """Appends `record` (with its time_unix_s, which TensorBoard does not mirror: it keeps its
        own wall time); a failed write raises StorageError naming the file."""
        if self._file is None:
            return
        line = {**record, "time_unix_s": round(time.time(), 3)} if self.time_stamps else record
        try:
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()
        except OSError as err:  # a full disk: the error names the file
            raise StorageError(f"writing {self.path} failed: {err.strerror or err}") from err
        if self._writer is not None:
            step = int(record["step"])
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar(key, value, step)
                elif isinstance(value, list):
                    for i, item in enumerate(value):
                        if item is not None:
                            self._writer.add_scalar(f"{key}/{i}", item, step)
            self._writer.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._writer is not None:
            self._writer.close()


def truncate_metrics(path: Path, step: int, report: Callable[[str], None] = say) -> list[dict]:
    """Drops the records of steps after `step` from a JSON-lines metrics file (those a resumed run
    will redo; written by a run that died after its last checkpoint); returns the records kept.

    A last line cut short (the process died while writing it) is dropped and reported in one line;
    a line that is not a JSON record before the last raises ValueError naming the file and line.
    """
    path = Path(path)
    if not path.exists():
        return []
    lines = [
        (number, line) for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if line.strip()
    ]
    records = []
    for i, (number, line) in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"a {type(record).__name__}, not a record")
        except ValueError as err:
            if i + 1 < len(lines):
                raise ValueError(
                    f"{path}: line {number} is not a JSON record ({err}); repair or move the file aside to resume"
                ) from None
            report(f"{path}: dropped its last line, cut short while it was written ({err})")
            continue
        if record.get("step", 0) <= step:
            records.append((line, record))
    path.write_text("".join(line + "\n" for line, _ in records), encoding="utf-8")
    return [record for _, record in records]
