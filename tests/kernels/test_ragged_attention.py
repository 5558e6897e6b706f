"""The ragged prefix-attention kernel (interpret mode) computes the reference's partials, and the
merged partials equal a softmax over exactly the slots below each row's length."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.ragged_attention import merge, prefix_attention_pallas, prefix_attention_reference, split_plan

KV_HEADS, HEAD_DIM = 2, 32


def inputs(batch: int, max_len: int, rows: int, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (batch, KV_HEADS, rows, HEAD_DIM))
    k = 2.0 * jax.random.normal(ks[1], (batch, max_len, KV_HEADS, HEAD_DIM))
    v = jax.random.normal(ks[2], (batch, max_len, KV_HEADS, HEAD_DIM))
    return q, k, v


@pytest.mark.parametrize("splits,block_k", [
    (None, 64),   # the default plan: one block per split at this batch
    (1, 32),      # one program per row and head loops over all blocks (the online softmax rescales)
    (3, 16),      # several blocks per split, the last split short
])
def test_kernel_partials_equal_reference(splits, block_k):
    max_len = 200
    q, k, v = inputs(7, max_len, rows=16)
    # empty, one slot, block boundaries +- 1, the whole (ragged-ended) cache
    lengths = jnp.asarray([0, 1, 63, 64, 65, 129, max_len], jnp.int32)
    got = prefix_attention_pallas(q, k, v, lengths, interpret=True, block_k=block_k, splits=splits)
    want = prefix_attention_reference(q, k, v, lengths, block_k=block_k, splits=splits)
    assert got.o.shape[2] == split_plan(7, KV_HEADS, max_len, block_k, splits)[0]
    np.testing.assert_array_equal(np.isinf(got.m), np.isinf(want.m))
    for name in ("o", "m", "l"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=2e-5, atol=2e-5, err_msg=name)


def test_split_plan():
    assert split_plan(256, 8, 1000) == (1, 16)          # 2048 programs already
    assert split_plan(1, 8, 1000) == (16, 1)            # at most one split per block
    assert split_plan(16, 8, 4096, splits=5) == (5, 13)  # 64 blocks in 5 splits of 13
    assert split_plan(16, 8, 4096, splits=100) == (64, 1)


def test_merged_partials_are_attention_over_the_prefix():
    batch, max_len = 3, 150
    q, k, v = inputs(batch, max_len, rows=16, seed=3)
    lengths = np.array([5, 150, 77])
    out = np.asarray(merge(prefix_attention_pallas(q, k, v, jnp.asarray(lengths), interpret=True, splits=2)))
    for b, n in enumerate(lengths):
        for h in range(KV_HEADS):
            scores = np.asarray(q[b, h]) @ np.asarray(k[b, :n, h]).T / np.sqrt(HEAD_DIM)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            want = (p / p.sum(axis=1, keepdims=True)) @ np.asarray(v[b, :n, h])
            np.testing.assert_allclose(out[b, h], want, rtol=1e-5, atol=1e-5)


def test_slots_past_the_length_are_not_read():
    q, k, v = inputs(2, 128, rows=16, seed=5)
    lengths = jnp.asarray([40, 100], jnp.int32)
    poisoned_k = k.at[0, 40:].set(jnp.nan).at[1, 100:].set(jnp.nan)
    poisoned_v = v.at[0, 40:].set(jnp.inf).at[1, 100:].set(jnp.inf)
    got = merge(prefix_attention_pallas(q, poisoned_k, poisoned_v, lengths, interpret=True))
    want = merge(prefix_attention_pallas(q, k, v, lengths, interpret=True))
    np.testing.assert_array_equal(got, want)
