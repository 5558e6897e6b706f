"""`jaxspec bench decode` bytes per step on mixture-of-experts shapes, and a CPU smoke run."""

import json

import jax
import numpy as np
import pytest

from jaxspec.bench.decode import expected_experts, weight_read_bytes
from jaxspec.cli import main
from jaxspec.models import ModelConfig
from jaxspec.models.moe import distinct_experts, expected_distinct_experts

TINY_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 32,
    "mlp_only_layers": [1],
    "norm_topk_prob": True,
}


def test_qwen3_30b_a3b_shapes():
    cfg = ModelConfig.from_json("configs/models/qwen3-30b-a3b.json")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok) == (48, 2048, 128, 8)
    assert cfg.sparse_layers == tuple(range(48))
    assert round(cfg.num_params() / 1e9, 1) == 30.5 and round(cfg.num_params(active=True) / 1e9, 1) == 3.4


def test_weight_read_bytes_counts_the_experts_a_step_touches():
    cfg = ModelConfig.from_hf(TINY_MOE)
    embed = cfg.vocab_size * cfg.hidden_size
    # One token reads its k experts per sparse layer; very many tokens read all experts.
    assert weight_read_bytes(cfg, 2, 1) == pytest.approx((cfg.num_params(active=True) - embed) * 2)
    assert weight_read_bytes(cfg, 2, 10_000) == pytest.approx((cfg.num_params() - embed) * 2)
    assert expected_experts(cfg, 4) == pytest.approx(16 * (1 - (12 / 16) ** 4))
    dense = ModelConfig(
        family="qwen3",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    assert weight_read_bytes(dense, 2, 64) == (dense.num_params() - 128 * 64) * 2


@pytest.mark.parametrize("tokens, window", [(1, 1), (3, 1), (4, 2), (8, 4)])
def test_router_on_random_logits_touches_the_expected_experts(tokens, window):
    """iid logits make every top-k set uniform: the measured count approaches E (1 - (1 - k/E)^tokens)."""
    logits = jax.random.normal(jax.random.key(tokens), (2, tokens // window, 4000 * window, 16))
    measured = np.asarray(distinct_experts(logits, 4, window))
    assert measured.shape == (2,)
    np.testing.assert_allclose(measured, expected_distinct_experts(16, 4, tokens), rtol=0.02)


def test_distinct_experts_counts_a_window_once():
    logits = np.zeros((1, 2, 4, 6), np.float32)
    logits[0, 0, :, 0] = logits[0, 1, :, 1] = 1.0  # row 0 always picks expert 0, row 1 expert 1
    logits[0, 0, 3, 5] = 2.0  # except row 0 at position 3: expert 5
    np.testing.assert_allclose(distinct_experts(logits, 1), [(2 + 2 + 2 + 2) / 4])
    np.testing.assert_allclose(distinct_experts(logits, 1, window=2), [(2 + 3) / 2])
    with pytest.raises(ValueError, match="4 positions do not split into windows of 3"):
        distinct_experts(logits, 1, window=3)


def test_bench_decode_smoke_on_a_moe_policy(tmp_path, capsys):
    model = tmp_path / "tiny_moe.json"
    model.write_text(json.dumps(TINY_MOE))
    out = tmp_path / "decode.json"
    # 96 new tokens, median of 5: on a busy 2-core runner 32 tokens x 3 took as long as 1 token
    # (the step is the difference of two wall times, and the bench makes an unresolved one an error row)
    assert (
        main(
            [
                "bench",
                "decode",
                "--model",
                str(model),
                "--batch",
                "2",
                "--prompt",
                "16",
                "--new",
                "96",
                "--iters",
                "5",
                "--peer",
                "none",
                "--copy-bytes",
                "1048576",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    [row] = result["rows"]
    cfg = ModelConfig.from_hf(TINY_MOE)
    assert row["experts_expected"] == pytest.approx(expected_experts(cfg, 2))
    assert 4 <= row["experts_measured"] <= 8  # 2 tokens pick 4 experts each
    assert row["bytes_per_step_gb"] * 1e9 > weight_read_bytes(cfg, 2, 2)  # + the KV cache (CPU timings: noise)
    assert result["baseline"]["active_params"] == cfg.num_params(active=True)
    assert "experts_measured" in capsys.readouterr().out


def test_a_batch_out_of_device_memory_is_an_error_row_and_the_others_run(tmp_path, monkeypatch):
    import jax

    from jaxspec.bench import decode

    real = decode.run_jaxspec

    def out_of_memory_at_4(cfg, params, batch, *args):
        if batch == 4:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 128.02GiB")
        return real(cfg, params, batch, *args)

    monkeypatch.setattr(decode, "run_jaxspec", out_of_memory_at_4)
    model = tmp_path / "tiny_moe.json"
    model.write_text(json.dumps(TINY_MOE))
    out = tmp_path / "decode.json"
    # 32 new tokens, 3 runs each: the decode steps' time stands well clear of the two runs' noise
    assert (
        main(
            [
                "bench",
                "decode",
                "--model",
                str(model),
                "--batch",
                "4",
                "2",
                "--prompt",
                "16",
                "--new",
                "32",
                "--iters",
                "3",
                "--peer",
                "none",
                "--copy-bytes",
                "1048576",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert rows[0] == {
        "batch": 4,
        "error": "out of device memory: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 128.02GiB",
    }
    assert rows[1]["batch"] == 2 and rows[1]["step_ms"] > 0


def test_a_step_time_lost_in_the_noise_is_an_error_row(tmp_path, monkeypatch):
    """The step time is the difference of two wall times (N tokens, 1 token); when noise makes it
    non-positive the batch becomes an error row, not a negative or infinite rate."""
    from jaxspec.bench import decode

    monkeypatch.setattr(decode, "run_jaxspec", lambda *args: {"step_ms": -0.36, "prefill_ms": 5.0, "total_s": 0.0046})
    model = tmp_path / "tiny_moe.json"
    model.write_text(json.dumps(TINY_MOE))
    out = tmp_path / "decode.json"
    assert (
        main(
            [
                "bench",
                "decode",
                "--model",
                str(model),
                "--batch",
                "2",
                "--prompt",
                "16",
                "--new",
                "4",
                "--iters",
                "1",
                "--peer",
                "none",
                "--copy-bytes",
                "1048576",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["batch"] == 2 and row["error"].startswith("decode step not resolved: 4 new tokens took 0.0046 s")
    assert "raise --new or --iters" in row["error"]
