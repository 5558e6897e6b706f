import jax.numpy as jnp
import pytest

from jaxspec.models import ModelConfig, cache_bytes
from jaxspec.rollout import rollout_memory_bytes
from jaxspec.rollout.memory import PREFILL_CHUNK, check_fits, prefill_chunks

CFG = ModelConfig(
    family="qwen3",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
)


def test_memory_counts_bucketed_cache_and_step_buffers():
    got = rollout_memory_bytes(
        CFG, batch=64, prompt_len=300, max_new_tokens=1000, cache_dtype=jnp.bfloat16, num_distinct=4
    )
    cache = cache_bytes(CFG, 64, 512 + 1000, jnp.bfloat16)  # prompt bucket 512
    step = 4 * 64 * (4 * 151936 + 2 * 32 * 1512 + 2 * 12288) + 2 * 4 * 64 * 1000
    assert got == max(
        cache + step, cache + cache_bytes(CFG, 4, 512, jnp.bfloat16) + 4 * 4 * 512 * (2 * 32 * 512 + 2 * 12288 + 4096)
    )
    assert got == rollout_memory_bytes(CFG, 64, 512, 1000, jnp.bfloat16, 4)  # same bucket
    assert got < rollout_memory_bytes(CFG, 64, 513, 1000, jnp.bfloat16, 4)
    assert rollout_memory_bytes(CFG, 64, 300, 1000, jnp.float32, 4) > got


def test_prefill_chunks():
    assert prefill_chunks(1) == (1, 1)
    assert prefill_chunks(PREFILL_CHUNK) == (PREFILL_CHUNK, 1)
    assert prefill_chunks(PREFILL_CHUNK + 1) == (PREFILL_CHUNK, 2)  # the second chunk is mostly filler
    assert prefill_chunks(8 * PREFILL_CHUNK) == (PREFILL_CHUNK, 8)


def test_prefill_activations_are_those_of_one_chunk():
    # U = count_bucket(C + 8, C + 16) = C + 16 distinct rows, prefilled as 2 chunks of C (2C with filler).
    c = PREFILL_CHUNK
    got = rollout_memory_bytes(
        CFG, batch=c + 16, prompt_len=2048, max_new_tokens=16, cache_dtype=jnp.bfloat16, num_distinct=c + 8
    )
    prefill = (
        cache_bytes(CFG, c + 16, 2048 + 16, jnp.bfloat16)
        + cache_bytes(CFG, 2 * c, 2048, jnp.bfloat16)
        + 4 * c * 2048 * (2 * 32 * 2048 + 2 * 12288 + 4096)
    )
    assert got == prefill


def test_qwen3_8b_batch_256_fits_an_h200():
    # 256 distinct prompts of 512 tokens, 1024 new: prefilling all 256 at once would need 109.5 GB,
    # more than the 96 GB an H200 has free; in chunks, the distinct and batch caches dominate.
    got = rollout_memory_bytes(CFG, 256, 512, 1024, jnp.bfloat16, 256)
    caches = cache_bytes(CFG, 256, 512 + 1024, jnp.bfloat16) + cache_bytes(CFG, 256, 512, jnp.bfloat16)
    assert got == caches + 4 * PREFILL_CHUNK * 512 * (2 * 32 * 512 + 2 * 12288 + 4096)
    assert got < 96 * 10**9


def test_memory_rejects_empty_shapes():
    with pytest.raises(ValueError, match="batch=0"):
        rollout_memory_bytes(CFG, 0, 10, 10)


def test_check_fits():
    kw = dict(batch=64, prompt_len=300, max_new_tokens=1000)
    check_fits(10**12, None, **kw)  # CPU reports no limit: nothing to check
    check_fits(10**12, {"bytes_in_use": 5}, **kw)
    check_fits(800, {"bytes_limit": 1000, "bytes_in_use": 200}, **kw)
    with pytest.raises(
        ValueError,
        match=r"batch=64, prompt length=300 \(bucket 512\), max_new_tokens=1000 "
        r"needs 801 bytes.*only 800 bytes free \(bytes_limit 1000\)",
    ):
        check_fits(801, {"bytes_limit": 1000, "bytes_in_use": 200}, **kw)
    with pytest.raises(
        ValueError,
        match=r"max_new_tokens=1000 on slots=16 \(kv_pages=96\) needs 801 bytes.*lower slots or kv_pages "
        r"\(slots='auto' picks the most slots that fit\), or max_new_tokens",
    ):
        check_fits(801, {"bytes_limit": 1000, "bytes_in_use": 200}, **kw, slots=16, kv_pages=96)
