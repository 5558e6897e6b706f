"""`jaxspec bench attention` runs end to end on CPU (kernels in interpret mode) and reports the
kernels' agreement with the dense path, the paged ones (Mosaic GPU, Triton) with --paged."""

import importlib.util
import json

import pytest

from jaxspec.cli import main
from jaxspec.kernels.paged_attention_mosaic import INTERPRET_SUPPORTED
from tests.bench.test_spec_cost import TINY


def test_bench_attention_smoke(tmp_path):
    model, out = tmp_path / "tiny.json", tmp_path / "attention.json"
    model.write_text(json.dumps(TINY))
    assert (
        main(
            [
                "bench",
                "attention",
                "--model",
                str(model),
                "--batch",
                "2",
                "--tokens",
                "1",
                "3",
                "--max-len",
                "96",
                "--fill",
                "0.5",
                "--iters",
                "1",
                "--kernel-impl",
                "interpret",
                "--read-bytes",
                "4096",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["tokens"]) for r in rows] == [(2, 1), (2, 3)]
    for row in rows:
        assert row["max_abs_diff"] < 1e-2  # bf16 inputs; the kernel reads only the filled slots
        assert row["xla_ms"] > 0 and row["kernel_ms"] > 0


def test_tune_times_each_kernel_configuration_in_a_loop():
    from jaxspec.bench.attention import attention_inputs, tune_kernel

    q, k, v, cache_len = attention_inputs(2, 1, 4, 2, 16, 256, 0.5)
    grid = [(16, 4, 2, 1.0), (32, 4, 2, 0.5)]
    rows = tune_kernel(q, k, v, cache_len, group=2, interpret=True, grid=grid)
    assert [(r["block_k"], r["splits"]) for r in rows] == [
        (16, 4),
        (32, 2),
    ]  # 4 splits by default: one per 64-slot block
    assert all(r["ms"] > 0 and r["kernel"] == "cache+merge" for r in rows)


def interpretable_paged_backends() -> list[str]:
    """The paged kernels that can run in interpret mode here: Mosaic GPU from JAX 0.12, Triton
    where triton and torch are installed."""
    backends = ["mosaic"] if INTERPRET_SUPPORTED else []
    if importlib.util.find_spec("triton") and importlib.util.find_spec("torch"):
        backends.append("triton")
    return backends


@pytest.mark.skipif(not interpretable_paged_backends(), reason="no paged kernel has an interpret mode here")
def test_bench_attention_paged_times_the_reference_and_the_kernels(tmp_path):
    backends = interpretable_paged_backends()
    model, out = tmp_path / "tiny.json", tmp_path / "attention.json"
    model.write_text(json.dumps({**TINY, "head_dim": 64}))  # a head dim the Mosaic GPU kernel takes
    argv = ["bench", "attention", "--model", str(model), "--batch", "2", "--tokens", "2", "--max-len", "64"]
    argv += ["--fill", "0.5", "--iters", "1", "--kernel-impl", "interpret", "--read-bytes", "4096", "--paged"]
    assert main([*argv, "--paged-backends", *backends, "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["paged_xla_ms"] > 0
    for backend in backends:
        assert row[f"paged_{backend}_max_abs_diff"] < 2.0**-5  # bf16 outputs of O(1)
        assert row[f"paged_{backend}_ms"] > 0 and row[f"paged_{backend}_roofline"] > 0


def test_bench_attention_paged_names_heads_the_kernel_does_not_take(tmp_path, capsys):
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(TINY))  # head dim 16
    argv = ["bench", "attention", "--model", str(model), "--batch", "2", "--tokens", "1", "--max-len", "32"]
    argv += ["--fill", "0.5", "--iters", "1", "--kernel-impl", "interpret", "--read-bytes", "4096", "--paged"]
    assert main(argv) == 2
    assert "does not take" in capsys.readouterr().err
