"""`jaxspec bench projections` runs end to end on the CPU (the kernel in Triton's interpreter,
float32) and reports, for each projection of a step and each row count, XLA's and the kernel's
times, the kernel's output equal to XLA's, and with --sweep the best tiles it timed."""

import json
import os
import subprocess
import sys

import pytest

from jaxspec.cli import main
from tests.bench.test_spec_cost import TINY

pytest.importorskip("triton", reason="the kernel runs in Triton's interpreter (the test extra has triton)")
pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")


def test_bench_projections_smoke(tmp_path, monkeypatch):
    model, out = tmp_path / "tiny.json", tmp_path / "projections.json"
    model.write_text(json.dumps(TINY | {"tie_word_embeddings": True}))
    monkeypatch.setattr(
        "jaxspec.bench.projections.SWEEP",
        {"block_n": (16, 32), "block_k": (16,), "split_k": (1, 2), "num_warps": (4,), "num_stages": (2,)},
    )
    argv = ["bench", "projections", "--model", str(model), "--rows", "1", "5", "--dtype", "float32"]
    argv += ["--iters", "10", "--repeats", "3", "--copy-bytes", str(1 << 20), "--interpret", "--out", str(out)]
    assert main([*argv, "--only", "o", "lm_head"]) == 0
    result = json.loads(out.read_text())
    assert [(r["projection"], r["rows"]) for r in result["rows"]] == [
        ("o", 1),
        ("o", 5),
        ("lm_head", 1),
        ("lm_head", 5),
    ]
    for row in result["rows"]:
        assert row["xla_us"] > 0 and row["kernel_us"] > 0 and row["max_rel_diff"] < 1e-5, row
        assert row["speedup"] == pytest.approx(row["xla_us"] / row["kernel_us"])
    assert main([*argv, "--only", "gate_up_swiglu", "--rows", "3", "--sweep"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["best_tiles"] in {f"16x{n}x16x4x2x{split}" for n in (16, 32) for split in (1, 2)} and row["best_us"] > 0
    assert row["swept_us"][row["best_tiles"]] == pytest.approx(row["best_us"], abs=1e-3)
    first = {f"16x{n}x16x4x4x{split}" for n in (16, 32) for split in (1, 2)}  # at 4 warps, 4 stages
    assert set(row["swept_us"]) == first | {row["best_tiles"]}
    assert row["max_rel_diff"] < 1e-5


def test_bench_projections_times_a_sparse_models_experts(tmp_path):
    """A mixture-of-experts config: the experts' gate/up with the SwiGLU and their weighted down
    projection, the grouped matmuls against the expert kernel with equal outputs, the roofline over
    the touched experts' bytes (fewer experts than all at one token)."""
    model, out = tmp_path / "tiny_moe.json", tmp_path / "projections.json"
    moe = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8}
    model.write_text(json.dumps(TINY | moe | {"num_experts_per_tok": 2, "moe_intermediate_size": 32}))
    argv = ["bench", "projections", "--model", str(model), "--rows", "1", "6", "--dtype", "float32"]
    argv += ["--iters", "10", "--repeats", "3", "--copy-bytes", str(1 << 20), "--interpret", "--out", str(out)]
    assert main([*argv, "--only", "experts_gate_up_swiglu", "experts_down", "gate_up_swiglu"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["projection"], r["rows"]) for r in rows] == [
        ("experts_gate_up_swiglu", 1),
        ("experts_gate_up_swiglu", 6),
        ("experts_down", 1),
        ("experts_down", 6),
    ]
    for row in rows:
        assert row["xla_us"] > 0 and row["kernel_us"] > 0 and row["max_rel_diff"] < 1e-5, row
        expert_mb = 64 * 32 * 4 * (2 if row["projection"] == "experts_gate_up_swiglu" else 1) / 1e6
        assert row["weight_mb"] == pytest.approx(row["experts_touched"] * expert_mb)
    assert [r["experts_touched"] for r in rows if r["rows"] == 1] == [2, 2]


def test_bench_projections_profile_times_calls_by_their_traced_kernels(tmp_path):
    """--profile (its own process: it sets XLA's flags before JAX starts) gives both forms a device
    time from the trace and says so in the results."""
    model, out = tmp_path / "tiny.json", tmp_path / "projections.json"
    model.write_text(json.dumps(TINY))
    argv = [sys.executable, "-m", "jaxspec.cli", "bench", "projections", "--model", str(model), "--rows", "2"]
    argv += ["--dtype", "float32", "--copy-bytes", str(1 << 20), "--interpret", "--profile", "--out", str(out)]
    argv += ["--only", "down", "o"]
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "XLA_FLAGS": ""}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["baseline"]["timing"] == "device time in a profiler trace"
    assert [row["projection"] for row in result["rows"]] == ["o", "down"]
    for row in result["rows"]:
        assert row["xla_us"] > 0 and row["kernel_us"] > 0 and row["max_rel_diff"] < 1e-5, row
