"""Grouped matmul of rows sorted by group (mixture-of-experts experts), Pallas (Triton on GPU).

out[r] = x[r] @ w[g] for the rows r of group g, where the groups are consecutive runs of rows:
group g holds rows [ends[g] - group_sizes[g], ends[g]) with ends = cumsum(group_sizes); rows past
sum(group_sizes) are 0. The semantics of `jax.lax.ragged_dot(x, w, group_sizes)`.

The grid is (row tiles, output-column tiles). A row tile may straddle group boundaries: its
program loops over the groups its rows touch (`tile_groups`, computed with jnp before the call),
and for each accumulates (x_tile with the other groups' rows zeroed) @ w[g][:, cols] over K in
float32 into one accumulator. A zeroed row adds exact zeros, so every output row is its own
group's product alone. Weight traffic: each expert's columns are read by the tiles its rows fall
in (about once when groups are larger than a tile); an expert no row picks is never read. Row
tiles are small at decode (few rows per expert), large for long prefills.

The gradient of a grouped matmul uses the same kernel with each w[g] transposed in place
(`transpose_w`: dX = dY @ w[g].T) and `grouped_transposed_matmul_pallas` (dW[g] = x_g.T @ dY_g,
one program per (group, K tile, N tile) looping over the group's rows).

Widths that are not multiples of the K / column tiles are zero-padded before the call (a copy;
model widths are multiples of 128, so only toy shapes pay it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_TILE = 16  # the smallest dot operand side Triton takes


def tile_rows(rows: int, groups: int) -> int:
    """Default row tile for `rows` sorted rows over `groups` groups: about the mean group size,
    a power of 2 in [16, 128] (16 at decode, where an expert gets a few rows; 128 for prefills)."""
    return min(128, max(MIN_TILE, pl.next_power_of_2(max(1, rows // groups))))


def tile_groups(group_sizes: jax.Array, num_tiles: int, block_m: int) -> tuple[jax.Array, jax.Array]:
    """(first, last) int32 [num_tiles]: the groups whose rows row tile i (rows [i*block_m,
    (i+1)*block_m)) holds are first[i] .. last[i]; last < first for a tile past the last row."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    start = jnp.arange(num_tiles, dtype=jnp.int32) * block_m
    stop = jnp.minimum(start + block_m, ends[-1])  # exclusive
    first = jnp.searchsorted(ends, start, side="right").astype(jnp.int32)
    last = jnp.searchsorted(ends, stop - 1, side="right").astype(jnp.int32)
    return first, jnp.where(stop > start, last, first - 1)


def _kernel(
    first_ref, last_ref, ends_ref, sizes_ref, x_ref, w_ref, o_ref, *, block_m: int, block_k: int, transpose_w: bool
):
    """One (row tile, column tile) program: o [block_m, block_n] from x [block_m, K] and w [E, K, block_n]
    (w [E, block_n, K] when transpose_w)."""
    row = pl.program_id(0) * block_m + jnp.arange(block_m, dtype=jnp.int32)
    num_k = x_ref.shape[1] // block_k
    acc = jnp.zeros(o_ref.shape, jnp.float32)

    def group(g, acc):
        end, size = ends_ref[g], sizes_ref[g]
        mine = (row >= end - size) & (row < end)

        def step(k, acc):
            cols = pl.ds(k * block_k, block_k)
            x = x_ref[:, cols]
            x = jnp.where(mine[:, None], x, jnp.zeros_like(x))
            if transpose_w:
                return acc + plgpu.dot(x, w_ref[g, :, cols], trans_b=True).astype(jnp.float32)
            return acc + plgpu.dot(x, w_ref[g, cols, :]).astype(jnp.float32)

        # An empty group between the tile's first and last runs no step (reads no weights).
        # (an int32 bound: a select of Python ints lowers to an i1 bound that Triton rejects)
        return lax.fori_loop(0, num_k * (size > 0).astype(jnp.int32), step, acc)

    first, last = first_ref[...], last_ref[...]
    acc = lax.fori_loop(first, jnp.maximum(last + 1, first), group, acc)
    o_ref[...] = acc.astype(o_ref.dtype)


def _tiles(**tiles: int) -> None:
    for name, tile in tiles.items():
        if tile < MIN_TILE or tile & (tile - 1):
            raise ValueError(f"grouped matmul {name} must be a power of 2 >= {MIN_TILE}, got {tile}")


def _fit(tile: int, size: int) -> int:
    """`tile` shrunk to the power of 2 (>= MIN_TILE) that covers `size`, if that is smaller."""
    return min(tile, max(MIN_TILE, pl.next_power_of_2(size)))


