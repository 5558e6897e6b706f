"""Grouped matmul of rows sorted by group (mixture-of-experts experts), in the Triton language
(called through `jaxspec.kernels.triton_call`: jax-triton on a GPU, Triton's interpreter on the host).

out[r] = x[r] @ w[g] for the rows r of group g, where the groups are consecutive runs of rows:
group g holds rows [ends[g] - group_sizes[g], ends[g]) with ends = cumsum(group_sizes); rows past
sum(group_sizes) are 0. The semantics of `jax.lax.ragged_dot(x, w, group_sizes)`.

The grid is (row tiles, output-column tiles). A row tile may straddle group boundaries: its
program loops over the groups its rows touch (`tile_groups`, computed with jnp before the call),
and for each accumulates (x_tile with the other groups' rows masked to 0) @ w[g][:, cols] over K
in float32 into one accumulator. A masked row adds exact zeros, so every output row is its own
group's product alone. Weight traffic: each expert's columns are read by the tiles its rows fall
in (about once when groups are larger than a tile); an expert no row picks is never read (an
empty group inside a tile's range runs no K step). Row tiles are small at decode (few rows per
expert), large for long prefills.

The gradient of a grouped matmul uses the same kernel with each w[g] transposed in place
(`transpose_w`: dX = dY @ w[g].T, read through strides) and `grouped_transposed_matmul_triton`
(dW[g] = x_g.T @ dY_g, one program per (group, K tile, N tile) looping over the group's rows).

Widths that are not multiples of the tiles are handled by masked loads and stores (no padded copy).
float32 operands multiply in IEEE float32 (no TF32), as `jax.lax.ragged_dot` on the host.

`triton` is imported with this module; `jax_triton` only when a kernel is called for a GPU, and
torch only to run it in Triton's interpreter (`interpret=True`, any backend, slow).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton.language as tl

from jaxspec.kernels.tree_race import next_power_of_2
from jaxspec.kernels.triton_call import call

MIN_TILE = 16  # the smallest tl.dot operand side
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _grouped_matmul(
    tiles_ptr,
    bounds_ptr,
    x_ptr,
    w_ptr,
    o_ptr,
    ROWS: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    W_STRIDE_K: tl.constexpr,
    W_STRIDE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_IN_FLOAT32: tl.constexpr,
):
    """One (row tile, column tile) program: o [ROWS, N] rows of tile i, columns of tile j, from
    tiles int32 [tiles, 2] (the first and last group of each row tile), bounds int32 [E, 2] (each
    group's first row and end), x [ROWS, K] and w [E, K, N] read through (W_STRIDE_K, W_STRIDE_N).
    DOT_IN_FLOAT32 multiplies float32 copies of the operands (exactly as a 16-bit dot accumulating
    in float32), for an interpreter that cannot multiply bfloat16 (o is then float32: `_out_dtype`)."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    rows = i * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
    lanes_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * K
    first = tl.load(tiles_ptr + 2 * i)
    last = tl.load(tiles_ptr + 2 * i + 1)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for g in range(first, last + 1):
        start = tl.load(bounds_ptr + 2 * g)
        end = tl.load(bounds_ptr + 2 * g + 1)
        mine = (rows >= start) & (rows < end) & (rows < ROWS)
        expert = w_ptr + tl.cast(g, tl.int64) * (K * N)  # (g is a Python int in the interpreter)
        for k in range(0, tl.where(end > start, K, 0), BLOCK_K):  # an empty group reads no weights
            ks = k + lanes_k
            x = tl.load(x_rows + ks[None, :], mask=mine[:, None] & (ks < K)[None, :], other=0.0)
            w = tl.load(
                expert + ks[:, None] * W_STRIDE_K + cols[None, :] * W_STRIDE_N,
                mask=(ks < K)[:, None] & (cols < N)[None, :],
                other=0.0,
            )
            if DOT_IN_FLOAT32:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = acc + tl.dot(x, w, input_precision="ieee")
    out = o_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out, acc.to(o_ptr.dtype.element_ty), mask=(rows < ROWS)[:, None] & (cols < N)[None, :])


