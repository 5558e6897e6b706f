"""The thin matmul's grouped form: a mixture-of-experts layer's token rows by their experts, each
touched expert's weight read once (Triton, through jax-triton).

A decode or verification step routes each of a few tokens to its top-k experts. The rows (token x
expert assignments) sorted by expert run the kernel of `jaxspec.kernels.thin_matmul_triton` with
one program per (expert, BLOCK_N columns): the program finds its expert's rows in the sorted expert
ids, and streams that expert's columns for all of them (an expert no row picks costs a program that
reads nothing). It gathers each row's token from its assignment and can write each row back in
token order times its routing weight, so a sparse layer's experts are two launches after one sort
of the routing (`jaxspec.models.moe`): gate and up with the SwiGLU, then down weighted.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.kernels import thin_matmul_triton as thin
from jaxspec.kernels import triton_call


@functools.partial(jax.jit, static_argnames=("repeat", "tiles", "interpret"))
def expert_matmul(
    x: jax.Array,
    w: jax.Array,
    experts: jax.Array,
    *,
    source: jax.Array | None = None,
    repeat: int = 1,
    dest: jax.Array | None = None,
    up: jax.Array | None = None,
    scale: jax.Array | None = None,
    tiles: thin.Tiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    """A mixture-of-experts layer's few token rows by their experts, each expert's weight read once:
    out [R, N] in x's dtype for R rows sorted by expert (experts int [R]: each row's expert in
    [0, E), non-decreasing), row r being x[source[r] // repeat] @ w[experts[r]] (x [X, K], w [E, K,
    N]; source int [R], None: R = X and x's own rows). up [E, K, N]: the SwiGLU silu(x @ w[e]) *
    (x @ up[e]) rounded as `thin_matmul_triton.thin_matmul`'s; dest int [R]: a permutation, row r written at out row
    dest[r] (None: at r); scale [R]: out row j multiplied by scale[j] (a token's routing weight),
    rounded once more. One program per (expert, BLOCK_N columns) finds its expert's rows, streams the
    expert's columns for all of them; an expert no row picks reads no weights."""
    (rows,) = (x.shape[0],) if source is None else source.shape
    num_experts, k, n = w.shape
    if x.ndim != 2 or x.shape[1] != k or experts.shape != (rows,):
        raise ValueError(
            f"expert_matmul: needs x [X, K], w [E, K, N], experts [R]; got x {list(x.shape)}, "
            f"w {list(w.shape)}, experts {list(experts.shape)} for R = {rows} rows"
        )
    for name, array in (("dest", dest), ("scale", scale)):
        if array is not None and array.shape != (rows,):
            raise ValueError(f"expert_matmul: {name} must be [R={rows}], got {list(array.shape)}")
    if up is not None and (up.shape != w.shape or up.dtype != w.dtype):
        raise ValueError(f"expert_matmul: up {up.dtype} {list(up.shape)} must match w {w.dtype} {list(w.shape)}")
    if jnp.dtype(x.dtype) not in map(jnp.dtype, thin.DTYPES) or w.dtype != x.dtype or rows == 0:
        raise ValueError(
            f"expert_matmul: x {x.dtype} and w {w.dtype} must share one dtype of "
            f"{[jnp.dtype(d).name for d in thin.DTYPES]}, with at least one row"
        )
    swiglu = up is not None
    tiles = tiles or thin.default_tiles(rows, k, n, jnp.dtype(x.dtype).itemsize, swiglu=swiglu, groups=num_experts)
    if tiles.split_k != 1:
        raise ValueError(f"expert_matmul: tiles must not split K, got split_k {tiles.split_k}")
    unused = jnp.zeros((1,), jnp.int32)
    (out,) = triton_call.call(
        thin._thin_matmul,
        (
            x,
            w,
            w if up is None else up,
            experts.astype(jnp.int32),
            unused if source is None else source.astype(jnp.int32),
            unused if dest is None else dest.astype(jnp.int32),
            unused if scale is None else scale.astype(x.dtype),
        ),
        (jax.ShapeDtypeStruct((rows, n), x.dtype),),
        grid=(num_experts, -(-n // tiles.block_n)),
        constants=thin.launch_constants(
            rows,
            k,
            n,
            (n, 1),
            tiles=tiles,
            dtype=x.dtype,
            swiglu=swiglu,
            group_stride=k * n,
            gather=source is not None,
            repeat=repeat,
            scatter=dest is not None,
            scale=scale is not None,
        ),
        name="expert_matmul_triton",
        interpret=interpret,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
