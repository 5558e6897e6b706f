"""Wall-clock limits for reward functions: the call runs in a worker process that is killed when
it overruns.

A Python thread cannot be stopped, and `signal.alarm` (math-verify's own timeout) only works on
the main thread of the main interpreter, so a verifier that hangs on a pathological string
(sympy simplification can run for minutes) is isolated in a process instead: this works from any
thread. The worker is started once (spawned, so it does not inherit JAX's threads) and reused;
after a timeout it is killed and the next call starts a fresh one.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from typing import Any, Callable

log = logging.getLogger("jaxspec.rewards")

_STARTUP_S = 120.0  # importing the verifier's dependencies in a fresh process


def _serve(conn, fn: Callable) -> None:
    """Worker loop: receives argument tuples, answers (True, result) or (False, error text)."""
    conn.send(("ready", None))
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, fn(*args)))
        except Exception as error:  # reported to the caller, which scores 0
            conn.send((False, f"{type(error).__name__}: {error}"))


class TimedCall:
    """`fn(*args)` in a worker process, cut off after `timeout_s` seconds (result None).

    fn must be importable by name (a module-level function), as it is sent to a spawned process.
    Calls are serialised (one worker); thread-safe. An exception inside fn also returns None.
    """

    def __init__(self, fn: Callable, timeout_s: float):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.fn, self.timeout_s = fn, timeout_s
        self._lock = threading.Lock()
        self._proc = self._conn = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self.fn), daemon=True,
                                 name=f"reward-{getattr(self.fn, '__name__', 'fn')}")
        self._proc.start()
        child.close()
        if not self._conn.poll(_STARTUP_S):
            self._stop()
            raise RuntimeError(f"the reward worker for {self.fn!r} did not start within {_STARTUP_S:.0f} s")
        self._conn.recv()

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._conn.close()
        self._proc = self._conn = None

    def __call__(self, *args) -> Any:
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._stop()
                self._start()
            try:
                self._conn.send(args)
                if self._conn.poll(self.timeout_s):
                    ok, value = self._conn.recv()
                    if ok:
                        return value
                    log.warning("reward %s raised %s; scored 0", self.fn.__name__, value)
                    return None
            except (EOFError, OSError, BrokenPipeError) as error:  # the worker died (e.g. out of memory)
                log.warning("reward %s: worker lost (%s); scored 0", self.fn.__name__, error)
                self._stop()
                return None
            log.warning("reward %s exceeded %.1f s on %s; scored 0 (worker restarted)", self.fn.__name__,
                        self.timeout_s, _preview(args))
            self._stop()
            return None

    def close(self) -> None:
        with self._lock:
            self._stop()


def _preview(args: tuple, limit: int = 80) -> str:
    text = repr(args[0]) if args else "()"
    return text if len(text) <= limit else text[:limit] + "..."
