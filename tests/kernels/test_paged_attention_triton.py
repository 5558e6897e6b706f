"""The Triton attention kernel computes `paged_attention`'s reference.

Triton's interpreter runs the kernel's own code on the CPU (on torch CPU tensors, called from JAX
through `jax.pure_callback`): the page-table gathers, the online softmax, the tree-mask bits and the
splits, on the cases of `tests.kernels.paged_cases` (shuffled page tables, pages shared by two rows,
a row of length 1, new tokens on and across page and block boundaries, past the row's pages and past
its table, tree masks, finished rows, GQA groups 1 / 2 / 4, several splits), plus float32, pages
that straddle blocks (12-position pages, 16-position blocks) and 128 query rows whose trees need two
words of bits. Each is compared with the exact attention of the same inputs in float32, within
`TOLERANCE`: a few units in the last place of the 16-bit dtypes (the kernel rounds its probabilities
and its output once each), and for float32 the worst case of summing 160 positions in float32 (160 x
2^-24 relative at magnitudes below 4, 2^-15). A page table with one entry pointing at another page
fails that comparison. Compiling the kernel for sm90 (Triton's own compiler down to a cubin, as
jax-triton does on a GPU) checks on any machine what the interpreter does not: that it is valid
Triton for Hopper.
"""

import functools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton", reason="the Triton kernel's tests need the triton package (the test extra has it)")
pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from jaxspec.kernels import paged_attention_triton as kernel_module  # noqa: E402
from jaxspec.kernels.triton_call import compiled  # noqa: E402
from jaxspec.models.attention import kernel_attention, kernel_attention_rows, query_rows_of  # noqa: E402
from jaxspec.models.paged import paged_attention  # noqa: E402
from tests.kernels import fake_jax_triton  # noqa: E402
from tests.kernels.paged_cases import SHAPES, assert_close, case_inputs, exact, inputs  # noqa: E402

exact = jax.jit(exact)  # one compilation per case rather than one per operation
TUNING = {"decode": dict(splits=2), "tree": dict(splits=3), "float16": None}  # None: through paged_attention
CASES = {
    **{name: {**SHAPES[name], "tuning": TUNING[name]} for name in SHAPES},
    # eight pages per block
    "float32": dict(
        dtype=jnp.float32,
        group=4,
        t=4,
        cache_len=[33, 100, 7],
        pages_needed=[3, 7, 1],
        shared=1,
        active=None,
        tuning=dict(splits=1, block_kv=128),
    ),
    # pages of 12 positions across blocks of 16
    "page-12": dict(
        dtype=jnp.bfloat16,
        group=2,
        t=2,
        cache_len=[11, 100, 0],
        pages_needed=[2, 9, 1],
        shared=1,
        active=None,
        page=12,
        tuning=dict(splits=2, block_kv=16),
    ),
    # 33 new tokens x 2 query heads: 128 query rows, two words of tree bits
    "two-words": dict(
        dtype=jnp.float16,
        group=2,
        t=33,
        cache_len=[20, 70],
        pages_needed=[4, 7],
        shared=1,
        active=None,
        tuning=dict(splits=2),
    ),
}


