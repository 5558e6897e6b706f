"""GPU check of the attention-prologue kernel against the model's own pieces it replaces.

    pytest -m gpu tests/gpu/test_attention_prologue.py         # the check, as a test
    python3 -m tests.gpu.check_attention_prologue              # exit 0 when they agree

`attention_prologue` (`jaxspec.kernels.attention_prologue_triton` through jax-triton), compiled
for the GPU in bfloat16, against `attention_prologue_reference` (the model's rms_norm, rope and
paged write under XLA) on the same inputs: Qwen3-8B's heads with q/k norms (32 query heads over 8
KV heads, head dim 128) and a Qwen2-like layer with biases and 7 query heads per KV head, decode
steps and 4 and 16 new tokens, shuffled 16-position pages, a row whose new tokens run onto a
missing page and one past its table. The pools must be bit for bit equal where nothing is written
(a stray or missing write shows), the written keys and values and the query rows within
`TOLERANCE` (XLA may keep float32 where the model casts, the kernel rounds as written); a moved
page-table entry must break the agreement (the negative control). Prints every case, and any
deprecation warning raised while the kernel compiles.
"""

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels.attention_prologue_triton import attention_prologue
from jaxspec.kernels.paged_attention_triton import query_rows
from jaxspec.models.attention_prologue import attention_prologue_reference
from jaxspec.models.paged import NO_PAGE
from tests.gpu import check_main

PAGE, PAGES_PER_ROW = 16, 8
TOLERANCE = 2.0**-5  # relative and absolute: 4 units in the last place of bfloat16
CASES = [  # (name, rows, new tokens, kv heads, query heads per kv head, bias, q/k norms)
    ("qwen3-8b decode", 64, 1, 8, 4, False, True),
    ("qwen3-8b verify", 16, 4, 8, 4, False, True),
    ("qwen3-8b tree", 4, 16, 8, 4, False, True),
    ("qwen2 biases", 8, 4, 4, 7, True, False),
]


def case_inputs(rng, b: int, t: int, nk: int, group: int, bias: bool, qk_norm: bool):
    d = 128
    num_pages = b * PAGES_PER_ROW + 3
    table = rng.permutation(num_pages)[: b * PAGES_PER_ROW].reshape(b, PAGES_PER_ROW).astype(np.int32)
    cache_len = rng.integers(0, PAGE * PAGES_PER_ROW - t, b).astype(np.int32)
    cache_len[1 % b] = PAGE * PAGES_PER_ROW - max(1, t // 2)  # past the table
    table[2 % b, (cache_len[2 % b] + t - 1) // PAGE] = NO_PAGE  # the page of its last token missing
    ks = iter(jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 8))
    angles = jnp.asarray(cache_len)[:, None, None] + jnp.arange(t)[None, :, None]
    angles = angles * (10000.0 ** (-jnp.arange(d // 2) / (d // 2)))[None, None, :]
    angles = jnp.concatenate([angles, angles], axis=-1).astype(jnp.float32)
    return dict(
        proj=2.0 * jax.random.normal(next(ks), (b, t, nk, group + 2, d), jnp.bfloat16),
        bias=0.5 * jax.random.normal(next(ks), (nk, group + 2, d), jnp.bfloat16) if bias else None,
        q_norm=(1 + 0.3 * jax.random.normal(next(ks), (d,))).astype(jnp.bfloat16) if qk_norm else None,
        k_norm=(1 + 0.3 * jax.random.normal(next(ks), (d,))).astype(jnp.bfloat16) if qk_norm else None,
        cos=jnp.cos(angles),
        sin=jnp.sin(angles),
        cache_len=jnp.asarray(cache_len),
        page_table=jnp.asarray(table),
        k_pool=jax.random.normal(next(ks), (num_pages, PAGE, nk, d), jnp.bfloat16),
        v_pool=jax.random.normal(next(ks), (num_pages, PAGE, nk, d), jnp.bfloat16),
    )


def disagreement(got, want, before) -> tuple[float, int]:
    """(largest difference of the query rows and written positions, positions differing elsewhere)."""
    err = float(np.abs(np.float32(got[0]) - np.float32(want[0])).max())
    stray = 0
    for pool, want_pool, old in zip(got[1:], want[1:], before):
        written = np.any(np.asarray(want_pool != old), axis=(-2, -1))
        stray += int(np.any(np.asarray(pool != want_pool)[~written], axis=(-2, -1)).sum())
        err = max(err, float(np.abs(np.float32(pool[written]) - np.float32(want_pool[written])).max()))
    return err, stray


def check_attention_prologue() -> bool:
    rng = np.random.default_rng(0)
    ok = True
    for name, b, t, nk, group, bias, qk_norm in CASES:
        args = case_inputs(rng, b, t, nk, group, bias, qk_norm)
        settings = dict(rows=query_rows(t * group), eps=1e-6)
        want = jax.jit(lambda a: attention_prologue_reference(**a, **settings))(args)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = jax.jit(lambda a: attention_prologue(**a, **settings))(args)
        deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
        before = (args["k_pool"], args["v_pool"])
        err, stray = disagreement(got, want, before)
        scale = max(1.0, float(np.abs(np.float32(want[0])).max()))
        first = int(args["cache_len"][0]) // PAGE  # row 0's first new token's page, moved to a spare one
        spare = int(np.setdiff1d(np.arange(args["k_pool"].shape[0]), np.asarray(args["page_table"]))[0])
        moved = {**args, "page_table": args["page_table"].at[0, first].set(spare)}
        wrong_err, wrong_stray = disagreement(
            jax.jit(lambda a: attention_prologue(**a, **settings))(moved), want, before
        )
        case_ok = bool(err < TOLERANCE * scale and stray == 0 and (wrong_err > TOLERANCE * scale or wrong_stray > 0))
        case_ok &= not deprecations
        ok &= case_ok
        print(
            f"attention prologue {name} (b={b} t={t} Nk={nk} G={group}): |kernel-reference| {err:.4f} "
            f"(bound {TOLERANCE * scale:.4f}), stray positions {stray}; moved page: {wrong_err:.4f}, "
            f"{wrong_stray} stray; deprecations {deprecations or 'none'}: {'OK' if case_ok else 'MISMATCH'}"
        )
    print(f"attention prologue: {'OK' if ok else 'MISMATCH'}")
    return ok


if __name__ == "__main__":
    sys.exit(check_main("attention_prologue", check_attention_prologue, sys.argv[1:]))
