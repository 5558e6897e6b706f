"""GPU check of the attention kernel on paged caches against the jnp reference it replaces.

    pytest -m gpu tests/gpu/test_paged_attention.py            # the check, as a test
    python3 -m tests.gpu.check_paged_attention                 # exit 0 when they agree

`paged_attention` by the Triton attention kernel (`jaxspec.kernels.paged_attention_triton` through
jax-triton: the `triton` extra), compiled for the GPU, against the exact attention of the same bf16
values (the reference in float32 at the highest matmul precision), with Qwen3-8B's heads (32 query
heads, 8 KV heads, head dim 128) and 16-position pages: decode steps, chains, random trees up to 32
nodes (128 query rows), finished rows, rows of length 1, pages shared by rows, shuffled page tables,
new tokens past a row's pages and past its table, several splits. The bf16 reference is held to the
same bound, and a wrong page-table entry must break the kernel (the negative control). Each case runs
twice: the kernel's splits merged by XLA, then by the merge kernel (`JAXSPEC_ATTENTION_MERGE`).
Prints every case, and any deprecation warning raised while the kernel compiles.
"""

import os
import sys
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.attention import MERGE_ENV, kernel_attention
from jaxspec.models.paged import NO_PAGE, paged_attention
from tests.gpu import check_main
from tests.gpu.check_attention import random_trees

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
TOLERANCE = 2.0**-5  # 2 units in the last place of bf16 outputs in [2, 4)


def case_inputs(rng, b: int, t: int, pages_per_row: int, tree: bool):
    """Random bf16 q and pools, a shuffled page table (rows 0 and 1 share their first pages; row 2
    lacks the page of its last new token), lengths (row 3 has length 1, row 4 ends past its table),
    a tree or causal mask and the active rows."""
    max_len = PAGE * pages_per_row
    cache_len = rng.integers(0, max_len - t, b)
    cache_len[0] = max(cache_len[0], 2 * PAGE)
    cache_len[3 % b], cache_len[4 % b] = 0, max_len - max(1, t // 2)
    needed = np.minimum(-(-(cache_len + t) // PAGE), pages_per_row)
    needed[2 % b] = max(0, (cache_len[2 % b] + t - 1) // PAGE)  # the page of its last token missing
    num_pages = int(needed.sum()) + 5
    pool = iter(rng.permutation(num_pages))
    table = np.full((b, pages_per_row), NO_PAGE, np.int64)
    for r in range(b):
        for m in range(needed[r]):
            table[r, m] = table[0, m] if r == 1 and m < min(needed[0], 2) else next(pool)
    ks = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
    q = jax.random.normal(ks[0], (b, t, HEADS, HEAD_DIM), jnp.bfloat16)
    k_pool = 2.0 * jax.random.normal(ks[1], (num_pages, PAGE, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    v_pool = jax.random.normal(ks[2], (num_pages, PAGE, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    mask = jnp.asarray(random_trees(rng, b, t)) if tree else None
    active = jnp.asarray(rng.random(b) < 0.8).at[0].set(True)  # row 0 reads the page the control corrupts
    return q, k_pool, v_pool, jnp.asarray(table.astype(np.int32)), jnp.asarray(cache_len.astype(np.int32)), mask, active


CASES = [  # (rows, new tokens, tree, pages per row, tuning)
    (8, 1, False, 40, {}),
    (8, 4, False, 40, dict(splits=1)),
    (8, 6, True, 72, {}),
    (6, 16, True, 20, dict(splits=3)),
    (4, 32, True, 64, {}),
    (64, 4, False, 72, {}),
]


def check_paged_attention() -> bool:
    rng = np.random.default_rng(0)
    ok = True
    for b, t, tree, pages_per_row, tuning in CASES:
        q, k_pool, v_pool, table, cache_len, mask, active = case_inputs(rng, b, t, pages_per_row, tree)
        with jax.default_matmul_precision("highest"):
            f32 = (x.astype(jnp.float32) for x in (q, k_pool, v_pool))
            want = np.asarray(paged_attention(*f32, table, cache_len, mask, active, impl="xla"))
        reference = np.asarray(
            paged_attention(q, k_pool, v_pool, table, cache_len, mask, active, impl="xla").astype(jnp.float32)
        )
        ref_err = float(np.abs(reference - want).max())
        wrong_table = table.at[0, 0].set(table[0, 1])
        errors = {}
        for merge in ("xla", "triton"):  # the splits merged by XLA, then by the merge kernel
            with mock.patch.dict(os.environ, {MERGE_ENV: merge}), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                kernel = jax.jit(lambda *a, tuning=tuning: kernel_attention(*a, **tuning))  # traced here
                got = np.asarray(kernel(q, k_pool, v_pool, table, cache_len, mask, active).astype(jnp.float32))
                wrong = np.asarray(kernel(q, k_pool, v_pool, wrong_table, cache_len, mask, active).astype(jnp.float32))
            deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
            errors[merge] = [float(np.abs(x - want).max()) for x in (got, wrong)] + [np.isfinite(got).all()]
        case_ok = bool(
            ref_err < TOLERANCE
            and all(finite and err < TOLERANCE < wrong_err for err, wrong_err, finite in errors.values())
            and not deprecations
        )
        ok &= case_ok
        found = "; ".join(
            f"{m} merge |kernel-exact| {e:.4f} |wrong table-exact| {w:.4f}" for m, (e, w, _) in errors.items()
        )
        print(
            f"paged attention b={b} t={t} tree={tree} pages/row={pages_per_row} {tuning}: |reference-exact| "
            f"{ref_err:.4f}; {found}; deprecations {deprecations or 'none'}: {'OK' if case_ok else 'MISMATCH'}"
        )
    print(f"paged attention: {'OK' if ok else 'MISMATCH'}")
    return ok


if __name__ == "__main__":
    sys.exit(check_main("paged_attention", check_paged_attention, sys.argv[1:]))
