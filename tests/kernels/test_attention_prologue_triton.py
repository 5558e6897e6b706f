"""The attention-prologue kernel computes its jnp reference, which is the model's own pieces.

Triton's interpreter runs the kernel's own code on the CPU: the bias, the q and k norms, rope,
the query rows' layout and padding, and the new keys and values written through the page table
(shuffled pages, a position on a page boundary, one with no page and one past the table, both
dropped; a dense cache as one page per row). Each case is compared with
`attention_prologue_reference`: the pools bit for bit where nothing was written, and the written
keys and values and the query rows within one rounding of their dtype (the kernel and XLA may fuse
the rope's multiply-add differently). A page table with one entry moved fails that comparison.
The 16-bit cases run in float16: Triton's interpreter converts float32 to bfloat16 by truncation
(1 + 2^-8 + 2^-10 becomes 1, where a GPU and XLA round it to 1 + 2^-7), so its bfloat16 results
drift by several units in the last place over the kernel's roundings. Compiling the kernel for
sm90 (Triton's own compiler, as jax-triton runs it on a GPU) checks, in bfloat16 too, that it is
valid Triton for Hopper.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton", reason="the Triton kernel's tests need the triton package (the test extra has it)")
pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")

from jaxspec.kernels import attention_prologue_triton as prologue  # noqa: E402
from jaxspec.models.attention_prologue import attention_prologue_reference  # noqa: E402
from jaxspec.models.paged import NO_PAGE  # noqa: E402
from tests.kernels import fake_jax_triton  # noqa: E402
from tests.kernels.triton_compile import compile_for_hopper  # noqa: E402

ROUNDING = {jnp.float32: 2.0**-20, jnp.float16: 2.0**-10}  # relative: one rounding in the dtype, with margin

# name: dtype, batch, new tokens, kv heads, group, head dim, bias, qk norm, dense (one page per row)
CASES = {
    "qwen3-decode": (jnp.float16, 4, 1, 2, 4, 32, False, True, False),
    "qwen2-tree": (jnp.float32, 3, 3, 2, 3, 16, True, False, False),
    "both-16bit": (jnp.float16, 2, 2, 1, 2, 64, True, True, False),
    "dense": (jnp.float32, 3, 2, 2, 2, 16, False, True, True),
}
PAGE, PAGES_PER_ROW, NUM_PAGES = 4, 3, 16


def case_inputs(name: str, seed: int = 0):
    dtype, b, t, nk, group, d, bias, qk_norm, dense = CASES[name]
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32).astype(dtype)

    proj = normal(b, t, nk, group + 2, d)
    if dense:  # [B, S, Nk, D] as B pages of S positions, the last row past S
        seq = 6
        pools = [normal(b, seq, nk, d) for _ in "kv"]
        table = jnp.arange(b, dtype=jnp.int32)[:, None]
        cache_len = jnp.asarray([0, 3, seq - 1][:b], jnp.int32)
    else:  # shuffled pages; row 0 on a page boundary, row 1 onto a position with no page, row 2 past its table
        pools = [normal(NUM_PAGES, PAGE, nk, d) for _ in "kv"]
        table = jnp.asarray(rng.permutation(NUM_PAGES)[: b * PAGES_PER_ROW].reshape(b, PAGES_PER_ROW), jnp.int32)
        table = table.at[1, 2].set(NO_PAGE)
        cache_len = jnp.asarray([PAGE - 1, 2 * PAGE, PAGES_PER_ROW * PAGE - 1, 1][:b], jnp.int32)
    positions = cache_len[:, None] + jnp.arange(t)[None, :]
    angles = positions[..., None].astype(jnp.float32) * (0.3 / (1 + jnp.arange(d // 2)))
    angles = jnp.concatenate([angles, angles], axis=-1)
    return dict(
        proj=proj,
        bias=normal(nk, group + 2, d, scale=0.5) if bias else None,
        q_norm=1 + normal(d, scale=0.3) if qk_norm else None,
        k_norm=1 + normal(d, scale=0.3) if qk_norm else None,
        cos=jnp.cos(angles),
        sin=jnp.sin(angles),
        cache_len=cache_len,
        page_table=table,
        k_pool=pools[0],
        v_pool=pools[1],
    ), dict(rows=max(16, 1 << (t * group - 1).bit_length()), eps=1e-6)


def assert_matches(got, want, before, dtype):
    q_rows, k_pool, v_pool = got
    want_q, want_k, want_v = want
    tol = ROUNDING[dtype]
    np.testing.assert_allclose(np.float32(q_rows), np.float32(want_q), rtol=tol, atol=tol)
    for pool, want_pool, old in ((k_pool, want_k, before[0]), (v_pool, want_v, before[1])):
        written = np.any(np.asarray(want_pool != old), axis=(-2, -1))
        np.testing.assert_array_equal(np.asarray(pool)[~written], np.asarray(want_pool)[~written])
        np.testing.assert_allclose(np.float32(pool[written]), np.float32(want_pool[written]), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", CASES)
def test_the_kernel_computes_the_reference(name):
    args, settings = case_inputs(name)
    want = jax.jit(functools.partial(attention_prologue_reference, **settings))(**args)
    got = prologue.attention_prologue(**args, **settings, interpret=True)
    assert_matches(got, want, (args["k_pool"], args["v_pool"]), CASES[name][0])
    dtype, b, t, nk, group, *_ = CASES[name]
    assert not np.any(np.asarray(got[0][:, :, t * group :])), "padding rows are zeros"
    written = np.any(np.asarray(got[1] != args["k_pool"]), axis=(-2, -1)).sum()
    assert 0 < written <= b * t


@pytest.mark.parametrize("version", ["0.3", "0.4"])
def test_the_gpu_call_updates_the_pools_in_place_under_either_jax_triton(monkeypatch, version):
    """The GPU path, through jax-triton's stand-in (`fake_jax_triton`, the kernel in the interpreter)
    with 0.3's call (the pools passed as arguments and again as aliased outputs) and 0.4's (the
    pools passed once, as Refs, their outputs' parameters given a 0): the reference's pools and
    query rows, under jit, with the pools' other positions kept."""
    fake_jax_triton.install(monkeypatch, version)
    jax.clear_caches()  # traced afresh: the kernel's jit would keep the other version's call
    args, settings = case_inputs("qwen2-tree")
    want = attention_prologue_reference(**args, **settings)
    got = jax.jit(functools.partial(prologue.attention_prologue, **settings))(**args)
    assert_matches(got, want, (args["k_pool"], args["v_pool"]), CASES["qwen2-tree"][0])
    assert np.any(np.asarray(got[1] != args["k_pool"])), "the pool was written"


def test_a_moved_page_fails_the_comparison():
    """The control: the reference with one table entry pointing at another page disagrees."""
    args, settings = case_inputs("qwen2-tree")
    got = prologue.attention_prologue(**args, **settings, interpret=True)
    moved = {**args, "page_table": args["page_table"].at[0, 1].set(args["page_table"][2, 0])}
    want = attention_prologue_reference(**moved, **settings)
    with pytest.raises(AssertionError):
        assert_matches(got, want, (args["k_pool"], args["v_pool"]), jnp.float32)


def test_rows_too_few_for_the_new_tokens_raise():
    args, settings = case_inputs("qwen2-tree")
    with pytest.raises(ValueError, match=r"rows \(8\) must be a power of two >= T x G = 9"):
        prologue.attention_prologue(**args, rows=8, eps=1e-6, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", ["qwen3-decode", "both-16bit"])
def test_the_kernel_compiles_for_hopper(name, dtype):
    """Triton compiles the kernel for sm90 with the constexprs `launch` gives (the interpreter runs
    some operations the GPU compiler rejects)."""
    args, settings = case_inputs(name)
    _, constants = prologue.launch(
        args["proj"], args["page_table"], args["k_pool"], **settings, has_bias=CASES[name][6], qk_norm=CASES[name][7]
    )
    pointers = [dtype] * 4 + [jnp.float32, jnp.float32, jnp.int32, jnp.int32] + [dtype] * 5
    compile_for_hopper(prologue._attention_prologue, pointers, constants, num_stages=1)
