"""`jaxspec bench forward`: training-shaped forward and forward+backward timing, and its packed-rows
comparison (N sequences per row against the same tokens as N times the rows), end to end on the CPU."""

import json

import pytest

from jaxspec.bench.forward import forward_flops_per_token
from jaxspec.cli import main
from jaxspec.models import ModelConfig
from tests.bench.test_spec_cost import TINY


def test_attention_flops_are_those_of_the_sequence():
    cfg = ModelConfig.from_hf(TINY)
    per_layer = cfg.num_heads * cfg.head_dim * 4 * cfg.num_layers
    assert forward_flops_per_token(cfg, 256) - forward_flops_per_token(cfg, 128) == pytest.approx(per_layer * 64)


def test_bench_forward_packed_rows(tmp_path):
    model, out = tmp_path / "tiny.json", tmp_path / "forward.json"
    model.write_text(json.dumps(TINY))
    argv = ["bench", "forward", "--model", str(model), "--batch", "2", "--seq", "64", "--segments", "4"]
    assert main([*argv, "--iters", "1", "--matmul-size", "32", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = [(r["pass"], r["layout"], r["batch"], r["seq"]) for r in result["rows"]]
    assert rows == [
        ("forward", "packed 4", 2, 64),
        ("forward", "rows", 8, 16),
        ("fwd+bwd", "packed 4", 2, 64),
        ("fwd+bwd", "rows", 8, 16),
    ]
    packed = [r for r in result["rows"] if r["layout"] == "packed 4"]
    assert all(r["packed_over_rows"] > 0 for r in packed) and result["baseline"]["segments"] == 4
    with pytest.raises(SystemExit):
        main([*argv[:-1], "3"])  # 3 does not divide 64
