import jax.numpy as jnp
import pytest

from jaxspec.models import ModelConfig, cache_bytes
from jaxspec.rollout import rollout_memory_bytes
from jaxspec.rollout.memory import (
    PREFILL_CHUNK,
    check_fits,
    check_weights_fit,
    prefill_chunks,
    weights_bytes_per_device,
)

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


def test_weights_bytes_per_device_count_the_gathered_copy():
    """The rollout copy of Qwen3-8B in bf16: half the policy per GPU sharded over fsdp=2, the whole
    policy (16.4 GB) gathered; with tensor=2 too, the gathered copy is the policy / tensor but for
    the replicated norms."""
    import jax

    from jaxspec.models import Sharding, init_params, make_mesh, param_shardings
    from jaxspec.models.sharding import gathered_param_shardings

    shapes = jax.eval_shape(lambda: init_params(CFG, jax.random.key(0)))
    whole = sum(x.size for x in jax.tree.leaves(shapes)) * 2
    fsdp = Sharding(make_mesh(data=1, fsdp=2, tensor=1, devices=jax.devices()[:2]))
    sharded = weights_bytes_per_device(shapes, param_shardings(fsdp, shapes), jnp.bfloat16)
    gathered = weights_bytes_per_device(shapes, gathered_param_shardings(fsdp, shapes), jnp.bfloat16)
    assert gathered == whole and 16.3e9 < whole < 16.5e9
    assert whole / 2 <= sharded < whole / 2 + 1e6  # only the norms are not split
    assert weights_bytes_per_device(shapes, param_shardings(fsdp, shapes), jnp.float32) == 2 * sharded

    both = Sharding(make_mesh(data=1, fsdp=2, tensor=2, devices=jax.devices()[:4]))
    tensor_split = (
        sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(shapes) if not path[-1].key.endswith("norm")) * 2
    )
    got = weights_bytes_per_device(shapes, gathered_param_shardings(both, shapes), jnp.bfloat16)
    assert got == tensor_split // 2 + (whole - tensor_split)
    assert got < weights_bytes_per_device(shapes, gathered_param_shardings(fsdp, shapes), jnp.bfloat16)


def test_check_weights_fit():
    check_weights_fit(10**12, None, "rollout.gather_weights")  # CPU: nothing to check
    check_weights_fit(800, {"bytes_limit": 1000, "bytes_in_use": 200}, "rollout.gather_weights")
    with pytest.raises(
        ValueError,
        match=r"rollout.gather_weights: .* needs 0.00 GB per device, but the device has "
        r"only 0.00 GB free .*; set rollout.gather_weights: false",
    ):
        check_weights_fit(801, {"bytes_limit": 1000, "bytes_in_use": 200}, "rollout.gather_weights")