@pytest.mark.parametrize("merge", ["xla", "triton"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_the_reference(name, merge, monkeypatch):
    """The kernel's splits merged by XLA or by the merge kernel (JAXSPEC_ATTENTION_MERGE)."""
    monkeypatch.setenv("JAXSPEC_ATTENTION_MERGE", merge)
    case = CASES[name]
    q, k_pool, v_pool, table, cache_len, tree, active = case_inputs(case)
    assert kernel_module.kernel_applies(q, k_pool, v_pool)
    if case["tuning"] is None:
        monkeypatch.setenv("JAXSPEC_PAGED_ATTENTION", "triton-interpret")
        got = paged_attention(q, k_pool, v_pool, table, cache_len, tree, active)
        monkeypatch.delenv("JAXSPEC_PAGED_ATTENTION")
    else:
        got = jax.jit(functools.partial(kernel_attention, interpret=True, **case["tuning"]))(
            q, k_pool, v_pool, table, cache_len, tree, active
        )
    want = exact(q, k_pool, v_pool, table, cache_len, tree, active)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert_close(got, want, case["dtype"])


def test_a_wrong_page_table_entry_is_caught():
    """Negative control: row 2's fourth page replaced by a page of row 0 makes the kernel's output
    differ from the exact attention by more than the tolerance."""
    case = CASES["decode"]
    q, k_pool, v_pool, table, cache_len, tree, _ = case_inputs(case)
    wrong = table.at[2, 3].set(table[0, 0])
    got = kernel_attention(q, k_pool, v_pool, wrong, cache_len, tree, None, interpret=True, splits=2)
    want = exact(q, k_pool, v_pool, table, cache_len, tree, None)
    assert_close(got[:2], want[:2], case["dtype"])  # rows 0 and 1 do not read the entry
    with pytest.raises(AssertionError):
        assert_close(got[2], want[2], case["dtype"])


def test_heads_major_pools_give_the_same_attention():
    """The pools laid out [P, Nk, page, D] (heads_major) give what the same pages laid out
    [P, page, Nk, D] give, to the bit; negative control: the position-major pools read as if heads
    major differ from the exact attention."""
    case = CASES["tree"]
    q, k_pool, v_pool, table, cache_len, tree, active = case_inputs(case)
    want = exact(q, k_pool, v_pool, table, cache_len, tree, active)
    t, nq, d = q.shape[1:]
    nk = k_pool.shape[2]
    q_rows = query_rows_of(q, nk, kernel_module.query_rows(t * (nq // nk)))

    def attend(k, v, heads_major):
        return kernel_attention_rows(
            q_rows,
            k,
            v,
            table,
            cache_len,
            tree,
            active,
            num_new=t,
            group=nq // nk,
            interpret=True,
            heads_major=heads_major,
            **case["tuning"],
        )

    positions = attend(k_pool, v_pool, False)
    heads = attend(*(pool.transpose(0, 2, 1, 3) for pool in (k_pool, v_pool)), True)
    assert_close(positions, want, case["dtype"])
    np.testing.assert_array_equal(np.asarray(heads, np.float32), np.asarray(positions, np.float32))
    misread = attend(*(pool.reshape(pool.shape[0], nk, -1, d) for pool in (k_pool, v_pool)), True)
    with pytest.raises(AssertionError):
        assert_close(misread, want, case["dtype"])


def test_the_jax_triton_call_passes_the_kernel_its_arguments(monkeypatch):
    """The GPU path's `jax_triton.triton_call` (which needs a GPU jaxlib) replaced by one that runs
    the kernel it is given in Triton's interpreter (`fake_jax_triton`: the call's arrays, outputs and
    constexprs must be the kernel's, in its order): the attention kernel, then the merge of its
    splits (float16: the GPU path multiplies in the dtype, which the interpreter cannot do for
    bfloat16)."""
    called = []

    def triton_call(*args, kernel, num_warps, num_stages, **rest):
        called.append((kernel.fn.__name__, num_warps, num_stages))
        return fake_jax_triton.triton_call(*args, kernel=kernel, num_warps=num_warps, num_stages=num_stages, **rest)

    monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(triton_call=triton_call))
    monkeypatch.setenv("JAXSPEC_ATTENTION_MERGE", "triton")
    case = CASES["tree"]
    q, k_pool, v_pool, table, cache_len, tree, active = case_inputs({**case, "dtype": jnp.float16})
    got = jax.jit(functools.partial(kernel_attention, **case["tuning"]))(
        q, k_pool, v_pool, table, cache_len, tree, active
    )
    assert called == [("_paged_attention", 4, 2), ("_merge_partials", 4, 1)]
    assert_close(got, exact(q, k_pool, v_pool, table, cache_len, tree, active), jnp.float16)


def test_calls_the_kernel_does_not_take_run_the_reference():
    """A head dim that is not a power of two, or more than 128 query rows per kv head, runs the
    reference under impl "triton"; the kernel itself names the problem."""
    q, k_pool, v_pool, table, cache_len, tree = inputs(1, jnp.bfloat16, 4, 33, [5, 20], [3, 4])
    assert not kernel_module.kernel_applies(q, k_pool, v_pool)  # 33 x 4 = 132 query rows
    got = paged_attention(q, k_pool, v_pool, table, cache_len, tree, impl="triton")
    np.testing.assert_array_equal(got, paged_attention(q, k_pool, v_pool, table, cache_len, tree, impl="xla"))
    q48, k48 = q[..., :48], k_pool[..., :48]
    assert not kernel_module.kernel_applies(q48[:, :1], k48, k48)
    with pytest.raises(ValueError, match="head dim must be a power of two"):
        kernel_module.paged_attention_partials(
            jnp.zeros((2, 2, 16, 48), jnp.bfloat16),
            k48,
            k48,
            table,
            cache_len,
            cache_len,
            jnp.zeros((2, 1, 16), jnp.int32),
            num_new=1,
        )


def test_more_rows_than_the_grid_launches_run_the_reference():
    """Rows go on the CUDA grid's second axis (at most 65535): more run the reference, and the
    kernel itself names the limit."""
    pool = jax.ShapeDtypeStruct((16, 16, 1, 16), jnp.bfloat16)

    def q(rows):
        return jax.ShapeDtypeStruct((rows, 1, 2, 16), jnp.bfloat16)

    most = kernel_module.MAX_ROWS
    assert kernel_module.kernel_applies(q(most), pool, pool)
    assert not kernel_module.kernel_applies(q(most + 1), pool, pool)
    rows = most + 1
    q_rows = jax.ShapeDtypeStruct((rows, 1, 16, 16), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((rows, 1), jnp.int32)
    lens = jax.ShapeDtypeStruct((rows,), jnp.int32)
    bits = jax.ShapeDtypeStruct((rows, 1, 16), jnp.int32)
    partials = functools.partial(kernel_module.paged_attention_partials, num_new=1)
    with pytest.raises(ValueError, match="at most 65535 rows"):
        jax.eval_shape(partials, q_rows, pool, pool, table, lens, lens, bits)


@pytest.mark.parametrize(
    "dtype, rows, head_dim, page, tuning",
    [
        (jnp.bfloat16, 16, 128, 16, dict()),
        (jnp.float16, 128, 128, 16, dict(block_kv=32)),
        (jnp.float32, 16, 64, 12, dict(block_kv=32, splits=3)),
        (jnp.bfloat16, 32, 128, None, dict()),  # a dense cache of 1152 positions: one page per row
        (jnp.bfloat16, 16, 64, 16, dict(heads_major=True)),
    ],
)
def test_the_kernel_compiles_for_hopper(dtype, rows, head_dim, page, tuning):
    """Triton compiles the kernel for sm90 on any machine, with the constexprs and the 16-byte
    alignment jax-triton gives it: its shapes, dtypes and operations are ones the compiler takes
    (the interpreter also runs e.g. a non-constexpr global or a dot smaller than 16)."""
    batch, kv_heads, num_pages, table_len, words = 4, 2, 40, 12, 2
    if page is None:  # `cache_attention`'s view of a dense cache [B, S, Nk, D]
        num_pages, page, table_len = batch, 1152, 1
    q = jax.ShapeDtypeStruct((batch, kv_heads, rows, head_dim), dtype)
    layout = (kv_heads, page) if tuning.get("heads_major") else (page, kv_heads)
    pool = jax.ShapeDtypeStruct((num_pages, *layout, head_dim), dtype)
    table = jax.ShapeDtypeStruct((batch, table_len), jnp.int32)
    bits = jax.ShapeDtypeStruct((batch, words, rows), jnp.int32)
    _, constants = kernel_module.launch(q, pool, table, bits, num_new=40, **tuning)
    pointee = {jnp.bfloat16: "bf16", jnp.float16: "fp16", jnp.float32: "fp32"}[dtype]
    pointers = ["*i32"] * 4 + [f"*{pointee}"] * 3 + ["*fp32"] * 3
    kernel = compiled(kernel_module._paged_attention)
    names = kernel.arg_names
    signature = {**dict(zip(names, pointers)), **{name: "constexpr" for name in constants}}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    options = dict(num_warps=kernel_module.default_num_warps(rows, head_dim), num_stages=2, enable_fp_fusion=True)
    binary = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    if dtype != jnp.float32:  # (float32 dots are exact: "ieee", on the CUDA cores)
        assert "mma" in binary.asm["ptx"]  # the 16-bit dots run on the tensor cores
    assert binary.metadata.shared <= 227 * 1024
