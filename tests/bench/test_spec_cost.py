"""`jaxspec bench spec-cost` runs end to end on CPU at tiny sizes; its projection follows its own timings."""

import json

import pytest

from jaxspec.bench import spec_cost
from jaxspec.cli import main

TINY = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
# k=1 at the benchmarked batch (preferred over batch 8); k=3 only at another batch (the fallback);
# the rest is not an "eagle3 chain k=K" row with K <= 7 and is ignored.
ACCEPTANCE = [
    {"batch": 2, "config": "ar", "acceptance_length": 1.0},
    {"batch": 8, "config": "eagle3 chain k=1", "acceptance_length": 1.9},
    {"batch": 2, "config": "eagle3 chain k=1", "acceptance_length": 1.6},
    {"batch": 8, "config": "eagle3 chain k=3", "acceptance_length": 2.5},
    {"batch": 2, "config": "eagle3-ood chain k=3", "acceptance_length": 1.2},
    {"batch": 2, "config": "eagle3 chain k=3 stochastic", "acceptance_length": 2.4},
    {"batch": 2, "config": "eagle3 chain k=9", "acceptance_length": 4.0},
]


def test_bench_spec_cost_smoke(tmp_path, capsys):
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(TINY))
    acceptance = tmp_path / "spec.json"
    acceptance.write_text(json.dumps({"benchmark": "spec", "rows": ACCEPTANCE}))
    out = tmp_path / "spec_cost.json"
    assert (
        main(
            [
                "bench",
                "spec-cost",
                "--model",
                str(model),
                "--batch",
                "2",
                "--context",
                "16",
                "--nodes",
                "2",
                "4",
                "--draft-vocab",
                "32",
                "--iters",
                "2",
                "--acceptance",
                str(acceptance),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "PROJECTION" in printed
    result = json.loads(out.read_text())
    assert result["benchmark"] == "spec-cost" and result["device"].startswith("cpu")
    assert result["baseline"]["nodes"] == [2, 4] and result["baseline"]["tree_verify"] == "reference"
    rows = {kind: [r for r in result["rows"] if r["kind"] == kind] for kind in ("step", "verify", "projection")}
    assert len(result["rows"]) == sum(map(len, rows.values()))  # nothing skipped on CPU

    [step] = rows["step"]
    assert (step["model"], step["batch"], step["context"]) == ("tiny", 2, 16)
    assert min(step["decode_ms"], step["draft_ms"], step["fuse_ms"]) > 0
    verify = {r["nodes"]: r for r in rows["verify"]}
    assert sorted(verify) == [2, 4]
    for r in verify.values():
        assert r["verify_ms"] > 0 and r["kernel_ms"] > 0
        assert r["verify_over_decode"] == pytest.approx(r["verify_ms"] / step["decode_ms"])
    assert step["draft_token_cost"] == pytest.approx(step["draft_ms"] / step["decode_ms"])
    over = [(n - 1, verify[n]["verify_over_decode"] - 1) for n in (2, 4)]
    slope = sum(x * y for x, y in over) / sum(x * x for x, _ in over)
    assert step["verify_token_cost"] == pytest.approx(max(slope, 0.0))
    assert f"spec.verify_token_cost: [[2, {step['verify_token_cost']:.3g}]]" in printed

    proj = {r["k"]: r for r in rows["projection"]}
    assert sorted(proj) == [1, 3]
    assert [(proj[k]["acceptance_length"], proj[k]["acceptance_batch"]) for k in (1, 3)] == [(1.6, 2), (2.5, 8)]
    for k, r in proj.items():
        tau, cost = r["acceptance_length"], k * step["draft_ms"] + step["fuse_ms"] + verify[k + 1]["verify_ms"]
        assert r["decode_ms"] == step["decode_ms"]
        assert r["step_ms"] == pytest.approx(cost)
        assert r["ms_per_token"] == pytest.approx(cost / tau)
        assert r["speedup"] == pytest.approx(step["decode_ms"] * tau / cost)
        assert r["efficiency"] == pytest.approx(step["decode_ms"] / cost)


def test_bench_spec_cost_compiles_its_pieces_as_the_rollout_loops_do(tmp_path, monkeypatch, capsys):
    """The policy's and head's steps take the rollout loops' compiler options for the model (split-K
    or not): an option XLA does not know makes the first piece's compilation fail, and with XLA's
    choice (no options) the same model runs and records it."""
    from jaxspec.rollout import compiler_options

    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(TINY))
    argv = ["bench", "spec-cost", "--model", str(model), "--batch", "2", "--context", "16", "--nodes", "2"]
    argv += ["--draft-vocab", "32", "--iters", "1"]
    monkeypatch.setattr(compiler_options, "NO_SPLIT_K", {"xla_no_such_option_here": 1})
    monkeypatch.setenv(compiler_options.SPLIT_K_ENV, "off")
    assert main(argv) != 0
    assert "No such compile option: 'xla_no_such_option_here'" in capsys.readouterr().err
    monkeypatch.setenv(compiler_options.SPLIT_K_ENV, "xla")
    assert main([*argv, "--out", str(tmp_path / "out.json")]) == 0
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert {r["split_k"] for r in rows if r["kind"] == "step"} == {True}


def test_bench_spec_cost_skips_what_does_not_fit(tmp_path, monkeypatch, capsys):
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(TINY))
    monkeypatch.setattr(spec_cost, "device_memory_stats", lambda: {"bytes_limit": 1 << 14, "bytes_in_use": 0})
    out = tmp_path / "spec_cost.json"
    assert (
        main(
            [
                "bench",
                "spec-cost",
                "--model",
                str(model),
                "--batch",
                "1",
                "64",
                "--context",
                "16",
                "--nodes",
                "2",
                "--draft-vocab",
                "32",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "skipped" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kind"], r["batch"]) for r in rows] == [("skipped", 1), ("skipped", 64)]
    assert "bytes free" in rows[0]["reason"]


def test_bench_spec_cost_reports_experts_touched_on_a_moe_policy(tmp_path):
    model = tmp_path / "tiny_moe.json"
    model.write_text(
        json.dumps(
            TINY
            | {
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
            }
        )
    )
    out = tmp_path / "spec_cost.json"
    assert (
        main(
            [
                "bench",
                "spec-cost",
                "--model",
                str(model),
                "--batch",
                "2",
                "--context",
                "16",
                "--nodes",
                "4",
                "--draft-vocab",
                "32",
                "--iters",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    [step] = [r for r in rows if r["kind"] == "step"]
    [verify] = [r for r in rows if r["kind"] == "verify"]
    assert step["experts_decode"] == pytest.approx(8 * (1 - (6 / 8) ** 2))  # 2 rows x 1 token
    assert verify["experts_verify"] == pytest.approx(8 * (1 - (6 / 8) ** 8))  # 2 rows x 4 nodes


def test_token_costs_are_the_slope_of_the_verification_cost():
    from jaxspec.bench.spec_cost import token_costs

    # verify(N) = decode * (1 + 0.25 (N - 1)) exactly: the slope is 0.25; a draft step of half a decode: 0.5
    costs = token_costs(2.0, {1: 2.0, 2: 2.5, 4: 3.5, 8: 5.5}, 1.0)
    assert costs == pytest.approx({"verify_token_cost": 0.25, "draft_token_cost": 0.5})
    assert token_costs(2.0, {2: 1.5}, 0.0)["verify_token_cost"] == 0.0  # cheaper than a decode: no cost
