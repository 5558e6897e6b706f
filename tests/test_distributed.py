"""Joining a multi-process job: a process whose peers never arrive exits after a bounded wait with
one line naming the coordinator, the expected processes and itself; a peer that dies mid-run ends
the others with one line naming it."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxspec.distributed import initialize_from_env, slurm_local_devices
from jaxspec.exits import EXIT_PEER

REPO = str(Path(__file__).resolve().parents[1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_a_process_whose_peer_never_starts_exits_with_a_clear_error(tmp_path):
    address = f"localhost:{_free_port()}"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COORDINATOR_ADDRESS": address,
        "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": "0",
        "JAXSPEC_PEER_TIMEOUT_S": "3",
    }
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxspec.cli",
            "train",
            "--config",
            "configs/grpo_tiny.yaml",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == EXIT_PEER, proc.stderr
    assert time.perf_counter() - start < 60
    assert proc.stderr.strip().splitlines()[-1] == (
        f"jaxspec: error: process 0 of 2 waited 3 s for the job at the coordinator {address}: process 1 did not "
        f"arrive; start every process with the same JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES, or wait "
        f"longer with JAXSPEC_PEER_TIMEOUT_S"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["soon", "0", "-5"])
def test_a_bad_peer_timeout_is_an_error_before_joining(monkeypatch, value):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    monkeypatch.setenv("JAXSPEC_PEER_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=f"JAXSPEC_PEER_TIMEOUT_S='{value}': expected a positive number of seconds"):
        initialize_from_env()


# A stand-in `jaxspec` command for the processes of one job: they join (as `jaxspec train` does),
# then run collectives (any_process, every step boundary's) or wait in a long step; one of them
# dies mid-run.
PROBE = """
import os, sys, time

def main(argv):
    from jaxspec.distributed import any_process, initialize_from_env
    initialize_from_env()
    import jax
    victim, survivor_waits = int(argv[0]), argv[1] == "wait"
    for i in range(600):
        if jax.process_index() == victim and i == 3:
            os._exit(9)
        if survivor_waits and i == 3:
            time.sleep(120)  # a step that waits on the dead peer without failing (NCCL hangs)
        any_process(False)
        time.sleep(0.1)
    return 0

if __name__ == "__main__":
    import jaxspec.cli as cli
    sys.path.insert(0, os.path.dirname(__file__))
    cli.COMMANDS["probe"] = ("peer_probe", "")
    sys.argv = [sys.argv[0], "probe", *sys.argv[1:]]
    cli.entry()
"""


@pytest.mark.parametrize("survivors_wait", ["collective", "wait"])
def test_a_peer_that_dies_mid_run_ends_the_others_with_one_line(tmp_path, survivors_wait):
    """Process 2 of 3 dies; processes 0 and 1 (in a collective that fails, or waiting) each end with
    one line naming it, within seconds of JAXSPEC_PEER_TIMEOUT_S and without a stack trace."""
    (tmp_path / "peer_probe.py").write_text(PROBE)
    address = f"localhost:{_free_port()}"
    procs = []
    for index in range(3):
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "JAX_COORDINATOR_ADDRESS": address,
            "JAX_NUM_PROCESSES": "3",
            "JAX_PROCESS_ID": str(index),
            "JAXSPEC_PEER_TIMEOUT_S": "3",
            "PYTHONPATH": REPO,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(tmp_path / "peer_probe.py"), "2", survivors_wait],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    start = time.perf_counter()
    outputs = [p.communicate(timeout=120) for p in procs]
    assert time.perf_counter() - start < 60
    assert procs[2].returncode == 9
    for survivor in (0, 1):
        stderr = outputs[survivor][1]
        assert procs[survivor].returncode == EXIT_PEER, stderr
        assert stderr.strip().splitlines()[-1] == (
            f"jaxspec: error: process 2 of 3 stopped answering for 3 s (it died or hangs: its own log says why); "
            f"process {survivor} stops too (JAXSPEC_PEER_TIMEOUT_S sets the wait)"
        )
        assert "Traceback" not in stderr and "@ 0x" not in stderr  # no Python or C++ stack


@pytest.mark.parametrize(
    "env, ids",
    [
        ({"SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8"}, list(range(8))),
        ({"SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "2", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, [0, 1, 2, 3]),
        ({"SLURM_NTASKS": "16", "SLURM_STEP_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8"}, None),  # one task per GPU
        ({"SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "2"}, None),  # no GPUs
        (
            {"SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8", "JAX_LOCAL_DEVICE_IDS": "0"},
            None,
        ),
    ],
)
def test_a_task_per_node_takes_every_gpu_of_its_node(monkeypatch, env, ids):
    for key in (
        "SLURM_GPUS_ON_NODE",
        "CUDA_VISIBLE_DEVICES",
        "JAX_LOCAL_DEVICE_IDS",
        "SLURM_NNODES",
        "SLURM_JOB_NUM_NODES",
    ):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert slurm_local_devices() == ids
