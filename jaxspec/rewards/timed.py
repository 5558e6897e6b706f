"""Wall-clock limits for reward functions: the call runs in a worker process that is killed when
it overruns.

A Python thread cannot be stopped, and `signal.alarm` (math-verify's own timeout) only works on
the main thread of the main interpreter, so a verifier that hangs on a pathological string
(sympy simplification can run for minutes) is isolated in a process instead: this works from any
thread. The worker (`jaxspec.rewards.worker`) is a fresh interpreter started with
`python -m jaxspec.rewards.worker` that imports the function by name, so it never runs the
parent's script again (no `if __name__ == "__main__":` guard needed, and scripts read from stdin
work). It is started on the first call and reused; after a timeout, or when it dies, the next
call starts a fresh one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

_STARTUP_S = 120.0  # importing the verifier's dependencies in a fresh process


class RewardCallError(RuntimeError):
    """A reward call that produced no score: it raised, overran its limit, or its worker died or
    could not start. The message says which."""


class TimedCall:
    """`fn(*args)` in a worker process, cut off after `timeout_s` seconds.

    fn must be importable by name: a function at the top level of a module other than the script
    being run (ValueError otherwise, at construction). A `fn.warm_up()`, if fn has one, runs once
    when a worker starts (within its start-up limit, not a call's): lazy imports and first-use
    setup that would otherwise count against the first call's timeout_s. Calls are serialised
    (one worker) and thread-safe; a call that raises, overruns or loses its worker raises
    RewardCallError.
    """

    def __init__(self, fn: Callable, timeout_s: float):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if module in (None, "__main__", "__mp_main__") or "<" in qualname:
            raise ValueError(
                f"{getattr(fn, '__name__', fn)!r} would run in a reward worker process, which imports "
                f"it by name: define it at the top level of an importable module (not in the script "
                f"being run, nor inside a function)"
            )
        self.fn, self.timeout_s = fn, timeout_s
        self._target = (module, qualname)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "jaxspec.rewards.worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env={**os.environ, "JAX_PLATFORMS": "cpu"},
                start_new_session=True,
            )
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        try:
            self._conn.send((list(sys.path), *self._target))
            if not self._conn.poll(_STARTUP_S):
                raise RewardCallError(f"the reward worker for {self._name} did not start within {_STARTUP_S:.0f} s")
            ok, error = self._conn.recv()
        except (EOFError, OSError):
            status = self._proc.wait()
            self._stop()
            raise RewardCallError(
                f"the reward worker for {self._name} exited with status {status} while starting "
                f"(its output above says why)"
            ) from None
        except RewardCallError:
            self._stop()
            raise
        if not ok:
            self._stop()
            raise RewardCallError(f"the reward worker {error}")

    @property
    def _name(self) -> str:
        return ".".join(self._target)

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def __call__(self, *args) -> Any:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._stop()
                self._start()
            try:
                self._conn.send(args)
                if not self._conn.poll(self.timeout_s):
                    self._stop()
                    raise RewardCallError(f"exceeded {self.timeout_s:g} s on {_preview(args)} (worker restarted)")
                ok, value = self._conn.recv()
            except (EOFError, OSError) as error:  # the worker died (e.g. out of memory, killed)
                status = self._proc.wait()
                self._stop()
                raise RewardCallError(
                    f"the reward worker died (exit status {status}: {type(error).__name__})"
                ) from None
        if not ok:
            raise RewardCallError(value)
        return value

    def close(self) -> None:
        with self._lock:
            self._stop()


def _preview(args: tuple, limit: int = 80) -> str:
    text = repr(args[0]) if args else "()"
    return text if len(text) <= limit else text[:limit] + "..."
