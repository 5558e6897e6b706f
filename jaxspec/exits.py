"""Exit statuses of the jaxspec commands, one per kind of outcome, and the one line an error ends with.

    0    finished
    1    an error jaxspec did not foresee: its traceback, then the one line
    2    bad input: the command line, a config key or override, a data file, the policy or draft
         folder, the run directory (named in the line)
    3    the reward cannot grade: its self-test failed before the run, or every response of a batch
         failed
    4    another process of a multi-process job did not join, or stopped answering during the run
         (the line names it; `jaxspec.distributed`)
    5    a file could not be written or read: a full disk, permissions, a file-size limit (the
         line gives the system's reason and the path)
    75   checkpointed and stopped before the end (SIGTERM, Ctrl-C, the job's time limit): continue
         with --resume
    130  Ctrl-C outside a training loop

Every error ends the output with one line `jaxspec <command>: error: <what>`, and the console
command exits right after it: nothing is printed after it (the checkpointer's background threads
are not waited for).
"""

from __future__ import annotations

import os
import re

EXIT_ERROR = 1
EXIT_INPUT = 2
EXIT_REWARD = 3
EXIT_PEER = 4
EXIT_STORAGE = 5
EXIT_CHECKPOINTED = 75  # EX_TEMPFAIL of sysexits.h; the SLURM script requeues its job on it
EXIT_INTERRUPTED = 130

EPILOG = (
    f"exit status: 0 finished; {EXIT_CHECKPOINTED} stopped by SIGTERM, Ctrl-C or the job's time limit after "
    f"checkpointing (continue with --resume; a second Ctrl-C aborts at once); {EXIT_INPUT} bad input (command "
    f"line, config, data, policy or run directory); {EXIT_REWARD} the reward cannot grade; {EXIT_PEER} another "
    f"process of the job did not join or stopped answering; {EXIT_STORAGE} a file could not be written or read "
    f"(e.g. a full disk); {EXIT_ERROR} another error"
)

# How TensorStore (orbax's writer) and safetensors (Rust's io::Error) report a system error's errno.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)|Os \{ code: (\d+)")


class StorageError(RuntimeError):
    """Writing (or reading) the run's files failed for a system reason; the message names the path."""

    exit_status = EXIT_STORAGE


def system_reason(error: BaseException) -> str | None:
    """The system's reason for a failed file operation inside `error` or the errors it was raised
    from: an OSError's strerror, or the errno TensorStore reports in its messages; None if none."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.strerror:
            return error.strerror
        code = _OS_ERROR_CODE.search(str(error))
        if code:
            return os.strerror(int(code.group(1) or code.group(2)))
        error = error.__cause__ or error.__context__
    return None


def exit_status(error: BaseException) -> tuple[int, str]:
    """(exit status, the one line after `error: `) of an exception that ended a command."""
    status = getattr(error, "exit_status", None)
    if status is not None:
        return status, str(error)
    if isinstance(error, FileNotFoundError):
        return EXIT_INPUT, str(error)
    if isinstance(error, OSError):
        where = f": {error.filename}" if error.filename else ""
        return EXIT_STORAGE, f"{error.strerror or error}{where}"
    reason = system_reason(error)
    if reason is not None:  # a library's wrapper around a failed write (orbax, safetensors)
        first = (str(error).strip().splitlines() or [""])[0]
        return EXIT_STORAGE, f"{reason} ({first[:300]})"
    if isinstance(error, ValueError):
        return EXIT_INPUT, str(error)
    return EXIT_ERROR, f"{type(error).__name__}: {error}"
