"""Orbax checkpoints of a run's training state, and resuming from the newest one that restores.

A checkpoint folder `checkpoints/<step>/` appears only once complete (orbax writes atomically),
but a disk can still damage one afterwards (a truncated data file, an empty `_METADATA`). On
resume, `Checkpointer.resume` tries the checkpoints newest first: when an older one restores, each
newer damaged one is reported in one line and moved aside to `checkpoints/<step>.damaged-<UTC
time>` (outside orbax's step names, so it is neither resumed from nor garbage-collected; never
deleted). When none restores, nothing is moved and the error lists every checkpoint tried.

A save that fails for a system reason (a full disk, permissions, a file-size limit) raises
`jaxspec.exits.StorageError` naming the step, the folder and the reason, when the save is started
or, as orbax writes in the background, when the next save or `close` waits for it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxspec.distributed import any_process, barrier, is_main, say
from jaxspec.exits import StorageError, system_reason

TrainState = dict


class Checkpointer:
    """Atomic orbax checkpoints of the training state under `directory`, keeping the last `keep`.

    longest_write_s: the longest time from a save's start until it was complete on disk (None
    before the first completes).
    """

    def __init__(self, directory: Path, keep: int):
        self.directory = Path(directory).absolute()
        self.longest_write_s: float | None = None
        self._in_flight: collections.deque[tuple[int, float]] = collections.deque()  # (step, start), oldest first
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, async_options=ocp.AsyncOptions(post_finalization_callback=self._written)
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def _written(self) -> None:  # orbax calls it once a save is complete on disk (saves complete in order)
        if self._in_flight:
            _, start = self._in_flight.popleft()
            self.longest_write_s = max(self.longest_write_s or 0.0, time.perf_counter() - start)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: TrainState) -> None:
        step = int(state["step"])
        failing = self._in_flight[0][0] if self._in_flight else step  # a failure may be the last save's
        self._in_flight.append((step, time.perf_counter()))
        with self._naming_failures(failing):
            saved = self.manager.save(step, args=ocp.args.StandardSave(state))
        if not saved:  # orbax skipped it (the step is saved already): nothing will complete
            self._in_flight.pop()

    @contextlib.contextmanager
    def _naming_failures(self, step: int):
        """Re-raises a failure to write checkpoint `step` for a system reason as a StorageError."""
        try:
            yield
        except Exception as err:
            reason = system_reason(err)
            if reason is None:
                raise
            raise StorageError(f"writing the checkpoint of step {step} in {self.directory} failed: {reason}") from err

    def restore(self, like: TrainState, step: int | None = None) -> TrainState:
        """Checkpoint `step` (default: the latest) in the structure, dtypes and shardings of `like`.

        `like` holds arrays or ShapeDtypeStructs (e.g. from `jax.eval_shape`); leaves without a
        sharding are restored onto the default device.
        """
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

        def target(leaf):
            sharding = getattr(leaf, "sharding", None)
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device if sharding is None else sharding)

        abstract = jax.tree.map(target, like)
        step = self.manager.latest_step() if step is None else step
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def resume(self, like: TrainState, report: Callable[[str], None] = say) -> TrainState | None:
        """The newest checkpoint that restores completely (as `restore`), or None when the run has
        none (reported in one line: a new run, or a mistyped --run-dir).

        Newer checkpoints that fail to restore are reported one line each and moved aside (see the
        module doc). Raises ValueError naming every checkpoint tried and its error when none
        restores. Every process of a multi-process job must call it.
        """
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            report(f"--resume: no checkpoint in {self.directory}; starting a new run")
            return None
        damaged: list[tuple[int, str]] = []
        for step in steps:
            try:
                state, reason = self.restore(like, step), None
            except Exception as err:  # orbax, TensorStore and json raise many types for one cause
                state, reason = None, _reason(err)
            if not any_process(reason is not None):
                self._move_aside(damaged, step, report)
                return state
            damaged.append((step, reason or "failed on another process"))
        tried = "; ".join(f"{self.directory / str(step)}: {reason}" for step, reason in damaged)
        raise ValueError(
            f"--resume: no checkpoint in {self.directory} restores (tried {tried}); nothing was moved or deleted"
        )

    def _move_aside(self, damaged: list[tuple[int, str]], restored: int, report: Callable[[str], None]) -> None:
        if not damaged:
            return
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        for step, reason in damaged:
            folder = self.directory / str(step)
            aside, copies = folder.with_name(f"{step}.damaged-{stamp}"), 1
            while aside.exists():  # the same step damaged again within the second
                aside, copies = folder.with_name(f"{step}.damaged-{stamp}-{copies}"), copies + 1
            if is_main():
                os.replace(folder, aside)
            report(
                f"checkpoint {folder} is damaged ({reason}); moved it to {aside.name}, resuming from step {restored}"
            )
        barrier("damaged checkpoints moved aside")
        self.manager.reload()

    def close(self) -> None:
        """Waits for the save in flight (StorageError when it failed) and closes the manager."""
        with self._naming_failures(self._in_flight[0][0] if self._in_flight else self.latest_step()):
            self.manager.wait_until_finished()
        self.manager.close()


def _reason(err: BaseException) -> str:
    """One short line: the type and first message line of the innermost exception `err` was raised
    from (TensorStore's read error, say, rather than orbax's wrapper around it)."""
    while err.__cause__ is not None:
        err = err.__cause__
    lines = str(err).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{type(err).__name__}: {first[:240]}" if first else type(err).__name__
