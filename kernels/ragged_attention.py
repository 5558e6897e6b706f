"""Attention of a few query rows over each sequence's filled KV-cache prefix (Pallas, Triton on GPU).

A decode step (one new token per row) or a speculative verification step (a few drafted nodes
per row) attends to the row's cached prefix, whose length differs per row and grows during the
rollout, while the cache is allocated for the longest possible sequence. Dense attention reads
every slot; this kernel reads KV blocks only up to each row's length.

The kernel returns flash-attention partials, unnormalised and relative to a running maximum, so
that the caller can merge them with the attention over the new tokens themselves (which follow a
tree mask) and across sequence splits:

    o [B, Nk, splits, R, D] float32 = sum_s exp(score_s - m) v_s
    m [B, Nk, splits, R]    float32 = max_s score_s   (-inf where the split holds no slot)
    l [B, Nk, splits, R]    float32 = sum_s exp(score_s - m)

R is the number of query rows per (sequence, kv head): T new tokens x G query heads per kv head,
padded to a power of two. The grid is (sequence, kv head, split); splits keep the GPU busy when
batch x kv heads is small. `prefix_attention_reference` computes the same partials with jnp.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

TARGET_PROGRAMS = 1024  # (sequence, kv head, split) programs that keep an H100's 132 SMs busy
BLOCK_K = 64  # cache slots per KV block


class Partials(NamedTuple):
    """Flash-attention partials, as described in the module docstring."""

    o: jax.Array
    m: jax.Array
    l: jax.Array  # noqa: E741


def _prefix_kernel(length_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, block_k: int,
                   blocks_per_split: int, scale: float):
    """One (sequence, kv head, split) program: q [R, D] against slots [0, length) of the split."""
    length = length_ref[...]
    q = q_ref[...]
    rows, head_dim = q.shape
    lanes = jnp.arange(block_k, dtype=jnp.int32)
    first = pl.program_id(2) * blocks_per_split
    end = jnp.minimum(pl.cdiv(length, block_k), first + blocks_per_split)

    def body(block, carry):
        o, m, l = carry
        slot = block * block_k + lanes
        valid = slot < length
        window = pl.ds(block * block_k, block_k)
        k = plgpu.load(k_ref.at[window, :], mask=valid[:, None], other=0.0)
        v = plgpu.load(v_ref.at[window, :], mask=valid[:, None], other=0.0)
        scores = plgpu.dot(q, k, trans_b=True).astype(jnp.float32) * scale  # [R, block_k]
        scores = jnp.where(valid[None, :], scores, -jnp.inf)
        m_next = jnp.maximum(m, scores.max(axis=1))  # finite: a block's first slot is always valid
        rescale = jnp.exp(m - m_next)
        p = jnp.exp(scores - m_next[:, None])
        o = rescale[:, None] * o + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return o, m_next, rescale * l + p.sum(axis=1)

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, l = lax.fori_loop(first, jnp.maximum(end, first), body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def split_plan(batch: int, kv_heads: int, max_len: int, block_k: int = BLOCK_K,
               splits: int | None = None) -> tuple[int, int]:
    """(splits, KV blocks per split) for a [batch, max_len, kv_heads, D] cache; `splits` asks for
    a number of splits (default: enough for TARGET_PROGRAMS programs), at most one per block."""
    num_blocks = pl.cdiv(max_len, block_k)
    if splits is None:
        splits = pl.cdiv(TARGET_PROGRAMS, batch * kv_heads)
    splits = max(1, min(num_blocks, splits))
    per_split = pl.cdiv(num_blocks, splits)
    return pl.cdiv(num_blocks, per_split), per_split


@functools.partial(jax.jit, static_argnames=("interpret", "block_k", "splits", "num_warps", "num_stages"))
def prefix_attention_pallas(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, *,
                            interpret: bool = False, block_k: int = BLOCK_K, splits: int | None = None,
                            num_warps: int = 4, num_stages: int = 2) -> Partials:
    """Partials of q [B, Nk, R, D] over k/v_cache [B, S, Nk, D] slots [0, lengths[b]) (int32 [B]).

    q and the cache share a dtype; R and D are powers of two >= 16. Scale 1/sqrt(D). block_k,
    splits (see `split_plan`), num_warps and num_stages tune the GPU kernel.
    """
    batch, kv_heads, rows, head_dim = q.shape
    max_len = k_cache.shape[1]
    splits, per_split = split_plan(batch, kv_heads, max_len, block_k, splits)
    kernel = functools.partial(_prefix_kernel, block_k=block_k, blocks_per_split=per_split,
                               scale=head_dim ** -0.5)
    cache_spec = pl.BlockSpec((None, max_len, None, head_dim), lambda b, h, s: (b, 0, h, 0))
    row_stats = pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, splits),
        in_specs=[pl.BlockSpec((None,), lambda b, h, s: (b,)),
                  pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
                  cache_spec, cache_spec],
        out_specs=[pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
                   row_stats, row_stats],
        out_shape=[jax.ShapeDtypeStruct((batch, kv_heads, splits, rows, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), jnp.float32),
                   jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_prefix_attention",
    )(lengths.astype(jnp.int32), q, k_cache, v_cache)
    return Partials(o, m, l)


def prefix_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array, *,
                               block_k: int = BLOCK_K, splits: int | None = None) -> Partials:
    """`prefix_attention_pallas`'s partials with jnp, reading every slot (masked), split as the
    kernel splits the cache for this `block_k` and `splits`."""
    batch, kv_heads, rows, head_dim = q.shape
    max_len = k_cache.shape[1]
    splits, blocks_per_split = split_plan(batch, kv_heads, max_len, block_k, splits)
    per_split = blocks_per_split * block_k
    scores = jnp.einsum("bkrd,bskd->bkrs", q, k_cache, preferred_element_type=jnp.float32) * head_dim ** -0.5
    slot = jnp.arange(max_len)
    scores = jnp.where((slot[None, :] < lengths[:, None])[:, None, None, :], scores, -jnp.inf)
    pad = splits * per_split - max_len
    scores = jnp.pad(scores, ((0, 0),) * 3 + ((0, pad),), constant_values=-jnp.inf)
    scores = scores.reshape(batch, kv_heads, rows, splits, per_split).transpose(0, 1, 3, 2, 4)
    m = scores.max(axis=-1)
    p = jnp.exp(scores - jnp.where(m == -jnp.inf, 0.0, m)[..., None])
    v = jnp.pad(v_cache, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(batch, splits, per_split, kv_heads, head_dim)
    o = jnp.einsum("bkcrs,bcskd->bkcrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return Partials(o, m, p.sum(axis=-1))


def merge(partials: Partials) -> jax.Array:
    """Normalised attention [..., R, D] float32 from partials o [..., P, R, D], m / l [..., P, R]
    over P parts (splits, or prefix and new tokens). Rows that attend to nothing give 0."""
    o, m, l = partials
    top = m.max(axis=-2, keepdims=True)
    weight = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - jnp.where(top == -jnp.inf, 0.0, top)))
    total = (weight * l).sum(axis=-2)
    out = (weight[..., None] * o).sum(axis=-3)
    return out / jnp.where(total == 0, 1.0, total)[..., None]
