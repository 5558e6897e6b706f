"""The grouped-matmul kernels (interpret mode) equal `jax.lax.ragged_dot` and a per-group
reference for any group sizes: empty groups, one group, groups straddling row tiles, rows past the
last group, bf16 inputs; the transposed-weight and x.T @ y variants of a gradient too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels.grouped_matmul import (
    grouped_matmul_pallas,
    grouped_transposed_matmul_pallas,
    tile_groups,
    tile_rows,
)

FP32_TOL = 1e-5  # relative to max |out|


def operands(sizes, rows: int, k: int, n: int, dtype=jnp.float32, seed: int = 0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (rows, k)).astype(dtype)
    w = jax.random.normal(kw, (len(sizes), k, n)).astype(dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / np.abs(want).max())


def random_sizes(groups: int, rows: int, seed: int) -> np.ndarray:
    """Random sizes summing to `rows`, about a third of the groups empty."""
    rng = np.random.default_rng(seed)
    weights = rng.random(groups) * (rng.random(groups) > 0.33)
    sizes = np.floor(weights / weights.sum() * rows).astype(np.int32)
    sizes[np.argmax(weights)] += rows - sizes.sum()
    return sizes


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_groups_with_empty_ones_equal_ragged_dot(block_m, seed):
    sizes = random_sizes(12, 90, seed)
    assert (sizes == 0).any() and any(s % block_m for s in sizes)
    x, w, sizes = operands(sizes, 96, 80, 40, seed=seed)  # 6 rows past the groups; K, N not tile multiples
    got = grouped_matmul_pallas(x, w, sizes, interpret=True, block_m=block_m)
    want = jax.lax.ragged_dot(x, w, sizes)
    assert got.shape == want.shape == (96, 40) and got.dtype == jnp.float32
    assert rel_err(got, want) < FP32_TOL
    np.testing.assert_array_equal(np.asarray(got[90:]), 0.0)


def test_many_small_groups_in_one_tile_equal_ragged_dot():
    """Decode-like: 32 experts of 0-4 rows each, several in every 16-row tile."""
    sizes = np.random.default_rng(3).integers(0, 5, 32)
    x, w, sizes = operands(sizes, int(sizes.sum()), 32, 16, seed=3)
    assert rel_err(grouped_matmul_pallas(x, w, sizes, interpret=True), jax.lax.ragged_dot(x, w, sizes)) < FP32_TOL


@pytest.mark.parametrize("sizes", [[37], [0, 37, 0, 0]], ids=["one_expert", "one_of_four"])
def test_a_single_group_is_a_plain_matmul(sizes):
    x, w, sizes = operands(sizes, 37, 48, 24, seed=4)
    got = grouped_matmul_pallas(x, w, sizes, interpret=True, block_m=16)
    want = jnp.dot(x, w[int(np.argmax(sizes))])
    assert rel_err(got, want) < FP32_TOL and rel_err(got, jax.lax.ragged_dot(x, w, sizes)) < FP32_TOL


def test_bf16_inputs_round_like_ragged_dot():
    """bf16 in, bf16 out, float32 accumulation: within one bf16 rounding of the exact product."""
    sizes = random_sizes(6, 64, 5)
    x, w, sizes = operands(sizes, 64, 64, 32, jnp.bfloat16, seed=5)
    got = grouped_matmul_pallas(x, w, sizes, interpret=True)
    exact = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
    assert got.dtype == jnp.bfloat16
    bf16_rounding = 2.0**-8
    assert np.all(np.abs(np.asarray(got, np.float32) - exact) <= bf16_rounding * np.abs(exact) + 1e-6)
    assert rel_err(got, jax.lax.ragged_dot(x, w, sizes)) < bf16_rounding


def test_tile_groups_names_the_groups_each_tile_holds():
    sizes = jnp.asarray([5, 0, 20, 3, 0], jnp.int32)  # rows [0,5) [5,5) [5,25) [25,28)
    first, last = tile_groups(sizes, 3, 16)  # tiles [0,16) [16,32) [32,48)
    np.testing.assert_array_equal(first, [0, 2, 5])
    np.testing.assert_array_equal(last, [2, 3, 4])  # tile 2 holds no row: last < first


def test_tile_rows_follows_the_mean_group_size():
    assert tile_rows(64 * 8, 128) == 16 and tile_rows(1024 * 8, 128) == 64 and tile_rows(32768, 16) == 128


def test_bad_operands_are_refused():
    x, w, sizes = operands([4, 4], 8, 16, 16)
    with pytest.raises(ValueError, match="one dtype"):
        grouped_matmul_pallas(x, w.astype(jnp.bfloat16), sizes, interpret=True)
    with pytest.raises(ValueError, match=r"w \[E, K, N\]"):
        grouped_matmul_pallas(x, w[:, :8], sizes, interpret=True)
    with pytest.raises(ValueError, match="block_m must be a power of 2"):
        grouped_matmul_pallas(x, w, sizes, interpret=True, block_m=24)


@pytest.mark.parametrize("seed", [0, 1])
def test_transposed_weights_equal_ragged_dot_of_the_transpose(seed):
    sizes = random_sizes(12, 90, seed)
    x, w, sizes = operands(sizes, 96, 40, 80, seed=seed)
    got = grouped_matmul_pallas(x, jnp.swapaxes(w, 1, 2), sizes, transpose_w=True, interpret=True, block_m=16)
    want = jax.lax.ragged_dot(x, w, sizes)
    assert got.shape == (96, 80) and rel_err(got, want) < FP32_TOL


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_transposed_matmul_sums_each_groups_rows(dtype):
    """out[g] = x_g.T @ y_g: empty groups give 0, rows past the last group add nothing."""
    sizes = random_sizes(7, 100, 6)
    assert (sizes == 0).any()
    kx, ky = jax.random.split(jax.random.key(6))
    x = jax.random.normal(kx, (104, 40)).astype(dtype)
    y = jax.random.normal(ky, (104, 24)).astype(dtype)
    got = grouped_transposed_matmul_pallas(x, y, jnp.asarray(sizes), interpret=True, block_m=16)
    ends = np.cumsum(sizes)
    xs, ys = np.asarray(x, np.float64), np.asarray(y, np.float64)
    want = np.stack([xs[e - s : e].T @ ys[e - s : e] for s, e in zip(sizes, ends)])
    assert got.shape == (7, 40, 24) and got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got)[sizes == 0], 0.0)
    assert rel_err(got, want) < (FP32_TOL if dtype == jnp.float32 else 2.0**-7)


@pytest.mark.parametrize("shape", [(128, 512, 2048, 768), (16, 2048, 1024, 1536)])  # E, rows, K, N
def test_the_gpu_kernels_are_valid_triton_modules(shape):
    """Forward, dX and dW kernels as a GPU compiles them (an i1 loop bound once failed there only)."""
    from jaxspec.models.moe import grouped_matmul
    from tests.kernels.triton_ir import verify_triton

    e, rows, k, n = shape
    x, w = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16), jax.ShapeDtypeStruct((e, k, n), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((e,), jnp.int32)
    assert verify_triton(lambda x, w, s: grouped_matmul_pallas(x, w, s), x, w, sizes) == 1
    loss = lambda x, w, s: grouped_matmul(x, w, s, "pallas").astype(jnp.float32).sum()  # noqa: E731
    assert verify_triton(jax.grad(loss, argnums=(0, 1)), x, w, sizes) == 2
