"""The params pytree: fusing a layer's q and kv into one leaf keeps every weight where the
attention reads it (the same logits), and its layout is the documented one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import ModelConfig, extend, forward, init_cache, init_params
from jaxspec.models.params import fuse_qkv

# 6 query heads over 2 KV heads (G = 3), with q, k and v biases: every part of the projection
CFG = ModelConfig(
    family="qwen2",
    vocab_size=61,
    hidden_size=24,
    intermediate_size=40,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    attention_bias=True,
)


@pytest.fixture(scope="module")
def params():
    params = init_params(CFG, jax.random.key(0), std=0.2)
    # non-zero biases and norms, so that a bias or norm read from the wrong head shows
    key = iter(jax.random.split(jax.random.key(1), 64))
    return jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(key), x.shape) if x.ndim <= 2 else x, params)


def test_fused_layout_is_each_kv_heads_queries_then_k_then_v(params):
    layer = params["layers"][0]
    fused = fuse_qkv(params)["layers"][0]
    group = CFG.num_heads // CFG.num_kv_heads
    assert fused["qkv"].shape == (CFG.hidden_size, CFG.num_kv_heads, group + 2, CFG.head_dim)
    assert "q" not in fused and "kv" not in fused
    for j in range(CFG.num_kv_heads):
        for g in range(group):
            np.testing.assert_array_equal(fused["qkv"][:, j, g], layer["q"][:, j * group + g])
        np.testing.assert_array_equal(fused["qkv"][:, j, group], layer["kv"][:, 0, j])
        np.testing.assert_array_equal(fused["qkv"][:, j, group + 1], layer["kv"][:, 1, j])
        for g in range(group):
            np.testing.assert_array_equal(fused["qkv_bias"][j, g], layer["q_bias"][j * group + g])
        np.testing.assert_array_equal(fused["qkv_bias"][j, group], layer["k_bias"][j])
        np.testing.assert_array_equal(fused["qkv_bias"][j, group + 1], layer["v_bias"][j])
    assert not {"q", "kv", "q_bias", "k_bias", "v_bias"} & fused.keys()
    assert all(fused[k] is layer[k] for k in fused if k not in ("qkv", "qkv_bias"))
    assert fuse_qkv({"layers": [fused]})["layers"][0]["qkv"] is fused["qkv"]  # a fused layer is kept


def test_fused_params_give_the_same_logits(params):
    tokens = jax.random.randint(jax.random.key(2), (3, 9), 0, CFG.vocab_size)
    fused = fuse_qkv(params)
    np.testing.assert_allclose(forward(CFG, fused, tokens), forward(CFG, params, tokens), rtol=1e-5, atol=1e-5)
    cache = init_cache(CFG, 3, 16)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (3, 9))
    lens = jnp.zeros((3,), jnp.int32)
    want, _, want_cache = extend(CFG, params, cache, tokens, positions, lens)
    got, _, got_cache = extend(CFG, fused, cache, tokens, positions, lens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_cache.k[1], want_cache.k[1], rtol=1e-5, atol=1e-5)


def test_a_misplaced_head_changes_the_logits(params):
    """The control: the same leaf with two query heads of one KV head swapped gives other logits,
    so the comparison above sees a layout mistake."""
    tokens = jax.random.randint(jax.random.key(2), (3, 9), 0, CFG.vocab_size)
    fused = fuse_qkv(params)
    layer = dict(fused["layers"][0])
    layer["qkv"] = layer["qkv"][:, :, jnp.asarray([1, 0, 2, 3, 4])]
    swapped = {**fused, "layers": [layer, *fused["layers"][1:]]}
    assert np.abs(forward(CFG, swapped, tokens) - forward(CFG, params, tokens)).max() > 1e-3
    layer["qkv"] = fused["layers"][0]["qkv"]
    layer["qkv_bias"] = layer["qkv_bias"][:, jnp.asarray([0, 1, 2, 4, 3])]  # k's bias and v's swapped
    assert np.abs(forward(CFG, swapped, tokens) - forward(CFG, params, tokens)).max() > 1e-3
