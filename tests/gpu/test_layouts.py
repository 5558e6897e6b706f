"""tests/gpu/check_layouts.py on the GPUs of one host: two GRPO steps of configs/grpo_tiny.yaml (float32
rollouts and compute, so that no layout's summation order moves a sample) on every (data, fsdp,
tensor) layout of the GPUs, each layout's first-step metrics against one GPU's."""

from pathlib import Path

import jax
import pytest

from tests.gpu import check_layouts

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_every_layout_agrees_with_one_gpu(monkeypatch):
    if jax.device_count() < 2:
        pytest.skip("needs 2 or more GPUs")
    monkeypatch.chdir(ROOT)  # the runs are `python3 -m jaxspec.cli train` children of this checkout
    assert check_layouts.main(["--config", str(ROOT / "configs/grpo_tiny.yaml"), "--steps", "2"]) == 0
