"""The ragged cache-attention kernel (interpret mode) computes the reference's partials, and the
merged partials equal a softmax over exactly the slots each query row may see: its row's prefix
and the new tokens its tree mask names."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import ragged_attention
from jaxspec.kernels.ragged_attention import (
    cache_attention_pallas,
    cache_attention_reference,
    merge,
    new_token_bits,
    split_plan,
)
from tests.kernels.triton_ir import verify_triton

KV_HEADS, HEAD_DIM = 2, 32


def inputs(batch: int, max_len: int, rows: int, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (batch, KV_HEADS, rows, HEAD_DIM))
    k = 2.0 * jax.random.normal(ks[1], (batch, max_len, KV_HEADS, HEAD_DIM))
    v = jax.random.normal(ks[2], (batch, max_len, KV_HEADS, HEAD_DIM))
    return q, k, v


def random_tree_masks(batch: int, t: int, seed: int) -> np.ndarray:
    """bool [B, T, T]: each node sees itself and a random subset of the earlier nodes."""
    rng = np.random.default_rng(seed)
    return np.tril(rng.random((batch, t, t)) < 0.5) | np.eye(t, dtype=bool)[None]


def visible_slots(prefix_len, new_start, tree, group, rows, max_len) -> np.ndarray:
    """bool [B, rows, max_len] from first principles."""
    b, t, _ = tree.shape
    out = np.zeros((b, rows, max_len), bool)
    for i in range(b):
        out[i, :, : prefix_len[i]] = True
        for r in range(t * group):
            for j in range(t):
                if tree[i, r // group, j] and new_start[i] + j < max_len:
                    out[i, r, new_start[i] + j] = True
    return out


def test_new_token_bits():
    tree = random_tree_masks(3, 40, seed=1)  # two words per row
    bits = np.asarray(new_token_bits(jnp.asarray(tree), group=2, rows=128))
    assert bits.shape == (3, 2, 128)
    unpacked = (bits.view(np.uint32)[..., None] >> np.arange(32, dtype=np.uint32)) & 1  # [B, W, R, 32]
    unpacked = unpacked.transpose(0, 2, 1, 3).reshape(3, 128, 64)[:, :, :40].astype(bool)
    np.testing.assert_array_equal(unpacked[:, :80], np.repeat(tree, 2, axis=1))
    assert not unpacked[:, 80:].any()


@pytest.mark.parametrize(
    "splits,block_k,t",
    [
        (None, 64, 1),  # the default plan: one block per split at this batch; decode steps
        (1, 32, 4),  # one program per row and head loops over all blocks (the online softmax rescales)
        (3, 16, 5),  # several blocks per split, the last split short; new tokens across a block edge
    ],
)
def test_kernel_partials_equal_reference(splits, block_k, t):
    max_len, group = 200, 2
    rows = max(16, 1 << (t * group - 1).bit_length())
    q, k, v = inputs(8, max_len, rows=rows)
    # an empty prefix, one slot, block boundaries +- 1, new tokens running past the last slot
    new_start = jnp.asarray([0, 1, 63, 64, 65, 129, max_len - 2, 140], jnp.int32)
    prefix_len = new_start.at[7].set(0)  # a finished row sees only its new tokens
    bits = new_token_bits(jnp.asarray(random_tree_masks(8, t, seed=t)), group, rows)
    kw = dict(num_new=t, block_k=block_k, splits=splits)
    got = cache_attention_pallas(q, k, v, prefix_len, new_start, bits, interpret=True, **kw)
    want = cache_attention_reference(q, k, v, prefix_len, new_start, bits, **kw)
    assert got.o.shape[2] == split_plan(8, KV_HEADS, max_len, block_k, splits)[0]
    np.testing.assert_array_equal(np.isinf(got.m), np.isinf(want.m))
    for name in ("o", "m", "l"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=2e-5, atol=2e-5, err_msg=name)


def test_split_plan():
    assert split_plan(256, 8, 1000) == (1, 16)  # 2048 programs already
    assert split_plan(1, 8, 1000) == (16, 1)  # at most one split per block
    assert split_plan(16, 8, 4096, splits=5) == (5, 13)  # 64 blocks in 5 splits of 13
    assert split_plan(16, 8, 4096, splits=100) == (64, 1)


def test_merged_partials_are_attention_over_the_visible_slots():
    batch, max_len, t, group, rows = 3, 150, 3, 2, 16
    q, k, v = inputs(batch, max_len, rows=rows, seed=3)
    new_start, prefix_len = np.array([5, 147, 77]), np.array([5, 147, 0])
    tree = random_tree_masks(batch, t, seed=4)
    bits = new_token_bits(jnp.asarray(tree), group, rows)
    out = np.asarray(
        merge(
            cache_attention_pallas(
                q, k, v, jnp.asarray(prefix_len), jnp.asarray(new_start), bits, num_new=t, interpret=True, splits=2
            )
        )
    )
    visible = visible_slots(prefix_len, new_start, tree, group, rows, max_len)
    for b in range(batch):
        for h in range(KV_HEADS):
            for r in range(rows):
                seen = visible[b, r]
                if not seen.any():
                    np.testing.assert_array_equal(out[b, h, r], 0.0)
                    continue
                scores = np.asarray(k[b, seen, h]) @ np.asarray(q[b, h, r]) / np.sqrt(HEAD_DIM)
                p = np.exp(scores - scores.max())
                np.testing.assert_allclose(out[b, h, r], p / p.sum() @ np.asarray(v[b, seen, h]), rtol=1e-5, atol=1e-5)


def test_slots_no_row_sees_are_not_read():
    q, k, v = inputs(2, 128, rows=16, seed=5)
    t = 2
    new_start, prefix_len = jnp.asarray([40, 100], jnp.int32), jnp.asarray([40, 0], jnp.int32)
    bits = new_token_bits(jnp.asarray(random_tree_masks(2, t, seed=6)), 2, 16)
    # row 0: past its new tokens; row 1 (finished): its prefix and past its new tokens
    poisoned_k = k.at[0, 42:].set(jnp.nan).at[1, :100].set(jnp.nan).at[1, 102:].set(jnp.nan)
    poisoned_v = v.at[0, 42:].set(jnp.inf).at[1, :100].set(jnp.inf).at[1, 102:].set(jnp.inf)

    def attend(k, v):
        return merge(
            cache_attention_pallas(
                q,
                k,
                v,
                prefix_len,
                new_start,
                bits,
                num_new=t,  # noqa: E731
                interpret=True,
            )
        )

    np.testing.assert_array_equal(attend(poisoned_k, poisoned_v), attend(k, v))


@pytest.mark.parametrize("splits", [None, 3])
def test_programs_read_only_the_blocks_up_to_each_rows_length(monkeypatch, splits):
    """Counts the KV blocks read through poison that no mask hides: the kernel's masked loads are
    replaced by whole-block loads, and every block a row needs no slot of (past its last new
    token; below its new tokens for a finished row) holds NaN values, which reach the output of
    any program that visits the block (0 * NaN = NaN in p @ v). Inside the blocks a row does need,
    the slots it does not see keep finite values and are hidden by the score mask, so the result
    must equal the masked kernel's on the clean cache."""
    block_k, max_len, t = 16, 128, 2
    q, k, v = inputs(2, max_len, rows=16, seed=7)
    new_start, prefix_len = jnp.asarray([40, 100], jnp.int32), jnp.asarray([40, 0], jnp.int32)
    bits = new_token_bits(jnp.asarray(random_tree_masks(2, t, seed=8)), 2, 16)
    # row 0 needs blocks [0, 3) (slots < 48), row 1 (finished, new tokens 100, 101) block 6 only
    needed = np.zeros((2, max_len), bool)
    needed[0, :48], needed[1, 96:112] = True, True
    poison = jnp.asarray(~needed)[:, :, None, None]

    def attend(k, v):
        return merge(
            cache_attention_pallas(
                q,
                k,
                v,
                prefix_len,
                new_start,
                bits,
                num_new=t,  # noqa: E731
                interpret=True,
                block_k=block_k,
                splits=splits,
            )
        )

    want = attend(k, v)

    def whole_block(ref, mask=None, other=None, **_):
        return ref[...]

    plgpu = ragged_attention.plgpu
    monkeypatch.setattr(
        ragged_attention, "plgpu", SimpleNamespace(load=whole_block, dot=plgpu.dot, CompilerParams=plgpu.CompilerParams)
    )
    jax.clear_caches()  # trace the kernel again with unmasked loads
    try:
        got = attend(jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v))
    finally:
        jax.clear_caches()
    assert np.isfinite(np.asarray(got)).all(), "a program read a KV block past its row's length"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("num_new,group", [(1, 2), (1, 7), (8, 7), (16, 7), (40, 2)])  # decode, chains, trees
@pytest.mark.parametrize("max_len,block_k,splits", [(200, 64, None), (200, 16, 3), (4096, 64, None)])
def test_the_gpu_kernel_is_a_valid_triton_module(head_dim, num_new, group, max_len, block_k, splits):
    """The kernel as a GPU compiles it (bf16, as the models run it), at the rollout's shapes: query
    rows up to 128, one or two words of new-token bits."""
    batch, rows = 4, max(16, 1 << (num_new * group - 1).bit_length())
    bf16, i32 = jnp.bfloat16, jnp.int32
    cache = jax.ShapeDtypeStruct((batch, max_len, KV_HEADS, head_dim), bf16)
    per_row = jax.ShapeDtypeStruct((batch,), i32)
    attend = lambda *args: cache_attention_pallas(*args, num_new=num_new, block_k=block_k, splits=splits)  # noqa: E731
    assert (
        verify_triton(
            attend,
            jax.ShapeDtypeStruct((batch, KV_HEADS, rows, head_dim), bf16),
            cache,
            cache,
            per_row,
            per_row,
            jax.ShapeDtypeStruct((batch, -(-num_new // 32), rows), i32),
        )
        == 1
    )
