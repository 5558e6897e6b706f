"""A decode or verification step's attention prologue in one kernel (Triton, through jax-triton):
from the fused q/k/v projection of a layer's new tokens to the attention kernel's query rows, with
the new keys and values written into the layer's KV pool.

Per layer, XLA runs this part of a step as several small kernels that read no weights (the q and
k norms' reductions and scalings, rope, the two KV scatters, the query rows' transpose and pad),
each a few microseconds, which a small or low-batch step's time is mostly made of. This kernel is
one launch per layer. Its input is the output of the fused GEMM over `qkv` [C, Nk, G + 2, D]
(`jaxspec.models.params.fuse_qkv`): proj [B, T, Nk, G + 2, D], kv head j's G query heads, then its
k, then its v. One program per (row, kv head) computes, in the model's rounding order
(`jaxspec.models.blocks.qkv`: the bias added in the projection's dtype, the norm's float32 scale
cast back before its weight, rope in float32):

    q_rows [B, Nk, R, D]: query row t * G + g = rope(q_norm(q[t, g] + q_bias)), zero past T * G
    k_pool at position cache_len[b] + t of row b: rope(k_norm(k[t] + k_bias))
    v_pool there: v[t] + v_bias

A position goes to page page_table[b, p // page_size] at offset p % page_size (a dense cache
[B, S, Nk, D] is B pages of S positions, row b's table naming page b); a position with no page
(`NO_PAGE`, or past the table) is dropped, as `jaxspec.models.paged.paged_write` drops it. The
pools come back as the same buffers (`input_output_aliases`): only the new positions are written.
`jaxspec.models.attention_prologue.attention_prologue_reference` is the same in jnp.

`triton` is imported with this module; `jax_triton` only when the kernel is called for a GPU, and
torch only to run it in Triton's interpreter (`interpret=True`, any backend, slow).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton.language as tl

from jaxspec.kernels import triton_call
from jaxspec.kernels.tree_race import next_power_of_2


def _attention_prologue(
    proj_ptr,
    bias_ptr,
    q_norm_ptr,
    k_norm_ptr,
    cos_ptr,
    sin_ptr,
    lens_ptr,
    table_ptr,
    k_pool_ptr,
    v_pool_ptr,
    q_rows_ptr,
    k_pool_out_ptr,
    v_pool_out_ptr,
    NUM_NEW: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
    NUM_PAGES: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TABLE_LEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QK_NORM: tl.constexpr,
    EPS: tl.constexpr,
):
    """One (row, kv head) program; shapes as in `attention_prologue`. The pools are updated in place,
    through k_pool / v_pool; k_pool_out / v_pool_out are never read (`triton_call.call`: an updated
    argument's output parameter)."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    width = GROUP + 2
    half = HEAD_DIM // 2
    dims = tl.arange(0, HEAD_DIM)
    turned = (dims + half) % HEAD_DIM  # the element rope rotates into each place
    sign = tl.where(dims < half, -1.0, 1.0)
    heads = tl.arange(0, GROUP_BLOCK)
    is_head = heads < GROUP
    dtype = q_rows_ptr.dtype.element_ty
    cache_dtype = k_pool_ptr.dtype.element_ty
    start = tl.load(lens_ptr + b)
    for t in tl.static_range(NUM_NEW):
        base = ((b * NUM_NEW + t) * KV_HEADS + j) * width * HEAD_DIM
        cos = tl.load(cos_ptr + (b * NUM_NEW + t) * HEAD_DIM + dims)
        sin = tl.load(sin_ptr + (b * NUM_NEW + t) * HEAD_DIM + dims)
        # the G query heads [GROUP_BLOCK, D] at each place and at the place rope turns into it
        at = heads[:, None] * HEAD_DIM + dims[None, :]
        at_turned = heads[:, None] * HEAD_DIM + turned[None, :]
        q = tl.load(proj_ptr + base + at, mask=is_head[:, None], other=0.0).to(tl.float32)
        q_turned = tl.load(proj_ptr + base + at_turned, mask=is_head[:, None], other=0.0).to(tl.float32)
        k = tl.load(proj_ptr + base + GROUP * HEAD_DIM + dims).to(tl.float32)
        k_turned = tl.load(proj_ptr + base + GROUP * HEAD_DIM + turned).to(tl.float32)
        v = tl.load(proj_ptr + base + (GROUP + 1) * HEAD_DIM + dims).to(tl.float32)
        if HAS_BIAS:  # added in the projection's dtype
            bias = bias_ptr + j * width * HEAD_DIM
            q = (q + tl.load(bias + at, mask=is_head[:, None], other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
            q_turned = q_turned + tl.load(bias + at_turned, mask=is_head[:, None], other=0.0).to(tl.float32)
            q_turned = q_turned.to(dtype).to(tl.float32)
            k = (k + tl.load(bias + GROUP * HEAD_DIM + dims).to(tl.float32)).to(dtype).to(tl.float32)
            k_turned = (k_turned + tl.load(bias + GROUP * HEAD_DIM + turned).to(tl.float32)).to(dtype).to(tl.float32)
            v = (v + tl.load(bias + (GROUP + 1) * HEAD_DIM + dims).to(tl.float32)).to(dtype).to(tl.float32)
        if QK_NORM:  # weight * (x * rsqrt(mean(x^2) + eps)) cast to the dtype first
            q_scale = 1.0 / tl.sqrt(tl.reduce(q * q, 1, triton_call.SUM) / HEAD_DIM + EPS)
            q_w = tl.load(q_norm_ptr + dims).to(tl.float32)
            q_w_turned = tl.load(q_norm_ptr + turned).to(tl.float32)
            q = (q_w[None, :] * (q * q_scale[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            q_turned = (q_w_turned[None, :] * (q_turned * q_scale[:, None]).to(dtype).to(tl.float32)).to(dtype)
            q_turned = q_turned.to(tl.float32)
            k_scale = 1.0 / tl.sqrt(tl.reduce(k * k, 0, triton_call.SUM) / HEAD_DIM + EPS)
            k_w = tl.load(k_norm_ptr + dims).to(tl.float32)
            k_w_turned = tl.load(k_norm_ptr + turned).to(tl.float32)
            k = (k_w * (k * k_scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            k_turned = (k_w_turned * (k_turned * k_scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        q = q * cos[None, :] + sign[None, :] * q_turned * sin[None, :]
        k = k * cos + sign * k_turned * sin
        row = (b * KV_HEADS + j) * ROWS + t * GROUP + heads
        tl.store(q_rows_ptr + row[:, None] * HEAD_DIM + dims[None, :], q.to(dtype), mask=is_head[:, None])
        # the new key and value, at the position's page (none: dropped)
        position = start + t
        index = position // PAGE_SIZE
        page = tl.load(table_ptr + b * TABLE_LEN + tl.minimum(index, TABLE_LEN - 1))
        held = (page >= 0) & (page < NUM_PAGES) & (index < TABLE_LEN)
        slot = ((tl.where(held, page, 0).to(tl.int64) * PAGE_SIZE + position % PAGE_SIZE) * KV_HEADS + j) * HEAD_DIM
        write = dims + tl.where(held, 0, HEAD_DIM) < HEAD_DIM  # every dim of a held position, else none
        tl.store(k_pool_ptr + slot + dims, k.to(dtype).to(cache_dtype), mask=write)
        tl.store(v_pool_ptr + slot + dims, v.to(dtype).to(cache_dtype), mask=write)
    pad = NUM_NEW * GROUP + tl.arange(0, PAD_BLOCK)
    pad_row = (b * KV_HEADS + j) * ROWS + pad
    zeros = tl.full((PAD_BLOCK, HEAD_DIM), 0.0, tl.float32).to(dtype)
    tl.store(q_rows_ptr + pad_row[:, None] * HEAD_DIM + dims[None, :], zeros, mask=(pad < ROWS)[:, None])


@functools.partial(jax.jit, static_argnames=("rows", "eps", "interpret", "num_warps"))
def attention_prologue(
    proj: jax.Array,
    bias: jax.Array | None,
    q_norm: jax.Array | None,
    k_norm: jax.Array | None,
    cos: jax.Array,
    sin: jax.Array,
    cache_len: jax.Array,
    page_table: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    *,
    rows: int,
    eps: float,
    interpret: bool = False,
    num_warps: int = 4,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q_rows [B, Nk, rows, D] in proj's dtype, k_pool, v_pool) for proj [B, T, Nk, G + 2, D]
    (module docstring); bias [Nk, G + 2, D] or None; q_norm, k_norm [D] or both None; cos, sin
    float32 [B, T, D]; cache_len int32 [B]: row b's new tokens go to positions cache_len[b] + t;
    page_table int32 [B, M]; k_pool, v_pool [num_pages, page_size, Nk, D] (any float dtype).
    rows: a power of two >= T * G (the attention kernel's query rows); D a power of two."""
    b, t, nk, width, d = proj.shape
    if rows < t * (width - 2) or rows & (rows - 1) or d & (d - 1):
        raise ValueError(
            f"attention prologue: rows ({rows}) must be a power of two >= T x G = {t * (width - 2)} and the "
            f"head dim ({d}) a power of two, from proj [B, T, Nk, G + 2, D] = {proj.shape}"
        )
    has_bias, qk_norm = bias is not None, q_norm is not None
    dummy = jnp.zeros((1,), proj.dtype)
    args = (
        proj,
        bias if has_bias else dummy,
        q_norm if qk_norm else dummy,
        k_norm if qk_norm else dummy,
        cos.astype(jnp.float32),
        sin.astype(jnp.float32),
        cache_len.astype(jnp.int32),
        page_table.astype(jnp.int32),
        k_pool,
        v_pool,
    )
    out_shape = (
        jax.ShapeDtypeStruct((b, nk, rows, d), proj.dtype),
        jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
        jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype),
    )
    grid, constants = launch(proj, page_table, k_pool, rows=rows, eps=eps, has_bias=has_bias, qk_norm=qk_norm)
    return triton_call.call(
        _attention_prologue,
        args,
        out_shape,
        grid=grid,
        constants=constants,
        name="attention_prologue_triton",
        interpret=interpret,
        num_warps=num_warps,
        num_stages=1,
        input_output_aliases={8: 1, 9: 2},
    )


def launch(proj, page_table, k_pool, *, rows: int, eps: float, has_bias: bool, qk_norm: bool) -> tuple:
    """(grid, the kernel's constexpr arguments) of `attention_prologue` for arrays (or
    jax.ShapeDtypeStruct) of these shapes."""
    b, t, nk, width, d = proj.shape
    group = width - 2
    constants = dict(
        NUM_NEW=t,
        KV_HEADS=nk,
        GROUP=group,
        GROUP_BLOCK=next_power_of_2(group),
        HEAD_DIM=d,
        ROWS=rows,
        PAD_BLOCK=next_power_of_2(max(1, rows - t * group)),
        NUM_PAGES=k_pool.shape[0],
        PAGE_SIZE=k_pool.shape[1],
        TABLE_LEN=page_table.shape[1],
        HAS_BIAS=has_bias,
        QK_NORM=qk_norm,
        EPS=float(eps),
    )
    return (b, nk), constants
