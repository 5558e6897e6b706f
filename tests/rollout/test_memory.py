import jax.numpy as jnp
import pytest

from jaxspec.models import ModelConfig, cache_bytes
from jaxspec.rollout import rollout_memory_bytes
from jaxspec.rollout.memory import check_fits

CFG = ModelConfig(family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                  num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960)


def test_memory_counts_bucketed_cache_and_step_buffers():
    got = rollout_memory_bytes(CFG, batch=64, prompt_len=300, max_new_tokens=1000, cache_dtype=jnp.bfloat16,
                               num_distinct=4)
    cache = cache_bytes(CFG, 64, 512 + 1000, jnp.bfloat16)  # prompt bucket 512
    step = 4 * 64 * (4 * 151936 + 2 * 32 * 1512 + 2 * 12288) + 2 * 4 * 64 * 1000
    assert got == max(cache + step, cache + cache_bytes(CFG, 4, 512, jnp.bfloat16)
                      + 4 * 4 * 512 * (2 * 32 * 512 + 2 * 12288 + 4096))
    assert got == rollout_memory_bytes(CFG, 64, 512, 1000, jnp.bfloat16, 4)  # same bucket
    assert got < rollout_memory_bytes(CFG, 64, 513, 1000, jnp.bfloat16, 4)
    assert rollout_memory_bytes(CFG, 64, 300, 1000, jnp.float32, 4) > got


def test_memory_rejects_empty_shapes():
    with pytest.raises(ValueError, match="batch=0"):
        rollout_memory_bytes(CFG, 0, 10, 10)


def test_check_fits():
    kw = dict(batch=64, prompt_len=300, max_new_tokens=1000)
    check_fits(10**12, None, **kw)  # CPU reports no limit: nothing to check
    check_fits(10**12, {"bytes_in_use": 5}, **kw)
    check_fits(800, {"bytes_limit": 1000, "bytes_in_use": 200}, **kw)
    with pytest.raises(ValueError, match=r"batch=64, prompt length=300 \(bucket 512\), max_new_tokens=1000 "
                                         r"needs 801 bytes.*only 800 bytes free \(bytes_limit 1000\)"):
        check_fits(801, {"bytes_limit": 1000, "bytes_in_use": 200}, **kw)
