"""Joining a multi-process job: a process whose peers never arrive exits after a bounded wait with
one line naming the coordinator, the expected processes and itself."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxspec.distributed import initialize_from_env

REPO = str(Path(__file__).resolve().parents[1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_a_process_whose_peer_never_starts_exits_with_a_clear_error(tmp_path):
    address = f"localhost:{_free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": "0", "JAXSPEC_PEER_TIMEOUT_S": "3"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "jaxspec.cli", "train", "--config", "configs/grpo_tiny.yaml",
                           "--run-dir", str(tmp_path / "run")], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert time.perf_counter() - start < 60
    assert proc.stderr.strip().splitlines()[-1] == (
        f"jaxspec: error: process 0 of 2 waited 3 s for the job at the coordinator {address}: process 1 did not "
        f"arrive; start every process with the same JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES, or wait "
        f"longer with JAXSPEC_PEER_TIMEOUT_S")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["soon", "0", "-5"])
def test_a_bad_peer_timeout_is_an_error_before_joining(monkeypatch, value):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    monkeypatch.setenv("JAXSPEC_PEER_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=f"JAXSPEC_PEER_TIMEOUT_S='{value}': expected a positive number of seconds"):
        initialize_from_env()
