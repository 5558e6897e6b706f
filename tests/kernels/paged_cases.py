"""Inputs, exact results and cases of the attention kernel's tests on paged caches: shuffled page
tables with pages shared by two rows, ragged lengths, random tree masks, and the exact attention of
the same inputs in float32."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.paged import NO_PAGE, paged_attention

KV_HEADS, HEAD_DIM, PAGE, PAGES_PER_ROW = 2, 64, 16, 10
MAX_LEN = PAGE * PAGES_PER_ROW
# One unit in the last place of the 16-bit dtype at the outputs' largest magnitudes (in [2, 4)):
# a kernel rounds its probabilities (unnormalised) and its output once each, the reference its
# probabilities (normalised) and its output; both stay within it (bf16: 0.006 and 0.008 of 0.0156).
# float32: the worst case of summing 160 positions in float32 (160 x 2^-24 relative below 4).
TOLERANCE = {jnp.bfloat16: 2.0**-6, jnp.float16: 2.0**-9, jnp.float32: 2.0**-15}


def random_tree_mask(rng, rows: int, t: int) -> np.ndarray:
    """bool [rows, t, t]: node i sees itself and the chain of its random parent (< i)."""
    mask = np.zeros((rows, t, t), bool)
    for r in range(rows):
        for i in range(t):
            mask[r, i, i] = True
            if i:
                mask[r, i] |= mask[r, rng.integers(0, i)]
    return mask


def page_table(rng, pages_needed: list[int], num_pages: int, shared: int) -> np.ndarray:
    """int32 [rows, PAGES_PER_ROW]: each row's pages drawn without replacement from a shuffled pool,
    NO_PAGE past them; rows 0 and 1 share their first `shared` pages (a prompt's prefix)."""
    pool = iter(rng.permutation(num_pages))
    table = np.full((len(pages_needed), PAGES_PER_ROW), NO_PAGE, np.int64)
    for r, n in enumerate(pages_needed):
        for m in range(n):
            table[r, m] = table[0, m] if r == 1 and m < shared else next(pool)
    return table.astype(np.int32)


def inputs(
    seed: int, dtype, group: int, t: int, cache_len: list[int], pages_needed: list[int], shared: int = 0, page=PAGE
):
    """q, k/v pools of `page`-position pages, a page table (`page_table`), cache_len, a tree mask."""
    rng = np.random.default_rng(seed)
    rows, num_pages = len(cache_len), sum(pages_needed) + 3
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (rows, t, KV_HEADS * group, HEAD_DIM), dtype)
    k_pool = 2.0 * jax.random.normal(ks[1], (num_pages, page, KV_HEADS, HEAD_DIM), dtype)
    v_pool = jax.random.normal(ks[2], (num_pages, page, KV_HEADS, HEAD_DIM), dtype)
    table = jnp.asarray(page_table(rng, pages_needed, num_pages, shared))
    tree = jnp.asarray(random_tree_mask(rng, rows, t))
    return q, k_pool, v_pool, table, jnp.asarray(cache_len, jnp.int32), tree


def exact(q, k_pool, v_pool, table, cache_len, tree, active):
    """The reference on the same 16-bit values in float32."""
    f32 = (x.astype(jnp.float32) for x in (q, k_pool, v_pool))
    return paged_attention(*f32, table, cache_len, tree, active, impl="xla")


def assert_close(got, want, dtype):
    assert float(jnp.max(jnp.abs(want))) < 4.0  # the magnitudes TOLERANCE is set for
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=0, atol=TOLERANCE[dtype])


SHAPES = {
    # a decode step: a row of length 1, a new token on a page boundary, a long row
    "decode": dict(
        dtype=jnp.bfloat16,
        group=4,
        t=1,
        cache_len=[0, 16, 150],
        pages_needed=[1, 2, 10],
        shared=1,
        active=None,
    ),
    # verification of trees: new tokens across a block boundary, a finished row, new tokens past
    # the row's pages (read as zeros) and past its table (dropped)
    "tree": dict(
        dtype=jnp.bfloat16,
        group=2,
        t=5,
        cache_len=[61, 40, 30, MAX_LEN - 2],
        pages_needed=[5, 3, 2, 10],
        shared=2,
        active=[True, False, True, False],
    ),
    "float16": dict(
        dtype=jnp.float16,
        group=1,
        t=3,
        cache_len=[1, 95],
        pages_needed=[1, 7],
        shared=0,
        active=None,
    ),
}


def case_inputs(case: dict, seed: int = 0):
    """`inputs` of a case of SHAPES (or of a test's own cases, which may name a `page` size), and
    its active rows (None: all)."""
    q, k_pool, v_pool, table, cache_len, tree = inputs(
        seed,
        case["dtype"],
        case["group"],
        case["t"],
        case["cache_len"],
        case["pages_needed"],
        case["shared"],
        page=case.get("page", PAGE),
    )
    active = None if case["active"] is None else jnp.asarray(case["active"])
    return q, k_pool, v_pool, table, cache_len, tree, active
