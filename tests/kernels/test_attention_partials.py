"""The attention kernel (`jaxspec.kernels.paged_attention_triton`, in Triton's interpreter) computes
its jnp reference's partials, split for split, on dense caches viewed as pages (one page per row,
as `cache_attention` passes them, and pages cut from the rows) and on shuffled page pools; the
merged partials equal a softmax over exactly the positions each query row may see (its row's
prefix and the new tokens its tree mask names), computed from first principles; positions no row
sees are never read. Random lengths (rows of length 1, finished rows, new tokens across block
edges and past the last position) and random trees; a wrong page table or a wrong length fails
the comparison (negative controls)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels.attention_partials import (
    causal_token_bits,
    merge,
    new_token_bits,
    partials_reference,
    split_runs,
)
from tests.kernels.paged_cases import inputs as paged_inputs

pytest.importorskip("triton", reason="the Triton kernel's tests need the triton package (the test extra has it)")
pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")

from jaxspec.kernels.paged_attention_triton import paged_attention_partials, query_rows  # noqa: E402

KV_HEADS, HEAD_DIM, GROUP = 2, 32, 2


def random_tree_masks(batch: int, t: int, seed: int) -> np.ndarray:
    """bool [B, T, T]: each node sees itself and a random subset of the earlier nodes."""
    rng = np.random.default_rng(seed)
    return np.tril(rng.random((batch, t, t)) < 0.5) | np.eye(t, dtype=bool)[None]


def dense_inputs(batch: int, max_len: int, t: int, seed: int = 0):
    """q rows [B, Nk, R, D] and dense caches [B, S, Nk, D] in float32."""
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (batch, KV_HEADS, query_rows(t * GROUP), HEAD_DIM))
    k = 2.0 * jax.random.normal(ks[1], (batch, max_len, KV_HEADS, HEAD_DIM))
    v = jax.random.normal(ks[2], (batch, max_len, KV_HEADS, HEAD_DIM))
    return q, k, v


def as_pages(cache: jax.Array, page: int) -> tuple[jax.Array, jax.Array]:
    """(pool [B * S / page, page, Nk, D], identity page table int32 [B, S / page]) of a dense cache:
    a reshape, no copy."""
    batch, max_len = cache.shape[:2]
    pool = cache.reshape(batch * max_len // page, page, *cache.shape[2:])
    return pool, jnp.arange(batch * max_len // page, dtype=jnp.int32).reshape(batch, max_len // page)


def random_lengths(rng, batch: int, max_len: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """(prefix_len, new_start) int32 [B]: random lengths with a row of length 1 (empty prefix), a
    finished row (prefix 0, reading only its new tokens), one whose new tokens run past the last
    position, and the others random (a third of them finished)."""
    new_start = rng.integers(1, max_len - t, batch)
    new_start[0], new_start[2] = 0, max_len - max(1, t // 2)
    prefix_len = np.where(rng.random(batch) < 1 / 3, 0, new_start)
    prefix_len[1], prefix_len[3 % batch] = 0, new_start[3 % batch]
    return prefix_len.astype(np.int32), new_start.astype(np.int32)


def test_new_token_bits():
    tree = random_tree_masks(3, 40, seed=1)  # two words per row
    bits = np.asarray(new_token_bits(jnp.asarray(tree), group=2, rows=128))
    assert bits.shape == (3, 2, 128)
    unpacked = (bits.view(np.uint32)[..., None] >> np.arange(32, dtype=np.uint32)) & 1  # [B, W, R, 32]
    unpacked = unpacked.transpose(0, 2, 1, 3).reshape(3, 128, 64)[:, :, :40].astype(bool)
    np.testing.assert_array_equal(unpacked[:, :80], np.repeat(tree, 2, axis=1))
    assert not unpacked[:, 80:].any()


@pytest.mark.parametrize("t, group, rows", [(1, 2, 16), (1, 16, 16), (5, 2, 16), (4, 8, 32), (40, 2, 128)])
def test_causal_token_bits_are_the_causal_masks_bits(t, group, rows):
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (1, t, t))
    bits = causal_token_bits(t, group, rows)
    assert bits.dtype == np.int32
    np.testing.assert_array_equal(bits, np.asarray(new_token_bits(causal, group, rows)))


def test_split_runs():
    """A row's blocks up to its last new token, from 0 or (finished) from its new tokens, in
    contiguous runs; new tokens past the last position add no block."""
    prefix_len = jnp.asarray([5, 0, 0, 200], jnp.int32)
    new_start = jnp.asarray([5, 130, 300, 200], jnp.int32)
    first, last = split_runs(prefix_len, new_start, num_new=2, max_len=256, block_kv=64, splits=3)
    np.testing.assert_array_equal(first, [[0, 1, 2], [2, 3, 4], [4, 4, 4], [0, 2, 4]])
    np.testing.assert_array_equal(last, [[1, 1, 1], [3, 3, 3], [4, 4, 4], [2, 4, 4]])


def assert_partials_equal(got, want):
    np.testing.assert_array_equal(np.isinf(got.m), np.isinf(want.m))
    for name in ("o", "m", "l"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=2e-5, atol=2e-5, err_msg=name)


def dense_case(t: int, page: int | None, seed: int):
    """Inputs of `paged_attention_partials` for a dense cache of 8 rows x 200 positions viewed as
    pages of `page` positions (None: one page per row, as `cache_attention` views it)."""
    batch, max_len = 8, 200
    q, k, v = dense_inputs(batch, max_len, t, seed)
    k_pool, table = as_pages(k, page or max_len)
    v_pool, _ = as_pages(v, page or max_len)
    prefix_len, new_start = random_lengths(np.random.default_rng(seed), batch, max_len, t)
    bits = new_token_bits(jnp.asarray(random_tree_masks(batch, t, seed)), GROUP, q.shape[2])
    return q, k_pool, v_pool, table, jnp.asarray(prefix_len), jnp.asarray(new_start), bits


def paged_case(t: int, seed: int):
    """Inputs of `paged_attention_partials` for a shuffled page pool of 16-position pages (rows 0
    and 1 share their first pages, entries past a row's pages `NO_PAGE`, read as zeros)."""
    cache_len = [0, 16, 47, 150, 159 - t // 2]
    q, k_pool, v_pool, table, cache_len, tree = paged_inputs(
        seed, jnp.float32, GROUP, t, cache_len, [1, 2, 4, 10, 10], shared=1
    )
    q_rows = jax.random.normal(jax.random.key(seed), (q.shape[0], k_pool.shape[2], query_rows(t * GROUP), q.shape[3]))
    prefix_len = cache_len.at[2].set(0)  # a finished row
    bits = new_token_bits(tree, GROUP, q_rows.shape[2])
    return q_rows, k_pool, v_pool, table, prefix_len, cache_len, bits


CASES = {  # name: (inputs of T new tokens, T, tuning)
    "dense-one-page-decode": (lambda t: dense_case(t, None, 1), 1, dict(splits=1, block_kv=64)),
    "dense-one-page-tree": (lambda t: dense_case(t, None, 2), 5, dict(splits=3, block_kv=16)),
    "dense-pages-of-25": (lambda t: dense_case(t, 25, 3), 4, dict(splits=2, block_kv=32)),
    "paged-pool-decode": (lambda t: paged_case(t, 4), 1, dict(splits=2, block_kv=64)),
    "paged-pool-tree": (lambda t: paged_case(t, 5), 6, dict(splits=3, block_kv=16)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_partials_equal_the_reference(name):
    make, t, tuning = CASES[name]
    args = make(t)
    got = paged_attention_partials(*args, num_new=t, interpret=True, **tuning)
    assert got.o.shape[2] == tuning["splits"]
    assert_partials_equal(got, partials_reference(*args, num_new=t, **tuning))


def test_a_wrong_length_or_page_table_fails_the_comparison():
    """Negative controls: the reference given one row's length one position short, or one row's
    page table entry pointing at another row's page, differs from the kernel's partials."""
    args = dense_case(4, 25, 3)
    q, k_pool, v_pool, table, prefix_len, new_start, bits = args
    tuning = dict(num_new=4, splits=2, block_kv=32)
    got = paged_attention_partials(*args, interpret=True, **tuning)
    row = int(np.flatnonzero(np.asarray(prefix_len) > 30)[0])
    short = prefix_len.at[row].add(-1)
    with pytest.raises(AssertionError):
        assert_partials_equal(got, partials_reference(q, k_pool, v_pool, table, short, new_start, bits, **tuning))
    wrong = table.at[row, 0].set(table[(row + 1) % table.shape[0], 0])
    with pytest.raises(AssertionError):
        assert_partials_equal(got, partials_reference(q, k_pool, v_pool, wrong, prefix_len, new_start, bits, **tuning))


def test_one_row_of_bits_is_every_rows():
    """Bits [1, W, R] (a causal step's constant) are read as every row's: the kernel equals the
    reference given each row a copy. Control: the same call with a random tree's bits differs."""
    t, tuning = 5, dict(num_new=5, splits=2, block_kv=16)
    q, k_pool, v_pool, table, prefix_len, new_start, _ = paged_case(t, 7)
    shared = jnp.asarray(causal_token_bits(t, GROUP, q.shape[2]))
    got = paged_attention_partials(q, k_pool, v_pool, table, prefix_len, new_start, shared, interpret=True, **tuning)
    each = jnp.broadcast_to(shared, (q.shape[0], *shared.shape[1:]))
    assert_partials_equal(got, partials_reference(q, k_pool, v_pool, table, prefix_len, new_start, each, **tuning))
    tree = new_token_bits(jnp.asarray(random_tree_masks(q.shape[0], t, seed=8)), GROUP, q.shape[2])
    with pytest.raises(AssertionError):
        assert_partials_equal(got, partials_reference(q, k_pool, v_pool, table, prefix_len, new_start, tree, **tuning))


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


def test_merged_partials_are_attention_over_the_visible_slots():
    batch, max_len, t = 3, 150, 3
    q, k, v = dense_inputs(batch, max_len, t, seed=3)
    rows = q.shape[2]
    new_start, prefix_len = np.array([5, 147, 77]), np.array([5, 147, 0])
    tree = random_tree_masks(batch, t, seed=4)
    bits = new_token_bits(jnp.asarray(tree), GROUP, rows)
    (k_pool, table), (v_pool, _) = as_pages(k, max_len), as_pages(v, max_len)
    parts = paged_attention_partials(
        q, k_pool, v_pool, table, jnp.asarray(prefix_len), jnp.asarray(new_start), bits, num_new=t, interpret=True
    )
    out = np.asarray(merge(parts))
    visible = visible_slots(prefix_len, new_start, tree, GROUP, rows, max_len)
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
    """NaN keys and infinite values wherever no query row looks (past a row's new tokens; a
    finished row's prefix) leave the output unchanged."""
    t = 2
    q, k, v = dense_inputs(2, 128, t, seed=5)
    new_start, prefix_len = jnp.asarray([40, 100], jnp.int32), jnp.asarray([40, 0], jnp.int32)
    bits = new_token_bits(jnp.asarray(random_tree_masks(2, t, seed=6)), GROUP, q.shape[2])
    poisoned_k = k.at[0, 42:].set(jnp.nan).at[1, :100].set(jnp.nan).at[1, 102:].set(jnp.nan)
    poisoned_v = v.at[0, 42:].set(jnp.inf).at[1, :100].set(jnp.inf).at[1, 102:].set(jnp.inf)

    def attend(k, v):
        (k_pool, table), (v_pool, _) = as_pages(k, 128), as_pages(v, 128)
        parts = paged_attention_partials(
            q, k_pool, v_pool, table, prefix_len, new_start, bits, num_new=t, interpret=True, splits=2, block_kv=32
        )
        return merge(parts)

    np.testing.assert_array_equal(attend(poisoned_k, poisoned_v), attend(k, v))
