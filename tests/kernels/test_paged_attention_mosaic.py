"""The Mosaic GPU paged-attention kernel computes `paged_attention`'s reference.

Interpret mode runs the kernel's own code on the CPU (TMA copies, barriers, wgmma, the online
softmax), with shuffled page tables, pages shared by two rows, ragged lengths (a row of length 1,
new tokens on and across page and block boundaries, past the row's pages and past its table),
tree masks, finished rows, GQA groups 1 / 2 / 4, bfloat16 and float16, several splits and a
KV ring shorter than the row. The kernel and the reference both round to the 16-bit dtype at
different points, so each is compared with the exact attention of the same 16-bit inputs
computed in float32, within a few units of the dtype's last place (`TOLERANCE`); a page table with
one entry pointing at another page fails that comparison. Lowering for CUDA checks, on any
machine and JAX version, that Mosaic GPU accepts the kernel for Hopper.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import paged_attention_mosaic as mosaic
from jaxspec.kernels.ragged_attention import new_token_bits
from jaxspec.models.paged import _paged_attention_kernel, kernel_applies, paged_attention
from tests.kernels.paged_cases import HEAD_DIM, KV_HEADS, SHAPES, assert_close, case_inputs, exact, inputs

needs_interpret = pytest.mark.skipif(
    not mosaic.INTERPRET_SUPPORTED, reason="the kernel's Mosaic GPU interpret mode needs JAX >= 0.12"
)


# each shape of SHAPES with the kernel's tuning (None: through paged_attention with
# JAXSPEC_PAGED_ATTENTION=interpret, default tuning); the decode case's ring wraps
TUNING = {"decode": dict(splits=2, max_concurrent_steps=2), "tree": dict(splits=3), "float16": None}
CASES = {name: {**SHAPES[name], "tuning": TUNING[name]} for name in SHAPES}


@needs_interpret
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_the_reference(name, monkeypatch):
    case = CASES[name]
    q, k_pool, v_pool, table, cache_len, tree, active = case_inputs(case)
    assert kernel_applies(q, k_pool, v_pool)
    if case["tuning"] is None:
        monkeypatch.setenv("JAXSPEC_PAGED_ATTENTION", "interpret")
        got = paged_attention(q, k_pool, v_pool, table, cache_len, tree, active)
        monkeypatch.delenv("JAXSPEC_PAGED_ATTENTION")
    else:
        got = _paged_attention_kernel(
            q, k_pool, v_pool, table, cache_len, tree, active, impl="interpret", **case["tuning"]
        )
    want = exact(q, k_pool, v_pool, table, cache_len, tree, active)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert_close(got, want, case["dtype"])
    reference = paged_attention(q, k_pool, v_pool, table, cache_len, tree, active, impl="xla")
    assert_close(reference, want, case["dtype"])  # the tolerance holds the reference too


@needs_interpret
def test_a_wrong_page_table_entry_is_caught():
    """Negative control: row 2's fourth page replaced by a page of row 0 makes the kernel's output
    differ from the exact attention by more than the tolerance."""
    case = CASES["decode"]
    q, k_pool, v_pool, table, cache_len, tree, _ = case_inputs(case)
    wrong = table.at[2, 3].set(table[0, 0])
    got = _paged_attention_kernel(q, k_pool, v_pool, wrong, cache_len, tree, None, impl="interpret", **case["tuning"])
    want = exact(q, k_pool, v_pool, table, cache_len, tree, None)
    assert_close(got[:2], want[:2], case["dtype"])  # rows 0 and 1 do not read the entry
    with pytest.raises(AssertionError):
        assert_close(got[2], want[2], case["dtype"])


def test_float32_runs_the_reference_and_the_kernel_names_the_dtype():
    q, k_pool, v_pool, table, cache_len, tree = inputs(1, jnp.float32, 2, 2, [5, 20], [1, 2])
    assert not kernel_applies(q, k_pool, v_pool)
    got = paged_attention(q, k_pool, v_pool, table, cache_len, tree, impl="interpret")
    np.testing.assert_array_equal(got, paged_attention(q, k_pool, v_pool, table, cache_len, tree, impl="xla"))
    bits = new_token_bits(tree, 2, 64)
    q_rows = jnp.zeros((2, KV_HEADS, 64, HEAD_DIM), jnp.float32)
    with pytest.raises(ValueError, match="16-bit dtype"):
        mosaic.paged_attention_partials(q_rows, k_pool, v_pool, table, cache_len, cache_len, bits, num_new=2)


def test_paged_attention_impl_names_the_choices(monkeypatch):
    q, k_pool, v_pool, table, cache_len, tree = inputs(1, jnp.bfloat16, 1, 1, [5], [1])
    with pytest.raises(ValueError, match="paged attention impl"):
        paged_attention(q, k_pool, v_pool, table, cache_len, impl="cuda")
    monkeypatch.setenv("JAXSPEC_PAGED_ATTENTION", "cuda")
    with pytest.raises(ValueError, match="JAXSPEC_PAGED_ATTENTION"):
        paged_attention(q, k_pool, v_pool, table, cache_len)


@pytest.mark.parametrize(
    "dtype, rows, page, words, tuning",
    [
        (jnp.bfloat16, 64, 16, 1, dict(splits=4)),
        (jnp.float16, 128, 64, 2, dict(max_concurrent_steps=2)),
        (jnp.bfloat16, 64, 8, 1, dict(block_kv=128, max_concurrent_steps=2)),
    ],
)
def test_the_kernel_lowers_for_hopper(dtype, rows, page, words, tuning):
    """Mosaic GPU lowers the kernel for CUDA on any machine: its primitives, layouts and copies are
    ones the backend implements (interpret mode would also run ones it does not, e.g. jnp.dot)."""
    batch, num_pages, table_len = 3, 40, 12
    args = (
        jax.ShapeDtypeStruct((batch, KV_HEADS, rows, 128), dtype),
        jax.ShapeDtypeStruct((num_pages, page, KV_HEADS, 128), dtype),
        jax.ShapeDtypeStruct((num_pages, page, KV_HEADS, 128), dtype),
        jax.ShapeDtypeStruct((batch, table_len), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch, words, rows), jnp.int32),
    )

    def call(*a):
        return mosaic.paged_attention_partials(*a, num_new=words * 20, **tuning)

    lowered = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_shared_memory_fits_a_hopper_block():
    """At head dim 128 and 16-token pages (64-position blocks, 4 slots): 64 query rows fit, and a
    ring too deep for 128 rows is refused with the sizes."""
    assert mosaic.smem_bytes(64, 128, 64, 4, 1, jnp.bfloat16) <= mosaic.SMEM_BYTES
    assert mosaic.smem_bytes(128, 128, 64, 3, 1, jnp.bfloat16) <= mosaic.SMEM_BYTES
    q = jnp.zeros((1, KV_HEADS, 128, 128), jnp.bfloat16)
    pool = jnp.zeros((4, 16, KV_HEADS, 128), jnp.bfloat16)
    one = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="shared memory"):
        mosaic.paged_attention_partials(
            q,
            pool,
            pool,
            jnp.zeros((1, 4), jnp.int32),
            one,
            one,
            jnp.zeros((1, 1, 128), jnp.int32),
            num_new=1,
            max_concurrent_steps=4,
        )


def test_grouped_pools_run_the_reference():
    """The slot engine on a mesh passes pools with a leading group axis; the kernel takes ungrouped
    pools only, so such a call runs the reference whatever impl asks for."""
    q, k_pool, v_pool, table, cache_len, tree = inputs(1, jnp.bfloat16, 2, 2, [5, 20], [1, 2])
    k_groups, v_groups = jnp.stack([k_pool, k_pool]), jnp.stack([v_pool, v_pool])
    q2, table2 = jnp.concatenate([q, q]), jnp.concatenate([table, table])
    len2, tree2 = jnp.concatenate([cache_len, cache_len]), jnp.concatenate([tree, tree])
    assert not kernel_applies(q2, k_groups, v_groups)
    got = paged_attention(q2, k_groups, v_groups, table2, len2, tree2, impl="interpret")
    want = paged_attention(q, k_pool, v_pool, table, cache_len, tree, impl="xla")
    np.testing.assert_array_equal(got, jnp.concatenate([want, want]))
