"""A matmul of a few token rows by a weight, reading the weight once at the card's memory rate
(Triton, through jax-triton).

A decode or verification step multiplies M = B x T token rows (1 to a few hundred) by each
projection weight [K, N]; its time is the weight's bytes over the memory rate, whatever M is. XLA's
GEMMs read those weights at 0.25-0.37 of the copy rate at Qwen3-1.7B's shapes on an H200 (32-128
rows; cuBLAS slower still): few output tiles for the card's 132 SMs, each streaming a long slice of
K. This kernel tiles N finely enough that every SM streams its own columns of the weight, with a
deep pipeline of K blocks:

    out [M, N] = x [M, K] @ w [K, N]           one program per (BLOCK_M rows, BLOCK_N columns),
                                               a float32 accumulator over K in BLOCK_K steps,
                                               rounded once to the output dtype

Each program reads its rows of x once per K step as it streams its weight columns, so x is re-read
once per column block: at tens of rows and narrow column blocks that traffic (through L2) can
outgrow the weight's. `Tiles.split_k` splits K over several programs instead, so that wider column
blocks still give every SM a program; their float32 sums are added after the kernel (one small
XLA fusion that also applies the epilogue). `default_tiles` does not split until a GPU sweep
(`jaxspec bench projections --sweep`) shows where it pays.

w is read through strides, so a transposed weight (the tied embedding as the LM head, [N, K] in
memory) needs no copy. With `swiglu`, w is a dense MLP's stacked gate and up [K, 2, F] and the
kernel returns silu(x @ gate) * (x @ up) [M, F] in the model's rounding order (each projection
rounded to the dtype, silu rounded, then the product): the MLP's first GEMM and its activation in
one launch. A row's sums do not depend on the other rows, so a token's projections are the same in
a decode step and in a verification step of any width launched with the same tiles.

A mixture-of-experts layer's decode step is the same problem per expert: the kernel's grouped
form (`jaxspec.kernels.expert_matmul_triton`) runs over token rows sorted by expert, one program
per (expert, BLOCK_N columns) that finds its expert's rows in the sorted expert ids and streams that
expert's weight for all of them.

`triton` is imported with this module; `jax_triton` only when the kernel is called for a GPU, and
torch only to run it in Triton's interpreter (`interpret=True`, any backend, slow).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import triton.language as tl

from jaxspec.kernels import triton_call
from jaxspec.kernels.tree_race import next_power_of_2

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
MAX_ROWS = 256  # more token rows are a GEMM that XLA's tiles use the card's compute for
SMS = 132  # H100 / H200 streaming multiprocessors: the programs one wave should fill
# A dense weight streams fastest in few wide programs with deep blocks (an H100's sweep of Qwen3-8B's
# projections, lease WW): at least DENSE_PROGRAMS programs of DENSE_TILE_BYTES weight blocks per
# stage. The expert form (`groups` > 1) keeps a program per SM with TILE_BYTES blocks.
DENSE_PROGRAMS = 64
DENSE_TILE_BYTES = 32768
DENSE_MAX_BLOCK_K = 256  # 512 was slower at every swept BLOCK_N
TILE_BYTES = 16384
SHARED_BYTES = 160 * 1024  # of the 227 KiB a Hopper block may use


def _thin_matmul(
    x_ptr,
    w_ptr,
    up_ptr,
    groups_ptr,
    source_ptr,
    dest_ptr,
    scale_ptr,
    out_ptr,
    ROWS: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    W_STRIDE_K: tl.constexpr,
    W_STRIDE_N: tl.constexpr,
    W_STRIDE_G: tl.constexpr,
    UP_OFFSET: tl.constexpr,
    SWIGLU: tl.constexpr,
    GROUPED: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    GATHER: tl.constexpr,
    REPEAT: tl.constexpr,
    SCATTER: tl.constexpr,
    SCALE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program's BLOCK_N columns of out for its rows: rows [i*BLOCK_M, (i+1)*BLOCK_M), or with
    GROUPED the rows of group i (groups [ROWS]: each row's group, non-decreasing; GROUP_ROWS: ROWS's
    power of two) in BLOCK_M steps, by the group's weight W_STRIDE_G elements on. SWIGLU: silu(x @ w)
    * (x @ up), the up weight UP_OFFSET elements past up_ptr's columns; GATHER: row r reads x row
    source[r] // REPEAT; SCATTER: row r is written at out row dest[r]; SCALE: the row at out row j
    times scale[j], rounded as the model rounds. SPLIT_K > 1 (not GROUPED): program (i, j, s) sums K
    elements [s * K_PER_SPLIT, (s + 1) * K_PER_SPLIT) and writes its float32 sums to out [SPLIT_K,
    ROWS, N] ([SPLIT_K, ROWS, 2N] with SWIGLU: gate's, then up's), the epilogue left to their sum.
    PRECISION: tl.dot's for float32 inputs ("ieee": no TF32 rounding)."""
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if GROUPED:
        group = tl.program_id(0)
        every = tl.arange(0, GROUP_ROWS)
        ids = tl.load(groups_ptr + every, mask=every < ROWS, other=2**30)
        start = tl.reduce((ids < group).to(tl.int32), 0, triton_call.SUM)
        end = tl.reduce((ids <= group).to(tl.int32), 0, triton_call.SUM)
        w_base = w_ptr + group.to(tl.int64) * W_STRIDE_G
        up_base = up_ptr + group.to(tl.int64) * W_STRIDE_G + UP_OFFSET
    else:
        start = tl.program_id(0) * BLOCK_M
        end = tl.minimum(start + BLOCK_M, ROWS)
        w_base = w_ptr
        up_base = up_ptr + UP_OFFSET
    w_cols = w_base + n.to(tl.int64)[None, :] * W_STRIDE_N
    up_cols = up_base + n.to(tl.int64)[None, :] * W_STRIDE_N
    out_dtype = out_ptr.dtype.element_ty
    if SPLIT_K > 1:
        k_first = tl.program_id(2) * K_PER_SPLIT
        k_stop = tl.minimum(k_first + K_PER_SPLIT, K)
    else:
        k_first = 0
        k_stop = K
    for first in range(start, end, BLOCK_M):  # one step unless a group has more than BLOCK_M rows
        m = first + tl.arange(0, BLOCK_M)
        live = m < end
        if GATHER:
            x_rows = x_ptr + (tl.load(source_ptr + m, mask=live, other=0) // REPEAT).to(tl.int64)[:, None] * K
        else:
            x_rows = x_ptr + m.to(tl.int64)[:, None] * K
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in range(k_first, k_stop, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_rows + k[None, :], mask=live[:, None] & (k < K)[None, :], other=0.0)
            inside = (k < K)[:, None] & (n < N)[None, :]
            at_k = k.to(tl.int64)[:, None] * W_STRIDE_K
            acc = tl.dot(a, tl.load(w_cols + at_k, mask=inside, other=0.0), acc, input_precision=PRECISION)
            if SWIGLU:
                up = tl.load(up_cols + at_k, mask=inside, other=0.0)
                acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
        if SPLIT_K > 1:
            width = N * (1 + SWIGLU)
            part = out_ptr + tl.program_id(2).to(tl.int64) * ROWS * width + m.to(tl.int64)[:, None] * width
            tl.store(part + n[None, :], acc, mask=live[:, None] & (n < N)[None, :])
            if SWIGLU:
                tl.store(part + N + n[None, :], acc_up, mask=live[:, None] & (n < N)[None, :])
        else:
            if SWIGLU:
                gate = acc.to(out_dtype).to(tl.float32)
                silu = (gate / (1.0 + tl.exp(-gate))).to(out_dtype).to(tl.float32)
                acc = silu * acc_up.to(out_dtype).to(tl.float32)
            if SCATTER:
                at_row = tl.load(dest_ptr + m, mask=live, other=0)
            else:
                at_row = m
            if SCALE:
                factor = tl.load(scale_ptr + at_row, mask=live, other=0.0).to(tl.float32)
                acc = acc.to(out_dtype).to(tl.float32) * factor[:, None]
            at = at_row.to(tl.int64)[:, None] * N + n[None, :]
            tl.store(out_ptr + at, acc.to(out_dtype), mask=live[:, None] & (n < N)[None, :])


class Tiles(NamedTuple):
    """A launch's tiles: BLOCK_M x BLOCK_N outputs per program over BLOCK_K steps of K; split_k > 1
    (`thin_matmul` only): K split over that many programs per output tile, their float32 sums added
    after the kernel (larger tiles, fewer re-reads of x, the same number of programs)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1


def default_tiles(rows: int, k: int, n: int, itemsize: int = 2, *, swiglu: bool = False, groups: int = 1) -> Tiles:
    """Tiles for out [rows, n] = x [rows, k] @ w [k, n] (swiglu: two weight blocks per step; groups:
    the experts rows are spread over, `expert_matmul`): BLOCK_M the power of two in [16, 64] of a
    busy group's rows; the widest BLOCK_N of 128 / 64 / 32 / 16 that still gives DENSE_PROGRAMS
    programs (experts: one per SM); a BLOCK_K whose weight block is DENSE_TILE_BYTES (experts:
    TILE_BYTES; at most K's power of two, and DENSE_MAX_BLOCK_K for a dense weight), halved until
    the pipeline's buffers fit SHARED_BYTES."""
    busy = max(1, min(groups, rows))  # the groups that can hold rows
    per_group = -(-rows // busy)
    block_m = min(64, max(16, next_power_of_2(per_group)))
    row_blocks = busy * -(-per_group // block_m)
    dense = groups == 1
    programs, tile_bytes = (DENSE_PROGRAMS, DENSE_TILE_BYTES) if dense else (SMS, TILE_BYTES)
    block_n = next((b for b in (128, 64, 32) if row_blocks * -(-n // b) >= programs), 16)
    deepest = min(next_power_of_2(k), DENSE_MAX_BLOCK_K) if dense else next_power_of_2(k)
    block_k = max(16, min(deepest, tile_bytes // (block_n * itemsize)))
    tiles = Tiles(block_m, block_n, block_k)
    while shared_bytes(tiles, itemsize, swiglu=swiglu) > SHARED_BYTES and tiles.block_k > 16:
        tiles = tiles._replace(block_k=tiles.block_k // 2)
    return tiles


def shared_bytes(tiles: Tiles, itemsize: int, *, swiglu: bool = False) -> int:
    """Shared memory the pipeline's buffers take: num_stages - 1 stages of an x block and the
    weight block(s)."""
    stage = tiles.block_k * (tiles.block_m + tiles.block_n * (2 if swiglu else 1)) * itemsize
    return (tiles.num_stages - 1) * stage


def kernel_applies(x: jax.Array, w: jax.Array, contract: int = 1) -> bool:
    """Whether `thin_matmul` takes x [..., K] by w [K..., N...] (the last `contract` dims of x
    against w's first): a dtype the kernel reads, the same for both, at most MAX_ROWS rows."""
    rows = x.size // max(1, math.prod(x.shape[x.ndim - contract :]))
    return (
        jnp.dtype(x.dtype) in map(jnp.dtype, DTYPES)
        and w.dtype == x.dtype
        and x.shape[x.ndim - contract :] == w.shape[:contract]
        and 0 < rows <= MAX_ROWS
    )


@functools.partial(jax.jit, static_argnames=("contract", "transpose", "swiglu", "out_dtype", "tiles", "interpret"))
def thin_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    contract: int = 1,
    transpose: bool = False,
    swiglu: bool = False,
    out_dtype=None,
    tiles: Tiles | None = None,
    interpret: bool = False,
) -> jax.Array:
    """x [..., K...] (its last `contract` dims contracted) by w [K..., N...] -> [..., N...] in
    out_dtype (default x's): an einsum "...k,kn->...n" over the flattened K and N.
    transpose: w is [N, K] (e.g. the tied embedding as the LM head); swiglu: w is [K, 2, F] and the
    result silu(x @ w[:, 0]) * (x @ w[:, 1]) [..., F]; tiles: `default_tiles` when None."""
    batch = x.shape[: x.ndim - contract]
    k = math.prod(x.shape[x.ndim - contract :])
    rows = math.prod(batch)
    if transpose:
        if contract != 1 or swiglu or w.ndim != 2 or w.shape[1] != k:
            raise ValueError(f"thin_matmul: transpose takes w [N, K] with K = {k}, got {list(w.shape)}")
        out_dims, n, strides = (w.shape[0],), w.shape[0], (1, k)
    else:
        if x.shape[x.ndim - contract :] != w.shape[:contract]:
            raise ValueError(f"thin_matmul: x {list(x.shape)} contracts {contract} dims with w {list(w.shape)}")
        out_dims = w.shape[contract:]
        if swiglu:
            if len(out_dims) != 2 or out_dims[0] != 2:
                raise ValueError(f"thin_matmul: swiglu takes w [K, 2, F], got {list(w.shape)}")
            out_dims = out_dims[1:]
        n = math.prod(out_dims)
        strides = (math.prod(w.shape[contract:]), 1)
    if jnp.dtype(x.dtype) not in map(jnp.dtype, DTYPES) or w.dtype != x.dtype or not 0 < rows <= MAX_ROWS:
        raise ValueError(
            f"thin_matmul: x {x.dtype} {list(x.shape)} and w {w.dtype} {list(w.shape)} must share one dtype of "
            f"{[jnp.dtype(d).name for d in DTYPES]}, with at most {MAX_ROWS} rows"
        )
    tiles = tiles or default_tiles(rows, k, n, jnp.dtype(x.dtype).itemsize, swiglu=swiglu)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    split = tiles.split_k
    width = n * (2 if swiglu else 1)
    unused = jnp.zeros((1,), jnp.int32)
    (out,) = triton_call.call(
        _thin_matmul,
        (x.reshape(rows, k), w, w, unused, unused, unused, unused),
        (
            jax.ShapeDtypeStruct(
                (split, rows, width) if split > 1 else (rows, n), jnp.float32 if split > 1 else out_dtype
            ),
        ),
        grid=(-(-rows // tiles.block_m), -(-n // tiles.block_n), split),
        constants=launch_constants(
            rows, k, n, strides, tiles=tiles, dtype=x.dtype, up_offset=n if swiglu else 0, swiglu=swiglu
        ),
        name="thin_matmul_triton",
        interpret=interpret,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if split > 1:
        out = _epilogue(out.sum(axis=0), n, swiglu, jnp.dtype(x.dtype), out_dtype)
    return out.reshape(*batch, *out_dims)


def _epilogue(total: jax.Array, n: int, swiglu: bool, dtype, out_dtype) -> jax.Array:
    """The kernel's epilogue on split-K sums (float32 [rows, n], or [rows, 2n] gate then up with
    swiglu), in the kernel's rounding order: [rows, n] in out_dtype."""
    if not swiglu:
        return total.astype(out_dtype)
    gate = total[:, :n].astype(dtype).astype(jnp.float32)
    silu = (gate / (1.0 + jnp.exp(-gate))).astype(dtype).astype(jnp.float32)
    return (silu * total[:, n:].astype(dtype).astype(jnp.float32)).astype(out_dtype)


def launch_constants(
    rows: int,
    k: int,
    n: int,
    w_strides: tuple[int, int],
    *,
    tiles: Tiles,
    dtype,
    up_offset: int = 0,
    swiglu: bool = False,
    group_stride: int = 0,
    gather: bool = False,
    repeat: int = 1,
    scatter: bool = False,
    scale: bool = False,
) -> dict:
    """The kernel's constexpr arguments for out [rows, n] = x [rows, k] @ w (w_strides: elements
    between consecutive k and consecutive n; up_offset: where the SwiGLU's up columns start past the
    up pointer's; group_stride > 0: grouped rows, each group's weight that many elements on; gather,
    repeat, scatter, scale: rows read through a source index over repeat, written through a
    destination index, multiplied by a factor)."""
    return dict(
        ROWS=rows,
        K=k,
        N=n,
        W_STRIDE_K=w_strides[0],
        W_STRIDE_N=w_strides[1],
        W_STRIDE_G=group_stride,
        UP_OFFSET=up_offset,
        SWIGLU=swiglu,
        GROUPED=group_stride > 0,
        GROUP_ROWS=next_power_of_2(rows),
        GATHER=gather,
        REPEAT=repeat,
        SCATTER=scatter,
        SCALE=scale,
        SPLIT_K=tiles.split_k,
        K_PER_SPLIT=-(-k // (tiles.block_k * tiles.split_k)) * tiles.block_k,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        PRECISION="ieee" if jnp.dtype(dtype) == jnp.float32 else "tf32",
    )
