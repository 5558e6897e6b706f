"""`jaxspec bench verify` runs end to end on CPU at tiny sizes and writes its JSON."""

import json

from jaxspec.cli import main


def test_bench_verify_smoke(tmp_path):
    out = tmp_path / "verify.json"
    assert main(["bench", "verify", "--vocab", "512", "--batch", "2", "--nodes", "4", "--iters", "1",
                 "--tile", "128", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    [row] = result["rows"]
    assert (row["batch"], row["nodes"], row["vocab"]) == (2, 4, 512)
    assert row["kernel_ms"] > 0 and row["reference_ms"] > 0 and row["agree"] == 1.0
    assert row["kernel_latency_ms"] > 0 and row["latency_speedup"] > 0
    assert result["baseline"]["copy_GBps"] > 0 and result["baseline"]["kernel"] == "pallas-interpret"
