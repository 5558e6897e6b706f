"""`jaxspec bench layer-kernels` runs end to end on the CPU (the kernels in Triton's interpreter,
float32) and reports, for each batch and step width, both forms' times and the kernels' outputs
equal to XLA's pieces."""

import json

import pytest

from jaxspec.cli import main
from tests.bench.test_spec_cost import TINY

pytest.importorskip("triton", reason="the kernels run in Triton's interpreter (the test extra has triton)")
pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")


def test_bench_layer_kernels_smoke(tmp_path):
    model, out = tmp_path / "tiny.json", tmp_path / "layer_kernels.json"
    model.write_text(json.dumps(TINY))
    argv = ["bench", "layer-kernels", "--model", str(model), "--batch", "1", "3", "--new", "1", "4"]
    argv += ["--context", "20", "--page-size", "8", "--dtype", "float32", "--iters", "2", "--repeats", "1"]
    assert main([*argv, "--interpret", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["batch"], r["new"]) for r in result["rows"]] == [(1, 1), (1, 4), (3, 1), (3, 4)]
    for row in result["rows"]:
        for name in ("norm", "prologue"):
            assert row[f"{name}_xla_us"] > 0 and row[f"{name}_kernel_us"] > 0
            assert row[f"{name}_speedup"] == pytest.approx(row[f"{name}_xla_us"] / row[f"{name}_kernel_us"])
            assert row[f"{name}_max_diff"] < 1e-4, (name, row)
