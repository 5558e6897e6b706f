"""`jaxspec bench verify` runs end to end on CPU at tiny sizes and writes its JSON."""

import json
import os
import subprocess
import sys

import pytest

from jaxspec.cli import main

pytestmark = pytest.mark.slow


def test_bench_verify_smoke(tmp_path):
    out = tmp_path / "verify.json"
    assert (
        main(
            [
                "bench",
                "verify",
                "--vocab",
                "512",
                "--batch",
                "2",
                "--nodes",
                "4",
                "--iters",
                "4",  # the loop's own time is taken off: one iteration is too few on a busy machine
                "--tile",
                "128",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    [row] = result["rows"]
    assert (row["batch"], row["nodes"], row["vocab"]) == (2, 4, 512)
    assert row["kernel_ms"] > 0 and row["reference_ms"] > 0 and row["agree"] == 1.0
    assert row["kernel_latency_ms"] > 0 and row["latency_speedup"] > 0
    assert result["baseline"]["copy_GBps"] > 0 and result["baseline"]["kernel"] == "triton-interpret"


def test_bench_verify_profile_charges_the_traced_kernels(tmp_path):
    # --profile sets XLA flags before JAX starts, hence its own process
    out = tmp_path / "verify.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxspec.cli",
            "bench",
            "verify",
            "--vocab",
            "512",
            "--batch",
            "2",
            "--nodes",
            "4",
            "--iters",
            "1",
            "--tile",
            "128",
            "--profile",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "XLA_FLAGS": ""},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    [row] = result["rows"]
    assert result["baseline"]["command_buffers"] is False
    for impl, program in (("kernel", "jit(verify_triton)"), ("reference", "jit(verify_reference)")):
        assert row[f"{impl}_launches"] > 0 and row[f"{impl}_traced_ms"] > 0
        assert row[f"{impl}_top"] and all(k["op_name"].startswith(program) for k in row[f"{impl}_top"] if k["op_name"])
    # the interpreted node-statistics kernel's callback carries its name; it is part of the kernel path's total
    assert 0 < row["kernel_node_stats_ms"] <= row["kernel_traced_ms"]
    assert "device time per call by kernel" in proc.stdout


def test_bench_verify_times_several_shapes(tmp_path):
    """Each shape's loop donates its inputs (the key too): the next shape makes its own."""
    out = tmp_path / "verify.json"
    assert (
        main(
            [
                "bench",
                "verify",
                "--vocab",
                "256",
                "--batch",
                "2",
                "3",
                "--nodes",
                "2",
                "--iters",
                "2",
                "--tile",
                "128",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["nodes"]) for r in rows] == [(2, 2), (3, 2)]
    assert all(r["kernel_ms"] is not None and r["loop_ms"] > 0 and r["agree"] == 1.0 for r in rows)


def test_bench_verify_stochastic_drafts(tmp_path):
    """--stochastic times the stochastic-draft kernel against the reference's sampled-draft path."""
    out = tmp_path / "verify.json"
    assert (
        main(
            [
                "bench",
                "verify",
                "--stochastic",
                "--vocab",
                "300",
                "--batch",
                "3",
                "--nodes",
                "4",
                "--iters",
                "1",
                "--tile",
                "64",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    [row] = result["rows"]
    assert row["kernel_ms"] > 0 and row["reference_ms"] > 0 and row["agree"] == 1.0
    assert result["baseline"]["kernel"] == "stochastic-triton-interpret" and result["baseline"]["draft_probs"]
