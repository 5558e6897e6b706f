"""The attention kernel's split partials merged into the attention output, in one kernel (Triton,
through jax-triton).

`jaxspec.kernels.paged_attention_triton` splits each (row, kv head)'s positions over programs and
returns flash-attention partials (`jaxspec.kernels.attention_partials.Partials`); XLA merged them
(`attention_partials.merge`) and moved the query rows back to the model's layout in two kernels per
layer. This kernel does both in one launch, one program per (row, kv head):

    m* [R]      = max_s m_s                                (0 where every split is empty)
    w_s [R]     = exp(m_s - m*), 0 where m_s = -inf
    out [R, D]  = sum_s w_s o_s / sum_s w_s l_s            (0 for a row that sees nothing)

and writes query row r (new token r // G, query head kv * G + r % G) of the output [B, T, Nq, D]
in the model's dtype; rows from T x G up to R (padding) are not written.

`triton` is imported with this module; `jax_triton` only when the kernel is called for a GPU, and
torch only to run it in Triton's interpreter (`interpret=True`, any backend, slow).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton.language as tl

from jaxspec.kernels import triton_call
from jaxspec.kernels.attention_partials import Partials
from jaxspec.kernels.paged_attention_triton import default_num_warps
from jaxspec.kernels.tree_race import next_power_of_2


def _merge_partials(
    o_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    KV_HEADS: tl.constexpr,
    SPLITS: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_NEW: tl.constexpr,
    GROUP: tl.constexpr,
):
    """One (row, kv head)'s program; shapes as in `merge_partials`."""
    pair = tl.program_id(0).to(tl.int64)  # row * KV_HEADS + kv head
    kv = pair % KV_HEADS
    r = tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    top = tl.full((ROWS,), float("-inf"), tl.float32)
    for s in range(SPLITS):
        top = tl.maximum(top, tl.load(m_ptr + (pair * SPLITS + s) * ROWS + r))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.full((ROWS,), 0.0, tl.float32)
    acc = tl.full((ROWS, BLOCK_D), 0.0, tl.float32)
    for s in range(SPLITS):
        at = (pair * SPLITS + s) * ROWS + r
        m = tl.load(m_ptr + at)
        weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
        total += weight * tl.load(l_ptr + at)
        o = tl.load(o_ptr + at[:, None] * HEAD_DIM + d[None, :], mask=(d < HEAD_DIM)[None, :], other=0.0)
        acc += weight[:, None] * o
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    token = r // GROUP
    head = kv * GROUP + r % GROUP
    row = pair // KV_HEADS
    dst = ((row * NUM_NEW + token) * (KV_HEADS * GROUP) + head)[:, None] * HEAD_DIM + d[None, :]
    written = (r < NUM_NEW * GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    tl.store(out_ptr + dst, out.to(out_ptr.dtype.element_ty), mask=written)


@functools.partial(jax.jit, static_argnames=("num_new", "group", "dtype", "interpret"))
def merge_partials(parts: Partials, *, num_new: int, group: int, dtype, interpret: bool = False) -> jax.Array:
    """The attention output [B, T, Nk * G, D] in `dtype` from the partials o [B, Nk, S, R, D], m and
    l [B, Nk, S, R] (float32) of T = num_new new tokens x G = group query heads per kv head (query
    row r: token r // G, query head kv * G + r % G; R >= T * G)."""
    batch, kv_heads, splits, rows, head_dim = parts.o.shape
    if rows < num_new * group or parts.m.shape != parts.o.shape[:-1] or parts.l.shape != parts.m.shape:
        raise ValueError(
            f"merge_partials: o {list(parts.o.shape)}, m {list(parts.m.shape)}, l {list(parts.l.shape)} must be "
            f"[B, Nk, S, R, D] and [B, Nk, S, R] with R >= num_new x group = {num_new * group}"
        )
    # Triton's interpreter converts float32 to bfloat16 by truncation, a GPU to the nearest: there
    # the kernel writes float32 and XLA rounds
    written = jnp.float32 if interpret and jnp.dtype(dtype) == jnp.bfloat16 else dtype
    (out,) = triton_call.call(
        _merge_partials,
        tuple(parts),
        (jax.ShapeDtypeStruct((batch, num_new, kv_heads * group, head_dim), written),),
        grid=(batch * kv_heads,),
        constants=launch_constants(kv_heads, splits, rows, head_dim, num_new=num_new, group=group),
        name="attention_merge_triton",
        interpret=interpret,
        num_warps=default_num_warps(rows, head_dim),  # the accumulator is the kernel's o
        num_stages=1,
    )
    return out.astype(dtype)


def launch_constants(kv_heads: int, splits: int, rows: int, head_dim: int, *, num_new: int, group: int) -> dict:
    """The kernel's constexpr arguments."""
    return dict(
        KV_HEADS=kv_heads,
        SPLITS=splits,
        ROWS=rows,
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        NUM_NEW=num_new,
        GROUP=group,
    )
