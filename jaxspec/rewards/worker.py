"""The reward worker process: `python -m jaxspec.rewards.worker FD` serves calls of one reward
function over the connection on file descriptor FD (`jaxspec.rewards.timed.TimedCall`).

The worker is a fresh interpreter that imports the function by module and name, never the parent's
`__main__`: a training script without an `if __name__ == "__main__":` guard, or one read from stdin
(`python - <<EOF`), is not run again inside it. It runs on the CPU (JAX_PLATFORMS=cpu), ignores
Ctrl-C (its parent decides when to stop) and exits when its parent closes the connection or dies.

Protocol (pickled tuples): the parent sends (sys.path, module, qualname); the worker answers
(True, None) once the function is imported and its `warm_up()` has run, if it has one (a reward's
lazy imports and first-use setup, paid inside the start's limit instead of the first call's), or
(False, error text) and exits. Then each call:
args tuple in, (True, result) or (False, "ExceptionType: message") out.
"""

from __future__ import annotations

import importlib
import signal
import sys
from multiprocessing.connection import Connection


def resolve(module: str, qualname: str):
    """The object `qualname` (dotted inside the module) of `module`."""
    target = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def serve(conn: Connection) -> None:
    path, module, qualname = conn.recv()
    sys.path.extend(p for p in path if p not in sys.path)
    try:
        fn = resolve(module, qualname)
    except Exception as error:  # reported to the parent, which refuses the reward
        conn.send((False, f"cannot import {module}.{qualname}: {type(error).__name__}: {error}"))
        return
    warm_up = getattr(fn, "warm_up", None)
    if warm_up is not None:
        try:
            warm_up()
        except Exception as error:
            conn.send((False, f"{module}.{qualname}.warm_up() failed: {type(error).__name__}: {error}"))
            return
    conn.send((True, None))
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = (True, fn(*args))
        except Exception as error:  # the parent scores the call 0 and counts it as a failure
            result = (False, f"{type(error).__name__}: {error}")
        try:
            conn.send(result)
        except Exception as error:  # a result that does not pickle
            conn.send((False, f"its result cannot be sent back: {type(error).__name__}: {error}"))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(Connection(int(sys.argv[1])))
