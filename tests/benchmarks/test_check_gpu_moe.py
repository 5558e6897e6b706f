"""benchmarks/check_gpu_moe.py: routed group sizes, and a CPU run at tiny shapes (kernel in interpret mode)."""

import jax
import numpy as np

from jaxspec.models import moe
from tests.benchmarks.scripts import load_script

check_gpu_moe = load_script("check_gpu_moe")


def test_routed_group_sizes_count_top_k_distinct_experts_per_token():
    sizes = np.asarray(check_gpu_moe.routed_group_sizes(jax.random.key(0), 64 * 8, 128, 8))
    assert sizes.shape == (128,) and sizes.sum() == 512 and sizes.max() <= 64  # each token picks an expert once


def test_tiny_run_prints_every_implementation_and_agrees(capsys):
    assert check_gpu_moe.main(["--tiny", "--rows", "32"]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines() if line.strip().startswith("tiny")]
    assert [(line[1], line[6]) for line in lines] == [
        (d, impl) for d in ("up", "down") for impl in ("kernel", "ragged_dot", "dense")
    ]
    assert all(float(line[7]) > 0 for line in lines)  # milliseconds
    assert "OK: the kernel equals ragged_dot" in out


def test_a_wrong_kernel_fails_the_check(monkeypatch, capsys):
    kernel = check_gpu_moe.grouped_matmul_pallas
    monkeypatch.setattr(check_gpu_moe, "grouped_matmul_pallas", lambda *a, **k: kernel(*a, **k) * 1.05)
    assert check_gpu_moe.main(["--tiny", "--rows", "16"]) == 1
    assert "MISMATCH tiny up rows=16" in capsys.readouterr().out


def test_grad_run_checks_the_weight_gradient(monkeypatch, capsys):
    assert check_gpu_moe.main(["--tiny", "--grad", "--rows", "16"]) == 0
    assert "forward + backward" in capsys.readouterr().out
    weight_grad = moe.grouped_transposed_matmul_pallas
    monkeypatch.setattr(moe, "grouped_transposed_matmul_pallas", lambda *a, **k: weight_grad(*a, **k) * 1.05)
    assert check_gpu_moe.main(["--tiny", "--grad", "--rows", "16"]) == 1
