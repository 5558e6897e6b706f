"""tests/gpu/check_moe.py: on a GPU, the grouped-matmul kernels against ragged_dot at Qwen3-30B-A3B's
and small_moe's expert shapes, forward and backward; on the CPU, routed group sizes and a run at tiny
shapes (kernel in Triton's interpreter)."""

import jax
import numpy as np
import pytest

kernels = pytest.importorskip("jaxspec.kernels.grouped_matmul", reason="the kernels need triton (the test extra)")

from tests.gpu import check_moe  # noqa: E402


@pytest.mark.gpu
def test_kernels_equal_ragged_dot_forward():
    assert check_moe.main(["--rows", "512", "2048", "32768", "--calls", "2", "--repeats", "1"]) == 0


@pytest.mark.gpu
def test_kernels_equal_ragged_dot_forward_and_backward():
    assert check_moe.main(["--grad", "--rows", "2048", "32768", "--calls", "2", "--repeats", "1"]) == 0


def test_routed_group_sizes_count_top_k_distinct_experts_per_token():
    sizes = np.asarray(check_moe.routed_group_sizes(jax.random.key(0), 64 * 8, 128, 8))
    assert sizes.shape == (128,) and sizes.sum() == 512 and sizes.max() <= 64  # each token picks an expert once


def test_tiny_run_prints_every_implementation_and_agrees(capsys):
    assert check_moe.main(["--tiny", "--rows", "32"]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines() if line.strip().startswith("tiny")]
    assert [(line[1], line[6]) for line in lines] == [
        (d, impl) for d in ("up", "down") for impl in ("kernel", "ragged_dot", "dense")
    ]
    assert all(float(line[7]) > 0 for line in lines)  # milliseconds
    assert "OK: the kernel equals ragged_dot" in out


def test_a_wrong_kernel_fails_the_check(monkeypatch, capsys):
    kernel = check_moe.grouped_matmul_triton
    monkeypatch.setattr(check_moe, "grouped_matmul_triton", lambda *a, **k: kernel(*a, **k) * 1.05)
    assert check_moe.main(["--tiny", "--rows", "16"]) == 1
    assert "MISMATCH tiny up rows=16" in capsys.readouterr().out


def test_grad_run_checks_the_weight_gradient(monkeypatch, capsys):
    assert check_moe.main(["--tiny", "--grad", "--rows", "16"]) == 0
    assert "forward + backward" in capsys.readouterr().out
    weight_grad = kernels.grouped_transposed_matmul_triton
    monkeypatch.setattr(kernels, "grouped_transposed_matmul_triton", lambda *a, **k: weight_grad(*a, **k) * 1.05)
    assert check_moe.main(["--tiny", "--grad", "--rows", "16"]) == 1


def test_tokamax_rows_are_checked_and_timed_beside_the_kernel(capsys):
    pytest.importorskip("tokamax", reason="tokamax is not a test dependency")
    # off a GPU tokamax's "xla" implementation runs and its "mosaic" one says why it cannot
    assert check_moe.main(["--tiny", "--rows", "16", "--tokamax", "xla", "mosaic"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("tiny")]
    assert [line[6] for line in rows if line[1] == "up"] == [
        "kernel",
        "ragged_dot",
        "dense",
        "tokamax-xla",
        "tokamax-mosaic",
    ]
    xla = next(line for line in rows if line[6] == "tokamax-xla")
    assert float(xla[7]) > 0 and float(xla[-1]) < check_moe.TOLERANCE
    if jax.default_backend() == "cpu":
        assert any(line[6] == "tokamax-mosaic" and "did not run" in " ".join(line) for line in rows)
    assert "so does tokamax's wherever it ran" in out


def test_a_wrong_tokamax_result_fails_the_check(monkeypatch, capsys):
    pytest.importorskip("tokamax", reason="tokamax is not a test dependency")
    right = check_moe.tokamax_ragged_dot
    monkeypatch.setattr(check_moe, "tokamax_ragged_dot", lambda impl: lambda x, w, s: right(impl)(x, w, s) * 1.05)
    assert check_moe.main(["--tiny", "--rows", "16", "--tokamax", "xla"]) == 1
    assert "MISMATCH tiny up rows=16: tokamax-xla vs ragged_dot" in capsys.readouterr().out


def test_tokamax_rows_without_tokamax_name_the_package(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "tokamax", None)  # import fails as if not installed
    with pytest.raises(SystemExit, match="pip install tokamax"):
        check_moe.main(["--tiny", "--rows", "16", "--tokamax", "xla"])