@functools.partial(
    jax.jit, static_argnames=("transpose_w", "interpret", "block_m", "block_n", "block_k", "num_warps", "num_stages")
)
def grouped_matmul_pallas(
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
    """x [M, K] (rows sorted by group), w [E, K, N] of x's dtype, group_sizes int [E] (sum <= M) ->
    [M, N] in x's dtype: `jax.lax.ragged_dot(x, w, group_sizes)`, accumulated in float32. With
    transpose_w, w is [E, N, K] and each group's rows multiply w[g].T (a gradient's dX).

    block_m (default `tile_rows(M, E)`), block_n and block_k are the tiles (powers of 2 >= 16;
    block_n and block_k shrink to fit small widths); num_warps and num_stages tune the GPU kernel.
    """
    m, k = x.shape
    num_groups = w.shape[0]
    k_w, n = (w.shape[2], w.shape[1]) if transpose_w else w.shape[1:]
    if k_w != k or group_sizes.shape != (num_groups,):
        raise ValueError(
            f"grouped matmul needs x [M, K], w [E, {'N, K' if transpose_w else 'K, N'}], group_sizes "
            f"[E]; got x {x.shape}, w {w.shape}, group_sizes {group_sizes.shape}"
        )
    if x.dtype != w.dtype:
        raise ValueError(f"grouped matmul needs one dtype for x and w, got x {x.dtype}, w {w.dtype}")
    block_m = tile_rows(m, num_groups) if block_m is None else block_m
    block_n, block_k = _fit(block_n, n), _fit(block_k, k)
    _tiles(block_m=block_m, block_n=block_n, block_k=block_k)
    pad_m, pad_k, pad_n = -m % block_m, -k % block_k, -n % block_n
    if pad_m or pad_k:
        x = jnp.pad(x, ((0, pad_m), (0, pad_k)))
    if pad_k or pad_n:
        w = jnp.pad(w, ((0, 0), (0, pad_n), (0, pad_k)) if transpose_w else ((0, 0), (0, pad_k), (0, pad_n)))
    num_tiles, k_padded, n_padded = x.shape[0] // block_m, k + pad_k, n + pad_n
    sizes = group_sizes.astype(jnp.int32)
    first, last = tile_groups(sizes, num_tiles, block_m)
    per_tile = pl.BlockSpec((None,), lambda i, j: (i,))
    per_group = pl.BlockSpec((num_groups,), lambda i, j: (0,))
    w_spec = (
        pl.BlockSpec((num_groups, block_n, k_padded), lambda i, j: (0, j, 0))
        if transpose_w
        else pl.BlockSpec((num_groups, k_padded, block_n), lambda i, j: (0, 0, j))
    )
    out = pl.pallas_call(
        functools.partial(_kernel, block_m=block_m, block_k=block_k, transpose_w=transpose_w),
        grid=(num_tiles, n_padded // block_n),
        in_specs=[
            per_tile,
            per_tile,
            per_group,
            per_group,
            pl.BlockSpec((block_m, k_padded), lambda i, j: (i, 0)),
            w_spec,
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], n_padded), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(first, last, jnp.cumsum(sizes), sizes, x, w)
    return out[:m, :n]


def _per_group_kernel(ends_ref, sizes_ref, x_ref, y_ref, o_ref, *, block_m: int):
    """One (group, K tile, N tile) program: o [block_k, block_n] = x_g.T @ y_g over the group's
    rows, from x [M, block_k] and y [M, block_n]."""
    end, size = ends_ref[...], sizes_ref[...]
    start = end - size
    lanes = jnp.arange(block_m, dtype=jnp.int32)

    def step(t, acc):
        rows = pl.ds(t * block_m, block_m)
        mine = ((t * block_m + lanes >= start) & (t * block_m + lanes < end))[:, None]
        x, y = x_ref[rows, :], y_ref[rows, :]
        x, y = jnp.where(mine, x, jnp.zeros_like(x)), jnp.where(mine, y, jnp.zeros_like(y))
        return acc + plgpu.dot(x, y, trans_a=True).astype(jnp.float32)

    first = lax.div(start, block_m)
    stop = jnp.where(size > 0, pl.cdiv(end, block_m), first)
    o_ref[...] = lax.fori_loop(first, stop, step, jnp.zeros(o_ref.shape, jnp.float32)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "block_m", "block_n", "block_k", "num_warps", "num_stages"))
def grouped_transposed_matmul_pallas(
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
    """x [M, K], y [M, N] of one dtype (rows sorted by group), group_sizes int [E] (sum <= M) ->
    [E, K, N] in x's dtype: out[g] = x[rows of g].T @ y[rows of g] (0 for an empty group),
    accumulated in float32: the gradient of a grouped matmul's weights (x the input, y the
    output's cotangent). Tiles and tuning as `grouped_matmul_pallas`."""
    m, k = x.shape
    n = y.shape[1]
    (num_groups,) = group_sizes.shape
    if y.shape[0] != m or x.dtype != y.dtype:
        raise ValueError(
            f"grouped transposed matmul needs x [M, K], y [M, N] of one dtype; got x {x.dtype} "
            f"{x.shape}, y {y.dtype} {y.shape}"
        )
    block_n, block_k = _fit(block_n, n), _fit(block_k, k)
    _tiles(block_m=block_m, block_n=block_n, block_k=block_k)
    pad_m, pad_k, pad_n = -m % block_m, -k % block_k, -n % block_n
    x = jnp.pad(x, ((0, pad_m), (0, pad_k)))
    y = jnp.pad(y, ((0, pad_m), (0, pad_n)))
    sizes = group_sizes.astype(jnp.int32)
    per_group = pl.BlockSpec((None,), lambda g, i, j: (g,))
    out = pl.pallas_call(
        functools.partial(_per_group_kernel, block_m=block_m),
        grid=(num_groups, x.shape[1] // block_k, y.shape[1] // block_n),
        in_specs=[
            per_group,
            per_group,
            pl.BlockSpec((x.shape[0], block_k), lambda g, i, j: (0, i)),
            pl.BlockSpec((y.shape[0], block_n), lambda g, i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((None, block_k, block_n), lambda g, i, j: (g, i, j)),
        out_shape=jax.ShapeDtypeStruct((num_groups, x.shape[1], y.shape[1]), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_transposed_matmul",
    )(jnp.cumsum(sizes), sizes, x, y)
    return out[:, :k, :n]
