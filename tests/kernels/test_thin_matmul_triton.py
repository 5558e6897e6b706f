"""The thin-matmul kernel computes x @ w within its rounding, in each of its forms.

Triton's interpreter runs the kernel's own code on the CPU against the product in float64: a
decode-shaped call, verification rows over several row tiles, a K that is not a multiple of the K
block and an N that is not one of the N block (masked loads and stores), two contracted dims (the
attention output), a weight stored transposed (the tied LM head) with float32 logits, and the
SwiGLU form (gate and up from one stacked weight), and K split over programs (the sums added after
the kernel, the epilogue on them). A result must lie within one rounding of its
dtype plus the float32 accumulation's error, bounded by sum |x| |w|; a weight with one element moved
by 1% fails that comparison. The 16-bit cases run in float16 (Triton's interpreter converts float32
to bfloat16 by truncation); compiling the kernel for sm90 at the model's shapes checks that it is
valid Triton for Hopper, in bfloat16, with the tiles it launches with; those tiles, for a dense
weight, are the fastest of an H100's sweep of Qwen3-8B's projections.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton", reason="the Triton kernel's tests need the triton package (the test extra has it)")
pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")

from jaxspec.kernels import thin_matmul_triton as kernel  # noqa: E402
from tests.kernels.triton_compile import compile_for_hopper  # noqa: E402

UNIT = {jnp.float32: 2.0**-24, jnp.float16: 2.0**-11}  # half a unit in the last place, relative
ACCUMULATION = 2.0**-20  # float32 sums of up to a few hundred products, with margin, relative to sum |x| |w|

# name: dtype, x shape, w shape, contracted dims, tiles (None: the default)
CASES = {
    "decode-f16": (jnp.float16, (4, 1, 64), (64, 72), 1, None),
    "verify-f32": (jnp.float32, (3, 4, 96), (96, 40), 1, kernel.Tiles(16, 16, 32)),
    "row-tiles-f16": (jnp.float16, (40, 48), (48, 48), 1, kernel.Tiles(16, 32, 16, num_warps=2, num_stages=2)),
    "masked-k-f32": (jnp.float32, (2, 3, 70), (70, 33), 1, kernel.Tiles(16, 16, 32)),
    "attention-output-f16": (jnp.float16, (2, 1, 4, 24), (4, 24, 40), 2, None),
    "split-k-f32": (jnp.float32, (3, 4, 96), (96, 40), 1, kernel.Tiles(16, 16, 16, split_k=4)),
    "split-k-uneven-f16": (jnp.float16, (5, 70), (70, 33), 1, kernel.Tiles(16, 32, 16, split_k=3)),
}


def normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32).astype(dtype)


def exact(x, w, contract: int):
    """x @ w in float64 over the contracted dims, and sum |x| |w| (the accumulation's error scale)."""
    k = int(np.prod(w.shape[:contract]))
    x2, w2 = np.float64(x).reshape(-1, k), np.float64(w).reshape(k, -1)
    shape = (*x.shape[: x.ndim - contract], *w.shape[contract:])
    return (x2 @ w2).reshape(shape), (np.abs(x2) @ np.abs(w2)).reshape(shape)


def assert_within_rounding(got, want, scale, dtype, roundings: int = 1):
    err = np.abs(np.float64(got) - want)
    bound = roundings * UNIT[dtype] * np.abs(want) + ACCUMULATION * scale + 1e-30
    assert np.all(err <= bound), f"largest error {np.max(err / bound):.2f} x the bound"


@pytest.mark.parametrize("name", CASES)
def test_the_kernel_computes_the_product(name):
    dtype, x_shape, w_shape, contract, tiles = CASES[name]
    rng = np.random.default_rng(0)
    x, w = normal(rng, x_shape, dtype), normal(rng, w_shape, dtype, 0.3)
    got = kernel.thin_matmul(x, w, contract=contract, tiles=tiles, interpret=True)
    assert got.shape == (*x_shape[: len(x_shape) - contract], *w_shape[contract:]) and got.dtype == dtype
    assert_within_rounding(got, *exact(x, w, contract), dtype)


def test_a_changed_weight_fails_the_comparison():
    """The control: the product with one weight element moved by 1% is outside the bound."""
    dtype, x_shape, w_shape, contract, tiles = CASES["verify-f32"]
    rng = np.random.default_rng(0)
    x, w = normal(rng, x_shape, dtype), normal(rng, w_shape, dtype, 0.3)
    got = kernel.thin_matmul(x, w, contract=contract, tiles=tiles, interpret=True)
    with pytest.raises(AssertionError, match="largest error"):
        assert_within_rounding(got, *exact(x, w.at[17, 5].multiply(1.01), contract), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_a_transposed_weight_gives_float32_logits(dtype):
    """The tied embedding [V, H] as the LM head: read through its strides, no copy; float32 out."""
    rng = np.random.default_rng(1)
    h, embed = normal(rng, (2, 3, 48), dtype), normal(rng, (53, 48), dtype, 0.3)
    got = kernel.thin_matmul(h, embed, transpose=True, out_dtype=jnp.float32, interpret=True)
    assert got.shape == (2, 3, 53) and got.dtype == jnp.float32
    assert_within_rounding(got, *exact(h, np.float64(embed).T, 1), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_the_swiglu_form_rounds_as_the_model(dtype):
    """silu(x @ gate) * (x @ up) from gate_up [K, 2, F]: each projection rounded to the dtype, the
    silu rounded, then the product, as `jaxspec.models.blocks.dense_mlp` computes it. Against float64
    with the same three roundings, a projection that lands on the other side of a rounding boundary
    moves the result by at most about two units."""
    rng = np.random.default_rng(2)
    x, gate_up = normal(rng, (3, 2, 64), dtype), normal(rng, (64, 2, 40), dtype, 0.3)
    got = kernel.thin_matmul(x, gate_up, swiglu=True, tiles=kernel.Tiles(16, 16, 32), interpret=True)
    assert got.shape == (3, 2, 40) and got.dtype == dtype
    both, scale = exact(x, gate_up, 1)
    gate, up = (np.float64(np.asarray(both[..., i, :], dtype)) for i in (0, 1))
    silu = np.float64(np.asarray(gate / (1 + np.exp(-gate)), dtype))
    want = silu * up
    bound = 4 * UNIT[dtype] * np.abs(want) + 4 * ACCUMULATION * scale.max(axis=-2) * (np.abs(up) + np.abs(silu))
    np.testing.assert_array_less(np.abs(np.float64(got) - want), bound + 1e-30)
    wrong = kernel.thin_matmul(x, gate_up.at[:, 1].set(gate_up[:, 0]), swiglu=True, interpret=True)
    assert np.any(np.abs(np.float64(wrong) - want) > bound)  # the control: gate read as up
    split = kernel.thin_matmul(x, gate_up, swiglu=True, tiles=kernel.Tiles(16, 16, 16, split_k=3), interpret=True)
    assert split.dtype == dtype
    np.testing.assert_array_less(np.abs(np.float64(split) - want), bound + 1e-30)  # the epilogue after the sum


def test_bad_inputs_raise():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="must share one dtype"):
        kernel.thin_matmul(x, jnp.ones((8, 4), jnp.float16), interpret=True)
    with pytest.raises(ValueError, match="at most 256 rows"):
        kernel.thin_matmul(jnp.ones((300, 8)), jnp.ones((8, 4)), interpret=True)
    with pytest.raises(ValueError, match=r"contracts 1 dims"):
        kernel.thin_matmul(x, jnp.ones((6, 4)), interpret=True)
    with pytest.raises(ValueError, match=r"swiglu takes w \[K, 2, F\]"):
        kernel.thin_matmul(x, jnp.ones((8, 3, 4)), swiglu=True, interpret=True)
    with pytest.raises(ValueError, match=r"transpose takes w \[N, K\]"):
        kernel.thin_matmul(x, jnp.ones((8, 4)), transpose=True, interpret=True)
    assert not kernel.kernel_applies(jnp.ones((300, 8)), jnp.ones((8, 4)))
    assert kernel.kernel_applies(jnp.ones((3, 1, 4, 8)), jnp.ones((4, 8, 16)), contract=2)


def test_split_k_sums_each_element_once():
    """K split over programs: every K element in exactly one split (K_PER_SPLIT a multiple of the K
    block, the last split short or empty), so the split sums add to the whole product."""
    for k, block_k, split in ((2048, 256, 4), (70, 32, 2), (48, 16, 4), (4096, 512, 3)):
        tiles = kernel.Tiles(16, 16, block_k, split_k=split)
        per = kernel.launch_constants(16, k, 16, (16, 1), tiles=tiles, dtype=jnp.bfloat16)["K_PER_SPLIT"]
        covered = np.concatenate([np.arange(s * per, min((s + 1) * per, k)) for s in range(split)])
        np.testing.assert_array_equal(covered, np.arange(k))
        assert per % block_k == 0


# rows, K, N, swiglu, transposed: the fused q/k/v, attention output, gate/up, down, tied LM head
HOPPER_SHAPES = [
    (1, 2048, 4096, False, False),
    (8, 2048, 2048, False, False),
    (32, 2048, 6144, True, False),
    (128, 6144, 2048, False, False),
    (64, 4096, 12288, True, False),
    (256, 12288, 4096, False, False),
    (4, 2048, 151936, False, True),
]


@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("rows, k, n, swiglu, transposed", HOPPER_SHAPES)
def test_the_kernel_compiles_for_hopper(rows, k, n, swiglu, transposed, split_k):
    """Triton compiles the kernel for sm90 in bfloat16 at the model's shapes with the tiles it
    launches with, and with K split over 4 programs (the interpreter runs some operations the GPU
    compiler rejects), within a Hopper block's shared memory."""
    tiles = kernel.default_tiles(rows, k, n, swiglu=swiglu)._replace(split_k=split_k)
    strides = (1, k) if transposed else ((2 if swiglu else 1) * n, 1)
    constants = kernel.launch_constants(
        rows, k, n, strides, tiles=tiles, dtype=jnp.bfloat16, up_offset=n if swiglu else 0, swiglu=swiglu
    )
    out = jnp.float32 if transposed or split_k > 1 else jnp.bfloat16
    binary = compile_for_hopper(
        kernel._thin_matmul,
        [jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, jnp.int32, jnp.int32, jnp.int32, jnp.int32, out],
        constants,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    assert binary.metadata.shared <= 227 * 1024
    jax.clear_caches()


SWEEP = Path(__file__).parents[2] / "benchmarks/results/ww_h100/projections_sweep.json"
SHAPES_8B = {  # Qwen3-8B's projections: (K, N, swiglu)
    "qkv": (4096, 6144, False),
    "o": (4096, 4096, False),
    "gate_up_swiglu": (4096, 12288, True),
    "down": (12288, 4096, False),
}


def test_the_dense_tiles_are_the_sweeps_fastest():
    """For each of Qwen3-8B's projections at 1 and 16 rows, the default tiles take within 3% of the
    fastest 4-warp 4-stage tiles of an H100's sweep (`bench projections --sweep`); the rule the
    tiles had before (every SM a program, 16 KiB blocks) was 5-39% off it, so this fails for it."""
    rows = json.loads(SWEEP.read_text())["rows"]
    assert {(r["projection"], r["rows"]) for r in rows} == {(p, m) for p in SHAPES_8B for m in (1, 16)}
    for row in rows:
        k, n, swiglu = SHAPES_8B[row["projection"]]
        swept = {key: us for key, us in row["swept_us"].items() if key.split("x")[3:5] == ["4", "4"]}
        tiles = "x".join(map(str, kernel.default_tiles(row["rows"], k, n, swiglu=swiglu)))
        assert swept[tiles] <= 1.03 * min(swept.values()), (row["projection"], row["rows"], tiles)
