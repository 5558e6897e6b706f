"""`extend` (prefill, decode, tree verification) against full-sequence `forward`.

`forward` itself is checked against transformers in test_parity.py; here the question is whether
the cached path computes the same function. Every call uses batch 2, a 24-slot cache and blocks of
7 or 1 new tokens, so a handful of compiled programs serve the whole module.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import KVCache, ModelConfig, cache_bytes, extend, forward_hidden, init_cache
from tests.models.hf_reference import random_params, random_tokens, rel_max_err

TOL = 1e-5  # relative to max |logit|, fp32
SEQ = 20  # reference sequence length
MAX_LEN = 24  # cache slots
BLOCK = 7  # new tokens per multi-token extend

extend_jit = jax.jit(extend, static_argnums=0, static_argnames=("hidden_layers",))
forward_jit = jax.jit(forward_hidden, static_argnums=(0, 3))


@pytest.fixture(scope="module")
def model():
    """Qwen3 (q/k norms) with grouped-query attention (4 query heads over 2 KV heads)."""
    cfg = ModelConfig(
        family="qwen3",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        rope_theta=500.0,
    )
    return cfg, random_params(cfg, jax.random.key(1))


def _reference(cfg, params, tokens):
    """Full-sequence (logits [B, SEQ, V], layer outputs [L, B, SEQ, H]) for tokens [B, SEQ]."""
    return forward_jit(cfg, params, jnp.asarray(tokens), tuple(range(cfg.num_layers)))


def _prefill(cfg, params, tokens, lengths):
    """Writes tokens[:, :BLOCK] at slots 0..BLOCK-1; row b's valid prefix is lengths[b] <= BLOCK.

    Slots lengths[b]..BLOCK-1 of row b then hold stale entries that later calls must ignore.
    """
    positions = jnp.broadcast_to(jnp.arange(BLOCK, dtype=jnp.int32), (2, BLOCK))
    logits, _, cache = extend_jit(
        cfg, params, init_cache(cfg, 2, MAX_LEN), jnp.asarray(tokens[:, :BLOCK]), positions, jnp.zeros((2,), jnp.int32)
    )
    return logits, cache, jnp.asarray(lengths, jnp.int32)


def test_prefill_block_and_decode_reproduce_full_forward(model):
    """Rows with different prompt lengths: prefill, a 7-token block, then 1-token decode steps."""
    cfg, params = model
    tokens = random_tokens(0, (2, SEQ), cfg.vocab_size)
    ref, _ = _reference(cfg, params, tokens)
    lengths = np.asarray([4, 7])
    logits, cache, cache_len = _prefill(cfg, params, tokens, lengths)
    for b, n in enumerate(lengths):
        assert rel_max_err(logits[b, :n], ref[b, :n]) < TOL, b

    rows = np.arange(2)[:, None]
    block = lengths[:, None] + np.arange(BLOCK)[None, :]
    logits, _, cache = extend_jit(
        cfg, params, cache, jnp.asarray(tokens[rows, block]), jnp.asarray(block, jnp.int32), cache_len
    )
    assert rel_max_err(logits, ref[rows, block]) < TOL
    cache_len = cache_len + BLOCK

    while int(cache_len.max()) < SEQ:
        pos = np.asarray(cache_len)
        logits, _, cache = extend_jit(
            cfg,
            params,
            cache,
            jnp.asarray(tokens[np.arange(2), pos][:, None]),
            jnp.asarray(pos[:, None], jnp.int32),
            cache_len,
        )
        assert logits.shape == (2, 1, cfg.vocab_size)
        assert rel_max_err(logits[:, 0], ref[np.arange(2), pos]) < TOL, pos
        cache_len = cache_len + 1


# Two trees of BLOCK nodes in topological order (parent index < node index); -1 marks the root.
TREES = [[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 0, 3, 3, 2]]


def _tree_mask_and_depth(parents):
    n = len(parents)
    mask = np.zeros((n, n), bool)
    depth = np.zeros(n, np.int32)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
            depth[i] = depth[p] + 1
    return mask, depth


def test_tree_extension_matches_each_root_to_node_path(model):
    """Each node sees the prefix and its ancestors, at position prefix_len + depth."""
    cfg, params = model
    prefix_lens = np.asarray([6, 3])
    prefix = random_tokens(1, (2, BLOCK), cfg.vocab_size)
    nodes = random_tokens(2, (2, BLOCK), cfg.vocab_size)
    masks, depths = zip(*map(_tree_mask_and_depth, TREES))
    tree_mask, depth = np.stack(masks), np.stack(depths)

    _, cache, cache_len = _prefill(cfg, params, prefix, prefix_lens)
    positions = jnp.asarray(prefix_lens[:, None] + depth, jnp.int32)
    logits, hidden, _ = extend_jit(
        cfg,
        params,
        cache,
        jnp.asarray(nodes),
        positions,
        cache_len,
        tree_mask=jnp.asarray(tree_mask),
        hidden_layers=(1, 0),
    )
    assert hidden.shape == (2, 2, BLOCK, cfg.hidden_size)

    # Reference for node i: a causal forward over prefix + root-to-node path (ancestors precede
    # descendants in node order); the filler after the path cannot affect the path's last token.
    for i in range(BLOCK):
        paths = np.zeros((2, SEQ), np.int32)
        for b in range(2):
            seq = np.concatenate([prefix[b, : prefix_lens[b]], nodes[b][np.flatnonzero(tree_mask[b, i])]])
            paths[b, : len(seq)] = seq
        ref_logits, ref_hidden = _reference(cfg, params, paths)
        last = prefix_lens + depth[:, i]
        assert rel_max_err(logits[:, i], ref_logits[np.arange(2), last]) < TOL, i
        assert rel_max_err(hidden[:, :, i], ref_hidden[::-1][:, np.arange(2), last]) < TOL, i
    # The same tokens under the default causal mask are a different computation.
    causal, _, _ = extend_jit(cfg, params, cache, jnp.asarray(nodes), positions, cache_len)
    assert rel_max_err(causal, logits) > 1e-3


def _fill(cache: KVCache, key, where) -> KVCache:
    """Overwrites the slots where `where` [B, S] is True with large random values."""

    def garbage(x, k):
        return jnp.where(where[:, :, None, None], 100.0 * jax.random.normal(k, x.shape, x.dtype), x)

    keys = jax.random.split(key, 2 * len(cache.k))
    return KVCache(
        k=tuple(garbage(x, k) for x, k in zip(cache.k, keys[::2])),
        v=tuple(garbage(x, k) for x, k in zip(cache.v, keys[1::2])),
    )


def test_slots_outside_the_new_block_are_neither_read_past_nor_written(model):
    cfg, params = model
    tokens = random_tokens(3, (2, SEQ), cfg.vocab_size)
    lengths = np.asarray([3, 7])
    _, cache, cache_len = _prefill(cfg, params, tokens, lengths)
    stale = jnp.arange(MAX_LEN)[None, :] >= cache_len[:, None]
    rows = np.arange(2)[:, None]
    new = lengths[:, None] + np.arange(BLOCK)[None, :]
    written = np.zeros((2, MAX_LEN), bool)
    written[rows, new] = True
    outs = []
    for seed in (10, 11):
        filled = _fill(cache, jax.random.key(seed), stale)
        logits, _, updated = extend_jit(
            cfg, params, filled, jnp.asarray(tokens[rows, new]), jnp.asarray(new, jnp.int32), cache_len
        )
        for before, after in zip(filled.k + filled.v, updated.k + updated.v):
            np.testing.assert_array_equal(np.asarray(after)[~written], np.asarray(before)[~written])
        outs.append((logits, updated))
    # Different garbage past the block: identical logits and identical newly written entries.
    np.testing.assert_array_equal(np.asarray(outs[0][0]), np.asarray(outs[1][0]))
    for a, b in zip(outs[0][1].k + outs[0][1].v, outs[1][1].k + outs[1][1].v):
        np.testing.assert_array_equal(np.asarray(a)[written], np.asarray(b)[written])
    ref, _ = _reference(cfg, params, tokens)
    assert rel_max_err(outs[0][0], ref[rows, new]) < TOL


def test_init_cache_shapes_and_bytes(model):
    cfg, _ = model
    cache = init_cache(cfg, 3, 10, jnp.bfloat16)
    assert (cache.batch, cache.max_len) == (3, 10)
    assert len(cache.k) == len(cache.v) == cfg.num_layers
    assert all(
        x.shape == (3, 10, cfg.num_kv_heads, cfg.head_dim) and x.dtype == jnp.bfloat16 for x in cache.k + cache.v
    )
    assert cache_bytes(cfg, 3, 10, jnp.bfloat16) == sum(x.nbytes for x in cache.k + cache.v)


def test_extend_rejects_hidden_layer_out_of_range(model):
    cfg, params = model
    with pytest.raises(ValueError, match="hidden layer id 2 outside"):
        extend(
            cfg,
            params,
            init_cache(cfg, 2, MAX_LEN),
            jnp.zeros((2, 1), jnp.int32),
            jnp.zeros((2, 1), jnp.int32),
            jnp.zeros((2,), jnp.int32),
            hidden_layers=(2,),
        )