def _grouped_transposed_matmul(
    bounds_ptr,
    x_ptr,
    y_ptr,
    o_ptr,
    ROWS: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_IN_FLOAT32: tl.constexpr,
):
    """One (group, K tile, N tile) program: o [E, K, N] at group g = x_g.T @ y_g over the group's
    rows, from bounds int32 [E, 2] (each group's first row and end), x [ROWS, K] and y [ROWS, N];
    DOT_IN_FLOAT32 as in `_grouped_matmul`."""
    g = tl.program_id(0)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    lanes = tl.arange(0, BLOCK_M)
    start = tl.load(bounds_ptr + 2 * g)
    end = tl.load(bounds_ptr + 2 * g + 1)
    first = (start // BLOCK_M) * BLOCK_M
    acc = tl.full((BLOCK_K, BLOCK_N), 0.0, tl.float32)
    for r in range(first, tl.where(end > start, end, first), BLOCK_M):  # an empty group: no step
        rows = r + lanes
        mine = ((rows >= start) & (rows < end) & (rows < ROWS))[:, None]
        row_of = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + row_of * K + ks[None, :], mask=mine & (ks < K)[None, :], other=0.0)
        y = tl.load(y_ptr + row_of * N + cols[None, :], mask=mine & (cols < N)[None, :], other=0.0)
        if DOT_IN_FLOAT32:
            x = x.to(tl.float32)
            y = y.to(tl.float32)
        acc = acc + tl.dot(tl.trans(x), y, input_precision="ieee")
    out = o_ptr + g.to(tl.int64) * (K * N) + ks[:, None] * N + cols[None, :]
    tl.store(out, acc.to(o_ptr.dtype.element_ty), mask=(ks < K)[:, None] & (cols < N)[None, :])


