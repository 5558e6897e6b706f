"""`jaxspec bench attention` runs end to end on CPU (the Triton kernel in its interpreter) and reports
the kernel's agreement with the dense path, on the dense cache and (--paged) on shuffled pages."""

import importlib.util
import json

import pytest

from jaxspec.cli import main
from tests.bench.test_spec_cost import TINY

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (importlib.util.find_spec("triton") and importlib.util.find_spec("torch")),
        reason="the kernel runs in Triton's interpreter (the test extra has triton and torch)",
    ),
]
ARGS = ["--fill", "0.5", "--iters", "1", "--kernel-impl", "triton-interpret", "--read-bytes", "4096"]


def test_bench_attention_smoke(tmp_path):
    model, out = tmp_path / "tiny.json", tmp_path / "attention.json"
    model.write_text(json.dumps(TINY))
    argv = ["bench", "attention", "--model", str(model), "--batch", "2", "--tokens", "1", "3", "--max-len", "96"]
    assert main([*argv, *ARGS, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["tokens"]) for r in rows] == [(2, 1), (2, 3)]
    for row in rows:
        assert row["max_abs_diff"] < 1e-2  # bf16 inputs; the kernel reads only the filled slots
        assert row["loop_ms"] > 0 and row["kernel_ms"] > 0 and row["roofline"] > 0
        # the dense path's few microseconds on a CPU need not rise above the loop's own time
        assert row["xla_ms"] > 0 or "no more than the empty loop's" in row["error"]


def test_times_are_net_of_the_loops_own(monkeypatch):
    """Each call's time is the loop's time per iteration less that of the same loop around a call
    that does nothing; one no longer than the empty loop's is noise: None, and the row says so."""
    import jax.numpy as jnp

    from jaxspec.bench import attention

    gross_ms = {"fast": 0.5, "slow": 3.0}  # each call returns its time, which the loop's stand-in reports
    monkeypatch.setattr(attention, "empty_loop_seconds", lambda args, calls, repeats: (1e-3, args))
    monkeypatch.setattr(
        attention, "in_loop_seconds", lambda fn, args, calls, repeats: (float(fn(*args, 0)[0]) * 1e-3, args)
    )
    times, outs, errors = attention.time_impls(
        lambda x, impl: x * gross_ms[impl], (jnp.ones(2),), ("slow", "fast"), iters=4
    )
    assert times == {"loop": 1e-3, "slow": pytest.approx(2e-3), "fast": None}
    assert len(errors) == 1 and "attention fast" in errors[0] and "no more than the empty loop's" in errors[0]


def test_tune_times_each_kernel_configuration_in_a_loop():
    from jaxspec.bench.attention import attention_inputs, tune_kernel

    q, k, v, cache_len = attention_inputs(2, 1, 4, 2, 16, 256, 0.5)
    grid = [(16, 4, 2, 1.0), (16, 4, 2, 1.1), (32, 4, 2, 0.5)]
    rows = tune_kernel(q, k, v, cache_len, group=2, interpret=True, grid=grid)
    # 4 splits by default: 1024 programs over 2 x 2 (kv head, row), at least 4 of the 16 blocks each;
    # 1.1 x 4 rounds to the 4 already timed
    assert [(r["block_kv"], r["splits"]) for r in rows] == [(16, 4), (32, 1)]
    assert all(r["ms"] > 0 and r["kernel"] == "triton+merge" for r in rows)


def test_bench_attention_paged_times_the_reference_the_kernel_and_both_pool_layouts(tmp_path):
    model, out = tmp_path / "tiny.json", tmp_path / "attention.json"
    model.write_text(json.dumps(TINY))
    argv = ["bench", "attention", "--model", str(model), "--batch", "2", "--tokens", "2", "--max-len", "64"]
    assert main([*argv, *ARGS, "--paged", "--heads-major", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["paged_xla_ms"] > 0 and row["paged_triton_ms"] > 0 and row["paged_triton_roofline"] > 0
    assert row["paged_triton_max_abs_diff"] < 2.0**-5  # bf16 outputs of O(1)
    # the same pages in either layout, the same arithmetic
    assert row["positions_ms"] > 0 and row["heads_major_ms"] > 0 and row["heads_major_roofline"] > 0
    assert row["heads_major_max_abs_diff"] == 0.0


def test_bench_attention_names_heads_the_kernel_does_not_take(tmp_path, capsys):
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps({**TINY, "head_dim": 24}))
    argv = ["bench", "attention", "--model", str(model), "--batch", "2", "--tokens", "1", "--max-len", "32"]
    assert main([*argv, *ARGS]) == 2
    assert "does not take" in capsys.readouterr().err
