"""The grouped-matmul Triton kernels (`jaxspec.kernels.grouped_matmul`), run in Triton's interpreter,
equal `jax.lax.ragged_dot` and its gradients: the forward kernel, the same kernel on transposed
weights (dX) and the grouped x.T @ dY kernel (dW), on ragged groups with empty ones (also inside a
tile's range of groups), row tiles straddling groups, partial row, K and N tiles, rows past
sum(group_sizes) (0, in every output) and whole tiles past them, never multiplying an expert no
row picks or a row past the groups (NaN there stays out); bfloat16 within one rounding of
the exact product. float32 operands multiply exactly, so the tolerance is float32 summation
(`FP32_TOL`). Negative controls: group boundaries shifted by one row, and a kernel that skips the
last group of a straddling tile, fail the comparison. Each kernel compiles for sm90 on the CPU
(Triton's own compiler down to a cubin, as jax-triton does on a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton", reason="the Triton kernels' tests need the triton package (the test extra has it)")
pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")

from jaxspec.kernels import grouped_matmul as gm  # noqa: E402
from jaxspec.kernels.grouped_matmul import (  # noqa: E402
    grouped_matmul_triton,
    grouped_transposed_matmul_triton,
    tile_groups,
    tile_rows,
)
from tests.kernels.triton_compile import compile_for_hopper  # noqa: E402

FP32_TOL = 1e-5  # relative to max |want|: float32 sums of <= 40 products (observed ~3e-7)
BF16_ROUNDING = 2.0**-8  # one rounding to bfloat16, relative to the value

# name: (group sizes, rows, K, N, tiles). Row tiles of 16 unless said.
CASES = {
    # rows [0,5) [5,5) [5,25) [25,28) [28,28) [28,37), 3 rows past them; tile 0 holds groups 0..2
    # (1 empty), tile 1 groups 2..5 (4 empty); 2 column tiles of 16 for N=20, 3 K tiles for K=40
    "ragged": ([5, 0, 20, 3, 0, 9], 40, 40, 20, dict(block_n=16, block_k=16)),
    # decode-like: 12 experts of 0-3 rows, several per tile
    "small_groups": ([2, 0, 3, 1, 0, 0, 3, 2, 1, 3, 0, 2], 17, 24, 16, {}),
    # 10 rows of 48: tiles 1 and 2 hold no row
    "tiles_past_the_rows": ([0, 4, 6], 48, 16, 24, {}),
    "one_of_four": ([0, 37, 0, 0], 37, 32, 24, dict(block_m=32)),
}


def operands(sizes, rows: int, k: int, n: int, dtype=jnp.float32, seed: int = 0):
    kx, kw, ky = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (rows, k)).astype(dtype)
    w = jax.random.normal(kw, (len(sizes), k, n)).astype(dtype)
    dy = jax.random.normal(ky, (rows, n)).astype(dtype)
    return x, w, dy, jnp.asarray(sizes, jnp.int32)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / np.abs(want).max())


def ragged_dot_and_grads(x, w, dy, sizes):
    """ragged_dot(x, w) and the cotangents (dX, dW) of dy, by XLA."""
    out, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w)
    return (out, *vjp(dy))


def kernels(x, w, dy, sizes, **tiles):
    """The forward, dX and dW kernels in the interpreter (dW with the forward's block_m)."""
    out = grouped_matmul_triton(x, w, sizes, interpret=True, **tiles)
    dx = grouped_matmul_triton(dy, w, sizes, transpose_w=True, interpret=True, **tiles)  # dY @ w[g].T
    dw = grouped_transposed_matmul_triton(x, dy, sizes, interpret=True, **{"block_m": 16, **tiles})
    return out, dx, dw


@pytest.mark.parametrize("name", list(CASES))
def test_forward_dx_and_dw_equal_ragged_dot_and_its_gradients(name):
    """The kernels' operands hold NaN in the experts no row picks and in the rows past the groups:
    the kernels never multiply them (one NaN would spread through its output tile)."""
    sizes, rows, k, n, tiles = CASES[name]
    x, w, dy, group_sizes = operands(sizes, rows, k, n)
    unused = (np.arange(rows) >= sum(sizes))[:, None]
    empty = (np.asarray(sizes) == 0)[:, None, None]
    poisoned = jnp.where(unused, jnp.nan, x), jnp.where(empty, jnp.nan, w), jnp.where(unused, jnp.nan, dy)
    got = kernels(*poisoned, group_sizes, **tiles)
    want = ragged_dot_and_grads(x, w, dy, group_sizes)
    for what, g, r in zip(("out", "dx", "dw"), got, want, strict=True):
        assert g.shape == r.shape and g.dtype == jnp.float32, what
        assert rel_err(g, r) < FP32_TOL, what
    used = sum(sizes)
    np.testing.assert_array_equal(got[0][used:], 0.0)  # rows past the groups
    np.testing.assert_array_equal(got[1][used:], 0.0)
    np.testing.assert_array_equal(got[2][np.asarray(sizes) == 0], 0.0)  # an empty group's dW


def test_a_single_group_is_a_plain_matmul():
    x, w, _, sizes = operands([0, 37, 0, 0], 37, 32, 24)
    assert rel_err(grouped_matmul_triton(x, w, sizes, interpret=True), x @ w[1]) < FP32_TOL


def test_bf16_rounds_once_like_ragged_dot():
    """bf16 in, bf16 out, float32 accumulation: each output within one bf16 rounding of the exact
    product (the dW of 20-row groups too)."""
    x, w, dy, sizes = operands([10, 0, 20, 30], 64, 64, 32, jnp.bfloat16, seed=5)
    got = kernels(x, w, dy, sizes)
    exact = ragged_dot_and_grads(*(a.astype(jnp.float32) for a in (x, w, dy)), sizes)
    for what, g, e in zip(("out", "dx", "dw"), got, exact, strict=True):
        e = np.asarray(e)
        assert g.dtype == jnp.bfloat16, what
        assert np.all(np.abs(np.asarray(g, np.float32) - e) <= BF16_ROUNDING * np.abs(e) + 1e-6), what


@pytest.mark.parametrize("kernel", ["out", "dx", "dw"])
def test_a_group_boundary_off_by_one_row_is_caught(kernel):
    """Negative control: the kernels given group sizes with one row of group 2 moved to group 3
    differ from ragged_dot of the true sizes by far more than FP32_TOL."""
    sizes, rows, k, n, tiles = CASES["ragged"]
    x, w, dy, group_sizes = operands(sizes, rows, k, n)
    shifted = group_sizes.at[2].add(-1).at[3].add(1)
    got = dict(zip(("out", "dx", "dw"), kernels(x, w, dy, shifted, **tiles)))
    want = dict(zip(("out", "dx", "dw"), ragged_dot_and_grads(x, w, dy, group_sizes)))
    assert rel_err(got[kernel], want[kernel]) > 100 * FP32_TOL


def test_a_kernel_that_skips_a_straddled_group_is_caught(monkeypatch):
    """Negative control: tile_groups naming one group fewer per tile (the last group a tile's rows
    reach) leaves those rows 0 and fails the comparison."""
    sizes, rows, k, n, tiles = CASES["ragged"]
    x, w, _, group_sizes = operands(sizes, rows, k, n)
    monkeypatch.setattr(gm, "tile_groups", lambda *a: (lambda first, last: (first, last - 1))(*tile_groups(*a)))
    got = grouped_matmul_triton.__wrapped__(x, w, group_sizes, interpret=True, **tiles)  # traced afresh
    assert rel_err(got, jax.lax.ragged_dot(x, w, group_sizes)) > 0.1


def test_tile_groups_names_the_groups_each_tile_holds():
    sizes = jnp.asarray([5, 0, 20, 3, 0], jnp.int32)  # rows [0,5) [5,5) [5,25) [25,28)
    first, last = tile_groups(sizes, 3, 16)  # tiles [0,16) [16,32) [32,48)
    np.testing.assert_array_equal(first, [0, 2, 5])
    np.testing.assert_array_equal(last, [2, 3, 4])  # tile 2 holds no row: last < first


def test_tile_groups_has_no_loop():
    """The tile tables are one fused comparison, not a binary search: a GPU runs each iteration of
    its loop as its own launches, twice per grouped matmul. Random sizes against numpy's search
    of the same tables."""
    sizes = jnp.asarray(np.random.default_rng(0).integers(0, 9, 128), jnp.int32)
    assert "while" not in jax.jit(lambda s: tile_groups(s, 40, 16)).lower(sizes).as_text()
    first, last = tile_groups(sizes, 40, 16)
    ends = np.cumsum(np.asarray(sizes))
    for i in range(40):
        rows = np.arange(i * 16, min((i + 1) * 16, ends[-1]))
        groups = np.searchsorted(ends, rows, side="right")
        assert (first[i], last[i]) == ((groups[0], groups[-1]) if rows.size else (first[i], first[i] - 1)), i


def test_tile_rows_follows_the_mean_group_size():
    assert tile_rows(64 * 8, 128) == 16 and tile_rows(1024 * 8, 128) == 64 and tile_rows(32768, 16) == 128


def test_bad_operands_are_refused():
    x, w, dy, sizes = operands([4, 4], 8, 16, 16)
    with pytest.raises(ValueError, match="one dtype"):
        grouped_matmul_triton(x, w.astype(jnp.bfloat16), sizes, interpret=True)
    with pytest.raises(ValueError, match=r"w \[E, K, N\]"):
        grouped_matmul_triton(x, w[:, :8], sizes, interpret=True)
    with pytest.raises(ValueError, match=r"group_sizes \[E=2\]"):
        grouped_matmul_triton(x, w, sizes[:1], interpret=True)
    with pytest.raises(ValueError, match="block_m must be a power of 2"):
        grouped_matmul_triton(x, w, sizes, interpret=True, block_m=24)
    with pytest.raises(ValueError, match=r"takes \['bfloat16', 'float16', 'float32'\], got int32"):
        grouped_matmul_triton(x.astype(jnp.int32), w.astype(jnp.int32), sizes, interpret=True)
    with pytest.raises(ValueError, match=r"y \[M, N\]"):
        grouped_transposed_matmul_triton(x, dy[:4], sizes, interpret=True)


BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32


@pytest.mark.parametrize(
    "kernel, dtype, shape, tiles",
    [
        ("out", BF16, (128, 512, 2048, 768), {}),  # Qwen3-30B-A3B's gate/up at a decode step: 16-row tiles
        ("dx", BF16, (16, 32768, 1024, 1536), {}),  # small_moe's dX of a long batch: 128-row tiles
        ("dw", BF16, (128, 2048, 768, 2048), {}),
        ("out", F32, (8, 96, 40, 20), dict(block_n=16, block_k=16)),  # partial K and N tiles
        ("dw", F32, (8, 96, 40, 20), dict(block_n=16, block_k=16)),
    ],
)
def test_the_kernels_compile_for_hopper(kernel, dtype, shape, tiles):
    """Triton compiles each kernel for sm90 on any machine, with the constexprs `launch` gives and
    jax-triton's 16-byte alignment: its shapes, dtypes and operations are ones the GPU compiler
    takes (the interpreter runs some it rejects); the 16-bit dots run on the tensor cores."""
    e, rows, k, n = shape
    x = jax.ShapeDtypeStruct((rows, k), dtype)
    if kernel == "dw":
        _, constants = gm.launch_transposed(x, jax.ShapeDtypeStruct((rows, n), dtype), e, **tiles)
        binary = compile_for_hopper(gm._grouped_transposed_matmul, [I32, dtype, dtype, dtype], constants)
    else:
        w = jax.ShapeDtypeStruct((e, n, k) if kernel == "dx" else (e, k, n), dtype)
        _, constants = gm.launch(x, w, transpose_w=kernel == "dx", **tiles)
        binary = compile_for_hopper(gm._grouped_matmul, [I32, I32, dtype, dtype, dtype], constants)
    if dtype != F32:  # (float32 dots are exact: "ieee", on the CUDA cores)
        assert "mma" in binary.asm["ptx"]
    assert binary.metadata.shared <= 227 * 1024