def tile_rows(rows: int, groups: int) -> int:
    """Default row tile for `rows` sorted rows over `groups` groups: about the mean group size,
    a power of 2 in [16, 128] (16 at decode, where an expert gets a few rows; 128 for prefills)."""
    return min(128, max(MIN_TILE, next_power_of_2(max(1, rows // groups))))


def tile_groups(group_sizes: jax.Array, num_tiles: int, block_m: int) -> tuple[jax.Array, jax.Array]:
    """(first, last) int32 [num_tiles]: the groups whose rows row tile i (rows [i*block_m,
    (i+1)*block_m)) holds are first[i] .. last[i]; last < first for a tile past the last row."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    start = jnp.arange(num_tiles, dtype=jnp.int32) * block_m
    stop = jnp.minimum(start + block_m, ends[-1])  # exclusive
    # compare_all: one fusion over [tiles, E]; the default binary search is a loop of log2(E)
    # iterations, each of them its own launches on a GPU
    first = jnp.searchsorted(ends, start, side="right", method="compare_all").astype(jnp.int32)
    last = jnp.searchsorted(ends, stop - 1, side="right", method="compare_all").astype(jnp.int32)
    return first, jnp.where(stop > start, last, first - 1)


def group_bounds(group_sizes: jax.Array) -> jax.Array:
    """int32 [E, 2]: each group's first row and end (exclusive)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.stack([ends - group_sizes.astype(jnp.int32), ends], axis=1)


def _check_tiles(**tiles: int) -> None:
    for name, tile in tiles.items():
        if tile < MIN_TILE or tile & (tile - 1):
            raise ValueError(f"grouped matmul {name} must be a power of 2 >= {MIN_TILE}, got {tile}")


def _check_dtype(what: str, dtype) -> None:
    if jnp.dtype(dtype) not in DTYPES:
        raise ValueError(f"{what} takes {[jnp.dtype(d).name for d in DTYPES]}, got {jnp.dtype(dtype).name}")


def _out_dtype(dtype, interpret: bool):
    """The dtype the kernel writes for operands of `dtype`: the operands' own, except bfloat16 in
    the interpreter, which truncates float32 to bfloat16 where a GPU rounds to nearest: there the
    kernel writes float32 and JAX rounds."""
    return jnp.float32 if interpret and dtype == jnp.bfloat16 else dtype


def _fit(tile: int, size: int) -> int:
    """`tile` shrunk to the power of 2 (>= MIN_TILE) that covers `size`, if that is smaller."""
    return min(tile, max(MIN_TILE, next_power_of_2(size)))


def launch(
    x, w, *, transpose_w: bool = False, block_m: int | None = None, block_n: int = 128, block_k: int = 64
) -> tuple[tuple[int, int], dict]:
    """(grid, the kernel's constexpr arguments) of `grouped_matmul_triton` for x [M, K] and w
    [E, K, N] ([E, N, K] with transpose_w), arrays or jax.ShapeDtypeStruct; DOT_IN_FLOAT32 False
    (the GPU's dot). ValueError for mismatched shapes or tiles."""
    m, k = x.shape
    num_groups = w.shape[0]
    k_w, n = (w.shape[2], w.shape[1]) if transpose_w else w.shape[1:]
    if len(w.shape) != 3 or k_w != k:
        raise ValueError(
            f"grouped matmul needs x [M, K], w [E, {'N, K' if transpose_w else 'K, N'}]; got x {x.shape}, w {w.shape}"
        )
    block_m = tile_rows(m, num_groups) if block_m is None else block_m
    block_n, block_k = _fit(block_n, n), _fit(block_k, k)
    _check_tiles(block_m=block_m, block_n=block_n, block_k=block_k)
    constants = dict(
        ROWS=m,
        K=k,
        N=n,
        W_STRIDE_K=1 if transpose_w else n,
        W_STRIDE_N=k if transpose_w else 1,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_IN_FLOAT32=False,
    )
    return (-(-m // block_m), -(-n // block_n)), constants


@functools.partial(
    jax.jit, static_argnames=("transpose_w", "interpret", "block_m", "block_n", "block_k", "num_warps", "num_stages")
)
def grouped_matmul_triton(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_w: bool = False,
    interpret: bool = False,
    block_m: int | None = None,
    block_n: int = 128,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> jax.Array:
    """x [M, K] (rows sorted by group), w [E, K, N] of x's dtype (one of DTYPES), group_sizes int
    [E] (sum <= M) -> [M, N] in x's dtype: `jax.lax.ragged_dot(x, w, group_sizes)`, accumulated in
    float32. With transpose_w, w is [E, N, K] and each group's rows multiply w[g].T (a gradient's dX).

    block_m (default `tile_rows(M, E)`), block_n and block_k are the tiles (powers of 2 >= 16;
    block_n and block_k shrink to fit small widths); num_warps and num_stages tune the GPU kernel;
    interpret runs the kernel in Triton's interpreter on the host (any backend, slow).
    """
    grid, constants = launch(x, w, transpose_w=transpose_w, block_m=block_m, block_n=block_n, block_k=block_k)
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"grouped matmul needs group_sizes [E={w.shape[0]}], got {group_sizes.shape}")
    if x.dtype != w.dtype:
        raise ValueError(f"grouped matmul needs one dtype for x and w, got x {x.dtype}, w {w.dtype}")
    _check_dtype("grouped matmul", x.dtype)
    constants["DOT_IN_FLOAT32"] = interpret and x.dtype == jnp.bfloat16
    first, last = tile_groups(group_sizes, grid[0], constants["BLOCK_M"])
    (out,) = call(
        _grouped_matmul,
        (jnp.stack([first, last], axis=1), group_bounds(group_sizes), x, w),
        (jax.ShapeDtypeStruct((constants["ROWS"], constants["N"]), _out_dtype(x.dtype, interpret)),),
        grid=grid,
        constants=constants,
        name="grouped_matmul",
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out.astype(x.dtype)


def launch_transposed(
    x, y, num_groups: int, *, block_m: int = 64, block_n: int = 128, block_k: int = 64
) -> tuple[tuple[int, int, int], dict]:
    """(grid, the kernel's constexpr arguments) of `grouped_transposed_matmul_triton` for x [M, K],
    y [M, N] and num_groups groups; DOT_IN_FLOAT32 False. ValueError for mismatched shapes or tiles."""
    m, k = x.shape
    if len(y.shape) != 2 or y.shape[0] != m:
        raise ValueError(f"grouped transposed matmul needs x [M, K], y [M, N]; got x {x.shape}, y {y.shape}")
    n = y.shape[1]
    block_n, block_k = _fit(block_n, n), _fit(block_k, k)
    _check_tiles(block_m=block_m, block_n=block_n, block_k=block_k)
    constants = dict(ROWS=m, K=k, N=n, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_IN_FLOAT32=False)
    return (num_groups, -(-k // block_k), -(-n // block_n)), constants


@functools.partial(jax.jit, static_argnames=("interpret", "block_m", "block_n", "block_k", "num_warps", "num_stages"))
def grouped_transposed_matmul_triton(
    x: jax.Array,
    y: jax.Array,
    group_sizes: jax.Array,
    *,
    interpret: bool = False,
    block_m: int = 64,
    block_n: int = 128,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> jax.Array:
    """x [M, K], y [M, N] of one dtype of DTYPES (rows sorted by group), group_sizes int [E]
    (sum <= M) -> [E, K, N] in x's dtype: out[g] = x[rows of g].T @ y[rows of g] (0 for an empty
    group), accumulated in float32: the gradient of a grouped matmul's weights (x the input, y the
    output's cotangent). Tiles and tuning as `grouped_matmul_triton`."""
    (num_groups,) = group_sizes.shape
    grid, constants = launch_transposed(x, y, num_groups, block_m=block_m, block_n=block_n, block_k=block_k)
    if x.dtype != y.dtype:
        raise ValueError(f"grouped transposed matmul needs one dtype for x and y, got x {x.dtype}, y {y.dtype}")
    _check_dtype("grouped transposed matmul", x.dtype)
    constants["DOT_IN_FLOAT32"] = interpret and x.dtype == jnp.bfloat16
    (out,) = call(
        _grouped_transposed_matmul,
        (group_bounds(group_sizes), x, y),
        (jax.ShapeDtypeStruct((num_groups, constants["K"], constants["N"]), _out_dtype(x.dtype, interpret)),),
        grid=grid,
        constants=constants,
        name="grouped_transposed_matmul",
        interpret=interpret,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out.astype(x.dtype)
