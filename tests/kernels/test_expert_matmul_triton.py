"""The thin matmul's grouped form computes each row's expert product within its rounding.

Triton's interpreter runs the kernel's own code on the CPU against float64: rows sorted by expert
(one expert with more rows than a row block, one with none), each row's token gathered from its
assignment, gate and up with the SwiGLU, then the down projection written back in token order
times each row's routing weight; two experts' weights exchanged must fail the comparison. The
default tiles give the touched experts of Qwen3-30B-A3B every SM, and the kernel compiles for
sm90 at its shapes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton", reason="the Triton kernel's tests need the triton package (the test extra has it)")
pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")

from jaxspec.kernels import expert_matmul_triton as expert_kernel  # noqa: E402
from jaxspec.kernels import thin_matmul_triton as kernel  # noqa: E402
from tests.kernels.test_thin_matmul_triton import ACCUMULATION, UNIT, assert_within_rounding, normal  # noqa: E402
from tests.kernels.triton_compile import compile_for_hopper  # noqa: E402


def routed(rng, tokens: int, experts: int, top_k: int):
    """A routing that leaves expert 1 empty and sends every token to expert 0 (more rows than one
    BLOCK_M of 16 once tokens > 16): (each sorted row's expert [R], each sorted row's token-major
    assignment n * top_k + j [R])."""
    picks = np.stack([np.r_[0, rng.choice(np.arange(2, experts), top_k - 1, replace=False)] for _ in range(tokens)])
    flat = picks.reshape(-1)
    order = np.argsort(flat, kind="stable")
    return flat[order], order


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_the_expert_form_computes_each_rows_experts_product(dtype):
    """`expert_matmul` over rows sorted by expert: each row's token gathered (its assignment over
    top_k), its expert's gate and up with the SwiGLU (rounded as the dense form), then the down
    projection written back in token-major order times its routing weight (rounded once more),
    against float64 with the same roundings; an expert with 18 rows runs two row blocks, an empty
    one reads nothing. The control: two experts' weights exchanged."""
    rng = np.random.default_rng(3)
    tokens, experts, top_k, k, f, n = 18, 5, 2, 40, 24, 36
    expert_of, order = routed(rng, tokens, experts, top_k)
    x = normal(rng, (tokens, k), dtype)
    gate, up = normal(rng, (experts, k, f), dtype, 0.3), normal(rng, (experts, k, f), dtype, 0.3)
    down, factor = normal(rng, (experts, f, n), dtype, 0.3), jnp.asarray(rng.random(len(order)), dtype)
    tiles, ids, order = kernel.Tiles(16, 16, 16), jnp.asarray(expert_of), jnp.asarray(order)
    act = expert_kernel.expert_matmul(x, gate, ids, source=order, repeat=top_k, up=up, tiles=tiles, interpret=True)
    out = expert_kernel.expert_matmul(act, down, ids, dest=order, scale=factor, tiles=tiles, interpret=True)
    assert act.shape == (len(order), f) and out.shape == (len(order), n) and out.dtype == dtype

    def rounded(v):
        return np.float64(np.asarray(v, dtype))

    rows = np.float64(x)[np.asarray(order) // top_k]
    g = rounded(np.einsum("rk,rkf->rf", rows, np.float64(gate)[expert_of]))
    u = rounded(np.einsum("rk,rkf->rf", rows, np.float64(up)[expert_of]))
    want_act = rounded(rounded(g / (1 + np.exp(-g))) * u)
    scale = np.einsum("rk,rkf->rf", np.abs(rows), np.abs(np.float64(gate)[expert_of]))
    bound = 4 * UNIT[dtype] * np.abs(want_act) + 4 * ACCUMULATION * scale.max() * (np.abs(u) + 1)
    np.testing.assert_array_less(np.abs(np.float64(act) - want_act), bound + 1e-30)
    product, product_scale = (
        np.einsum("rf,rfn->rn", op(np.float64(act)), op(np.float64(down))[expert_of]) for op in (np.array, np.abs)
    )
    want, want_scale = np.empty_like(product), np.empty_like(product)  # in token-major order
    want[np.asarray(order)] = rounded(product) * np.float64(factor)[np.asarray(order)][:, None]
    want_scale[np.asarray(order)] = product_scale * np.float64(factor)[np.asarray(order)][:, None]
    assert_within_rounding(out, want, want_scale, dtype, roundings=2)  # the product's, then the factor's
    swapped = expert_kernel.expert_matmul(
        act, down[jnp.asarray([2, 1, 0, 3, 4])], ids, dest=order, scale=factor, interpret=True
    )
    with pytest.raises(AssertionError, match="largest error"):
        assert_within_rounding(swapped, want, want_scale, dtype, roundings=2)


def test_the_expert_tiles_give_the_touched_experts_the_card():
    """At Qwen3-30B-A3B's experts (128 of H 2048 x I 768, top-8) and 1-256 tokens: the touched
    experts' programs fill every SM unless N is at its finest tiles, BLOCK_M holds a mean expert's
    rows up to 64, the pipeline fits SHARED_BYTES."""
    for tokens in (1, 8, 64, 256):
        rows = 8 * tokens
        for k, n, swiglu in ((2048, 768, True), (768, 2048, False)):
            tiles = kernel.default_tiles(rows, k, n, swiglu=swiglu, groups=128)
            touched = min(128, rows)
            assert touched * -(-n // tiles.block_n) >= kernel.SMS or tiles.block_n == 16, (tokens, tiles)
            assert tiles.block_m >= min(64, -(-rows // touched)) and tiles.block_m <= 64
            assert kernel.shared_bytes(tiles, 2, swiglu=swiglu) <= kernel.SHARED_BYTES


def test_bad_inputs_raise():
    x = jnp.ones((2, 8), jnp.float32)
    ids = jnp.asarray([0, 1], jnp.int32)
    with pytest.raises(ValueError, match=r"needs x \[X, K\], w \[E, K, N\], experts \[R\]"):
        expert_kernel.expert_matmul(x, jnp.ones((2, 6, 4)), ids, interpret=True)
    with pytest.raises(ValueError, match=r"up float16 \[2, 8, 4\] must match w"):
        expert_kernel.expert_matmul(x, jnp.ones((2, 8, 4)), ids, up=jnp.ones((2, 8, 4), jnp.float16), interpret=True)
    with pytest.raises(ValueError, match=r"dest must be \[R=2\]"):
        expert_kernel.expert_matmul(x, jnp.ones((2, 8, 4)), ids, dest=jnp.arange(3), interpret=True)
    with pytest.raises(ValueError, match="must not split K"):
        expert_kernel.expert_matmul(
            x, jnp.ones((2, 8, 4)), ids, tiles=kernel.Tiles(16, 16, 16, split_k=2), interpret=True
        )
    with pytest.raises(ValueError, match=r"scale must be \[R=2\]"):
        expert_kernel.expert_matmul(x, jnp.ones((2, 8, 4)), ids, scale=jnp.ones(3), interpret=True)


@pytest.mark.parametrize("tokens, swiglu", [(1, True), (64, True), (64, False), (256, False)])
def test_the_expert_form_compiles_for_hopper(tokens, swiglu):
    """The expert form at Qwen3-30B-A3B's experts (128, H 2048, I 768, top-8): gate and up with the
    gathered rows, or down written in token order with the routing factor, compiled for sm90 in
    bfloat16 with its tiles."""
    rows, (k, n) = 8 * tokens, ((2048, 768) if swiglu else (768, 2048))
    tiles = kernel.default_tiles(rows, k, n, swiglu=swiglu, groups=128)
    constants = kernel.launch_constants(
        rows,
        k,
        n,
        (n, 1),
        tiles=tiles,
        dtype=jnp.bfloat16,
        swiglu=swiglu,
        group_stride=k * n,
        gather=swiglu,
        repeat=8,
        scatter=not swiglu,
        scale=not swiglu,
    )
    binary = compile_for_hopper(
        kernel._thin_matmul,
        [jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, jnp.int32, jnp.int32, jnp.int32, jnp.bfloat16, jnp.bfloat16],
        constants,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    assert binary.metadata.shared <= 227 * 1024
    jax.clear_caches()
