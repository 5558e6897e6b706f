"""Multi-process (multi-host) runs: joining the job, the main process, host copies of global arrays.

`jaxspec train` launched as several processes (SLURM tasks, or any launcher that sets
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID) joins one JAX job: every process
runs the same loop on the same host data, the mesh spans all processes' devices, and only the
main process writes files and prints. One process is a no-op everywhere here.

Under SLURM with one task per node (configs/slurm/grpo.sbatch), each process takes every GPU
SLURM gave its node (SLURM_GPUS_ON_NODE, else the entries of CUDA_VISIBLE_DEVICES); with several
tasks per node, one GPU per task (JAX's own choice, [SLURM_LOCALID]). JAX_LOCAL_DEVICE_IDS
overrides both.

JAXSPEC_PEER_TIMEOUT_S seconds (default 300) bound every wait for another process: at start-up a
process whose peers never arrived exits with one line naming the coordinator address, the expected
number of processes and its own id (JAX cannot tell a waiting process which peers are missing);
during the run a process that hears nothing from a peer for that long (`jaxspec.peer_watch`: it
died, or hangs) exits with one line naming it. Both exit with EXIT_PEER (4).
"""

from __future__ import annotations

import os
import sys
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxspec.exits import EXIT_PEER
from jaxspec.peer_watch import PeerWatch, await_peer_failure

__all__ = [
    "any_process",
    "await_peer_failure",
    "barrier",
    "initialize_from_env",
    "is_main",
    "peer_timeout_s",
    "say",
    "slurm_local_devices",
    "to_host",
]


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
        count, index = int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"])
        _join(
            address,
            count,
            index,
            "start every process with the same JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES",
            coordinator_address=address,
            num_processes=count,
            process_id=index,
        )
        return True
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_STEP_ID" in os.environ:
        # JAX reads the address (the first node of the step), the count and the id from SLURM.
        _join(
            f"the first node of {os.environ.get('SLURM_STEP_NODELIST', 'the SLURM step')}",
            int(os.environ["SLURM_NTASKS"]),
            int(os.environ.get("SLURM_PROCID", "0")),
            "check that every task of the step started (srun's output)",
            local_device_ids=slurm_local_devices(),
        )
        return True
    return False


def slurm_local_devices() -> list[int] | None:
    """The local device ids of this SLURM task: all of its node's GPUs when the step runs one task
    per node (SLURM_GPUS_ON_NODE, else the entries of CUDA_VISIBLE_DEVICES: indices into the GPUs
    CUDA shows the task); None (JAX's default, [SLURM_LOCALID]) with several tasks per node, without
    GPUs, or when JAX_LOCAL_DEVICE_IDS names them."""
    if os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        return None
    tasks = int(os.environ["SLURM_NTASKS"])
    nodes = next(
        (
            int(os.environ[k])
            for k in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
            if os.environ.get(k, "").isdigit()
        ),
        None,
    )
    if nodes != tasks:
        return None
    gpus = os.environ.get("SLURM_GPUS_ON_NODE", "")
    count = (
        int(gpus)
        if gpus.isdigit()
        else len([d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()])
    )
    return list(range(count)) if count else None


PEER_TIMEOUT_ENV = "JAXSPEC_PEER_TIMEOUT_S"


def peer_timeout_s() -> float:
    """Seconds start-up waits for the job's processes: JAXSPEC_PEER_TIMEOUT_S, default 300."""
    raw = os.environ.get(PEER_TIMEOUT_ENV, "300")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{PEER_TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return value


def _join(address: str, count: int, index: int, hint: str, **kwargs) -> None:
    """jax.distributed.initialize under a watchdog: when the job has not formed after
    `peer_timeout_s()`, prints what is missing and exits EXIT_PEER; once joined, watches the peers
    (`PeerWatch`). (JAX's own timeouts, set later than jaxspec's, abort the process with a C++
    stack trace that names no process.)"""
    timeout = peer_timeout_s()
    _cpu_collectives()
    if index == 0:
        missing = (
            "process 1 did not arrive"
            if count == 2
            else f"not all of processes {_ids(range(1, count))} arrived (JAX does not say which)"
        )
    else:
        missing = (
            "the coordinator (process 0) did not arrive"
            if count == 2
            else f"the coordinator (process 0) or some of processes "
            f"{_ids(i for i in range(1, count) if i != index)} did not arrive (JAX does not say which)"
        )

    def give_up() -> None:
        print(
            f"jaxspec: error: process {index} of {count} waited {timeout:g} s for the job at the coordinator "
            f"{address}: {missing}; {hint}, or wait longer with {PEER_TIMEOUT_ENV}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_PEER)

    watchdog = threading.Timer(timeout, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            **kwargs, initialization_timeout=int(timeout) + 60, heartbeat_timeout_seconds=int(timeout) + 60
        )
    finally:
        watchdog.cancel()
    from jax._src.distributed import global_state

    PeerWatch(global_state.client, index, count, timeout).start()


def _ids(ids) -> str:
    ids = list(ids)
    return ", ".join(map(str, ids)) if len(ids) <= 8 else f"{ids[0]}..{ids[-1]}"


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
