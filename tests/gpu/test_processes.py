"""tests/gpu/check_processes.py on the GPUs of one host: configs/grpo_tiny.yaml on an fsdp mesh of every
GPU as N processes x 1 GPU against 1 process x N GPUs, the N-process run resumed on one process."""

from pathlib import Path

import jax
import pytest

from tests.gpu import check_processes

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_processes_agree_with_one_process(monkeypatch):
    if jax.device_count() < 2:
        pytest.skip("needs 2 or more GPUs")
    monkeypatch.chdir(ROOT)  # the runs are `python3 -m jaxspec.cli train` children of this checkout
    assert check_processes.main(["--config", str(ROOT / "configs/grpo_tiny.yaml"), "--steps", "3"]) == 0
