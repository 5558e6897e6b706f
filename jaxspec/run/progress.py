"""Progress of a training loop that reads well both on a terminal and in a log file.

On a terminal (stderr is a tty) a tqdm bar. Otherwise (SLURM output files, `> run.log`) a bar's
carriage returns would pile up on one line, so a plain line goes to stdout instead, at the first
step, then once at least `interval_s` seconds have passed (JAXSPEC_PROGRESS_INTERVAL_S, default
30), and at the last step:
    grpo: step 12/100 (12%), 41.2 s, reward=0.312 accept=2.41 step_s=3.1
"""

from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm

INTERVAL_ENV = "JAXSPEC_PROGRESS_INTERVAL_S"


class Progress:
    """Step counter of one loop. enabled=False (train.progress false, or not process 0) shows nothing."""

    def __init__(
        self,
        desc: str,
        total: int,
        initial: int = 0,
        enabled: bool = True,
        interval_s: float | None = None,
        terminal: bool | None = None,
    ):
        self.desc, self.total, self.step, self.enabled = desc, total, initial, enabled
        self.interval_s = float(os.environ.get(INTERVAL_ENV, "30")) if interval_s is None else interval_s
        terminal = sys.stderr.isatty() if terminal is None else terminal
        self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True) if enabled and terminal else None
        self._start = time.perf_counter()
        self._last_line: float | None = None

    def update(self, steps: int = 1, **fields) -> None:
        """Counts `steps` more steps; `fields` (already formatted strings) describe the latest one."""
        self.step += steps
        if self._bar is not None:
            self._bar.update(steps)
            if fields:
                self._bar.set_postfix(fields)
            return
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._last_line is None or now - self._last_line >= self.interval_s or self.step >= self.total:
            self._last_line = now
            detail = " ".join(f"{k}={v}" for k, v in fields.items())
            print(
                f"{self.desc}: step {self.step}/{self.total} ({100 * self.step // max(self.total, 1)}%), "
                f"{now - self._start:.1f} s{', ' + detail if detail else ''}",
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
