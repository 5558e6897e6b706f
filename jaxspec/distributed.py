"""Multi-process (multi-host) runs: joining the job, the main process, host copies of global arrays.

`jaxspec train` launched as several processes (SLURM tasks, or any launcher that sets
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID) joins one JAX job: every process
runs the same loop on the same host data, the mesh spans all processes' devices, and only the
main process writes files and prints. One process is a no-op everywhere here.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils


def initialize_from_env() -> bool:
    """Joins the multi-process job the environment describes; returns whether there is one.

    JAX_COORDINATOR_ADDRESS (host:port of process 0) with JAX_NUM_PROCESSES and JAX_PROCESS_ID,
    or a SLURM step with several tasks (JAX reads SLURM's variables itself). Must run before
    anything touches a JAX backend.
    """
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address:
        missing = [k for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if k not in os.environ]
        if missing:
            raise ValueError(f"JAX_COORDINATOR_ADDRESS is set but {', '.join(missing)} is not")
        _cpu_collectives()
        jax.distributed.initialize(address, num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                                   process_id=int(os.environ["JAX_PROCESS_ID"]))
        return True
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_STEP_ID" in os.environ:
        _cpu_collectives()
        jax.distributed.initialize()
        return True
    return False


def _cpu_collectives() -> None:
    # Collectives between CPU processes (tests, CPU clusters); GPU backends use NCCL regardless.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def is_main() -> bool:
    """Whether this process writes files, metrics and progress (process 0)."""
    return jax.process_index() == 0


def to_host(x) -> np.ndarray:
    """A numpy copy of a (possibly multi-process) array; every process must call it (a collective
    when the array spans other processes' devices)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def say(message: str) -> None:
    """Prints a progress line (process 0 only; safe next to a tqdm bar)."""
    if is_main():
        from tqdm import tqdm

        tqdm.write(message)


def any_process(flag: bool) -> bool:
    """Whether `flag` is set on any process (e.g. a SIGTERM that reached only some of them), so all
    processes take the same branch; every process must call it."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.any(multihost_utils.process_allgather(np.asarray([flag]))))


def barrier(name: str) -> None:
    """Waits until every process reaches the same named point (a no-op with one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
