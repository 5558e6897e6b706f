"""`jaxspec bench mlp`: the MLP's two forms compute the layer's MLP, and the benchmark runs end to end
on the CPU."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.bench.mlp import APART, FUSED, mlp_weights, one_gemm, tokamax_glu, two_gemms
from jaxspec.cli import main
from tests.bench.test_spec_cost import TINY


def reference_mlp(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    h = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    g = h @ gate
    return x + (g / (1.0 + np.exp(-g)) * (h @ up)) @ down


def test_both_forms_are_the_layers_mlp_in_float32():
    weights = {k: v.astype(jnp.float32) for k, v in mlp_weights(16, 24, seed=3).items()}
    x = jax.random.normal(jax.random.key(0), (5, 16), jnp.float32)
    expected = reference_mlp(*(np.asarray(a, np.float64) for a in (x, weights["gate"], weights["up"], weights["down"])))
    apart = two_gemms(x, *(weights[k] for k in APART))
    fused = one_gemm(x, *(weights[k] for k in FUSED))
    np.testing.assert_allclose(apart, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fused, expected, rtol=1e-5, atol=1e-5)
    # gate_up[:, 0] is gate, [:, 1] up: with the two swapped the MLP differs
    swapped = jnp.flip(weights["gate_up"], axis=1)
    assert np.max(np.abs(one_gemm(x, weights["norm"], swapped, weights["down"]) - expected)) > 1e-2


def test_bench_mlp_smoke(tmp_path):
    model, out = tmp_path / "tiny.json", tmp_path / "mlp.json"
    model.write_text(json.dumps(TINY))
    argv = ["bench", "mlp", "--model", str(model), "--rows", "1", "4", "--iters", "2", "--repeats", "1"]
    assert main([*argv, "--copy-bytes", str(1 << 20), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["baseline"]["copy_bytes_per_second"] > 0
    rows = result["rows"]
    assert [(r["model"], r["rows"]) for r in rows] == [("tiny", 1), ("tiny", 4)]
    for row in rows:
        assert row["two_gemms_ms"] > 0 and row["one_gemm_ms"] > 0
        assert row["fused_speedup"] == row["two_gemms_ms"] / row["one_gemm_ms"]
        assert row["max_abs_diff"] < 2.0**-4  # bf16 outputs of O(1), the same products summed apart
        for form in ("two_gemms", "one_gemm"):  # tiny weights sit in the CPU's cache: either a fraction or an error row
            fraction = row[f"{form}_roofline"]
            assert (fraction is None and "above 1.0" in row["error"]) or 0 < fraction <= 1


def test_bench_mlp_tokamax_rows(tmp_path):
    pytest.importorskip("tokamax", reason="tokamax is not a test dependency")
    model, out = tmp_path / "tiny.json", tmp_path / "mlp.json"
    model.write_text(json.dumps(TINY))
    argv = ["bench", "mlp", "--model", str(model), "--rows", "4", "--iters", "2", "--repeats", "1"]
    assert main([*argv, "--copy-bytes", str(1 << 20), "--tokamax", "xla", "triton", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tokamax_xla_ms"] > 0 and row["tokamax_xla_diff"] < 2.0**-4  # the same MLP, bf16
    assert row["tokamax_xla_speedup"] == row["one_gemm_ms"] / row["tokamax_xla_ms"]
    if jax.default_backend() == "cpu":  # tokamax's Triton kernel is for GPUs: the row says so
        assert "tokamax_triton_ms" not in row and row["tokamax_triton_error"].split(":")[0].endswith("Error")


def test_tokamax_glu_computes_the_models_mlp():
    pytest.importorskip("tokamax", reason="tokamax is not a test dependency")
    weights = mlp_weights(TINY["hidden_size"], TINY["intermediate_size"])
    x = jax.random.normal(jax.random.key(3), (4, TINY["hidden_size"]), jnp.bfloat16)
    args = tuple(weights[k] for k in FUSED)
    want = np.asarray(one_gemm(x, *args), np.float32)
    np.testing.assert_allclose(np.asarray(tokamax_glu("xla")(x, *args), np.float32), want, atol=2.0**-4)
    swapped = (args[0], jnp.flip(args[1], axis=1), args[2])  # gate and up swapped: a different MLP
    assert np.max(np.abs(np.asarray(tokamax_glu("xla")(x, *swapped), np.float32) - want)) > 1e-2
