"""`jaxspec bench attention` runs end to end on CPU (kernel in interpret mode) and reports the
kernel's agreement with the dense path."""

import json

from jaxspec.cli import main
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
