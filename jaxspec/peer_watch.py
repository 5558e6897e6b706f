"""Mid-run liveness of the other processes of a multi-process job, and one line when one is gone.

JAX's coordination service notices a dead process only by its missed heartbeats, and then aborts
every other process from C++ (with a stack trace that names no process); meanwhile a collective
whose peer died hangs (NCCL) or fails with a transport error (Gloo, on the CPU). `PeerWatch` runs
in a daemon thread of every process: every few seconds it writes a counter into the job's
key-value store (held by the coordination service on process 0) and reads the others'. When a
peer's counter has not moved for `timeout` seconds it prints one line naming the silent process
and exits the process with EXIT_PEER, before JAX's own heartbeat timeout (set 60 s later by
`jaxspec.distributed`) aborts it. Process 0 writes its verdict into the store and exits a few
seconds after the others read it, since its exit takes the store with it. A process that ends
normally marks itself done, so that peers still finishing never wait on it.

When process 0 itself dies, JAX's client in every other process aborts at once from C++
("Terminating process because the JAX distributed service detected fatal errors"): that happens
before any Python code can run, so those processes end with JAX's message, not jaxspec's line.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
import time

from jaxspec.exits import EXIT_PEER

_KEY = "jaxspec/alive/{}"
_VERDICT = "jaxspec/peer_failure"
_DONE = "done"
# How a collective reports a peer that went away (Gloo on the CPU; NCCL on GPUs, if it returns at all).
_COLLECTIVE_FAILURE = re.compile(r"Gloo|NCCL|nccl|[Cc]onnection (closed|reset) by peer")
_active: PeerWatch | None = None


class PeerWatch:
    """Watches the job's other processes from process `index` of `count` through `client` (JAX's
    `DistributedRuntimeClient`); see the module doc. `start` once the job has formed."""

    def __init__(self, client, index: int, count: int, timeout: float):
        self.client, self.index, self.count, self.timeout = client, index, count, timeout
        self.interval = min(5.0, timeout / 4)
        self._stop, self._decided = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxspec-peer-watch", daemon=True)

    def start(self) -> None:
        global _active
        _active = self
        self._thread.start()
        atexit.register(self.stop)  # after JAX's own exit handler registered: runs before its shutdown

    def stop(self) -> None:
        """Stops watching and marks this process done (it exits normally)."""
        self._stop.set()
        self._thread.join()
        try:
            self.client.key_value_set(_KEY.format(self.index), _DONE, allow_overwrite=True)
        except Exception:  # the store is gone already: the job is over
            pass

    def _run(self) -> None:
        peers = [p for p in range(self.count) if p != self.index]
        now = time.monotonic()
        seen = {p: (None, now) for p in peers}  # last value read, when it last changed
        beat = 0
        while not self._stop.wait(self.interval):
            now, beat = time.monotonic(), beat + 1
            try:
                self.client.key_value_set(_KEY.format(self.index), str(beat), allow_overwrite=True)
                verdict = self.client.key_value_try_get(_VERDICT)
            except Exception:  # no verdict (or no store: JAX's client ends the process then)
                verdict = None
            if verdict is not None:
                self._exit(verdict)
            for p in peers:
                try:
                    value = self.client.key_value_try_get(_KEY.format(p))
                except Exception:  # not written yet
                    value = None
                if value != seen[p][0]:
                    seen[p] = (value, now)
            silent = [p for p in peers if seen[p][0] != _DONE and now - seen[p][1] > self.timeout]
            if silent:
                which = f"process {silent[0]}" if len(silent) == 1 else f"processes {', '.join(map(str, silent))}"
                self._exit(f"{which} of {self.count} stopped answering")

    def _exit(self, what: str) -> None:
        self._decided.set()
        if self.index == 0:
            try:
                self.client.key_value_set(_VERDICT, what, allow_overwrite=True)
            except Exception:
                pass
        print(
            f"jaxspec: error: {what} for {self.timeout:g} s (it died or hangs: its own log says why); process "
            f"{self.index} stops too (JAXSPEC_PEER_TIMEOUT_S sets the wait)",
            file=sys.stderr,
            flush=True,
        )
        if self.index == 0:
            time.sleep(3 * self.interval)  # the others read the verdict before the store goes
        os._exit(EXIT_PEER)

    def wait(self) -> None:
        """Blocks for as long as the watch needs to find a silent peer, and for good once it has
        (it exits the process)."""
        if self._decided.wait(self.timeout + 2 * self.interval):
            threading.Event().wait()


def await_peer_failure(error: BaseException) -> None:
    """When `error` is a collective that failed because a peer went away, waits for the watch to
    name that peer (and exit); returns at once for any other error or without a multi-process job."""
    if _active is not None and _COLLECTIVE_FAILURE.search(str(error)):
        _active.wait()
