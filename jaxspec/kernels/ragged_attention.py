"""Attention of a few new tokens per row over that row's KV cache (Pallas, Triton on GPU).

A decode step (one new token per row) or a speculative verification step (a few drafted nodes
per row) attends to the row's cached prefix, whose length differs per row and grows during the
rollout, while the cache is allocated for the longest possible sequence. Dense attention reads
every slot; this kernel reads KV blocks only up to each row's last new token.

The new tokens' keys and values are already in the cache, at slots new_start[b] + j for
j < num_new; which of them each query row sees is a tree mask, passed as bits (`new_token_bits`).
So one kernel computes the whole attention of a step: every query row sees the slots below
prefix_len[b] (new_start[b] for a row still generating, 0 for a finished one, which then reads
none of its prefix) and the new tokens its bits name.

The kernel returns flash-attention partials per split of the cache, unnormalised and relative
to a running maximum, which `merge` combines:

    o [B, Nk, splits, R, D] float32 = sum_s exp(score_s - m) v_s
    m [B, Nk, splits, R]    float32 = max_s score_s   (-inf where the split holds no visible slot)
    l [B, Nk, splits, R]    float32 = sum_s exp(score_s - m)

R is the number of query rows per (sequence, kv head): T new tokens x G query heads per kv head
(row r is token r // G), padded to a power of two. The grid is (sequence, kv head, split);
splits keep the GPU busy when batch x kv heads is small. `cache_attention_reference` computes
the same partials with jnp.
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
WORD_BITS = 32  # new tokens per int32 word of a query row's bits


class Partials(NamedTuple):
    """Flash-attention partials, as described in the module docstring."""

    o: jax.Array
    m: jax.Array
    l: jax.Array  # noqa: E741


def new_token_bits(tree_mask: jax.Array, group: int, rows: int) -> jax.Array:
    """int32 [B, W, rows]: bit j of word w of query row r is set iff token r // group sees new token
    32 w + j under tree_mask bool [B, T, T]; W = ceil(T / 32). Padding rows (r >= T * group) see
    no new token."""
    b, t, _ = tree_mask.shape
    words = pl.cdiv(t, WORD_BITS)
    padded = jnp.pad(tree_mask, ((0, 0), (0, 0), (0, words * WORD_BITS - t)))
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(WORD_BITS, dtype=jnp.uint32))
    bits = jnp.sum(padded.reshape(b, t, words, WORD_BITS).astype(jnp.uint32) * weights, axis=-1, dtype=jnp.uint32)
    bits = jnp.repeat(lax.bitcast_convert_type(bits, jnp.int32), group, axis=1)  # [B, T*G, W]
    return jnp.pad(bits, ((0, 0), (0, rows - t * group), (0, 0))).transpose(0, 2, 1)


def _visible(
    slot: jax.Array, prefix_len: jax.Array, new_start: jax.Array, words: list[jax.Array], num_new: int, max_len: int
) -> jax.Array:
    """bool [R, K]: which of the cache slots int32 [K] each query row sees, given its bits
    words[w] int32 [R] (see `new_token_bits`). Shared by the kernel and the reference."""
    rel = jnp.where(slot < max_len, slot - new_start, -1)  # new tokens past the last slot were dropped
    sees = jnp.broadcast_to((slot < prefix_len)[None, :], (words[0].shape[0], slot.shape[0]))
    for w, word in enumerate(words):
        in_word = (rel >= w * WORD_BITS) & (rel < min((w + 1) * WORD_BITS, num_new))
        shift = jnp.clip(rel - w * WORD_BITS, 0, WORD_BITS - 1)
        bit = jnp.right_shift(word[:, None], shift[None, :]) & 1
        sees = sees | (in_word[None, :] & (bit == 1))
    return sees


def _kernel(
    prefix_ref,
    start_ref,
    bits_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    m_ref,
    l_ref,
    *,
    block_k: int,
    blocks_per_split: int,
    num_new: int,
    scale: float,
):
    """One (sequence, kv head, split) program: q [R, D] against the split's visible slots."""
    prefix_len, new_start = prefix_ref[...], start_ref[...]
    words = [bits_ref[w, :] for w in range(bits_ref.shape[0])]
    q = q_ref[...]
    rows, head_dim = q.shape
    max_len = k_ref.shape[0]
    lanes = jnp.arange(block_k, dtype=jnp.int32)
    end = jnp.minimum(new_start + num_new, max_len)  # new tokens past the last slot were dropped
    lowest = jnp.where(prefix_len > 0, 0, lax.div(new_start, block_k))  # a finished row: its new tokens only
    first = pl.program_id(2) * blocks_per_split
    lo = jnp.maximum(lowest, first)
    hi = jnp.minimum(pl.cdiv(end, block_k), first + blocks_per_split)

    def body(block, carry):
        o, m, l = carry
        slot = block * block_k + lanes
        read = (slot < prefix_len) | ((slot >= new_start) & (slot < end))  # seen by some row
        window = pl.ds(block * block_k, block_k)
        k = plgpu.load(k_ref.at[window, :], mask=read[:, None], other=0.0)
        v = plgpu.load(v_ref.at[window, :], mask=read[:, None], other=0.0)
        scores = plgpu.dot(q, k, trans_b=True).astype(jnp.float32) * scale  # [R, block_k]
        scores = jnp.where(_visible(slot, prefix_len, new_start, words, num_new, max_len), scores, -jnp.inf)
        m_next = jnp.maximum(m, scores.max(axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a row that has seen nothing yet
        rescale = jnp.exp(m - m_safe)
        p = jnp.exp(scores - m_safe[:, None])
        o = rescale[:, None] * o + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return o, m_next, rescale * l + p.sum(axis=1)

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    o, m, l = lax.fori_loop(lo, jnp.maximum(hi, lo), body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def split_plan(
    batch: int, kv_heads: int, max_len: int, block_k: int = BLOCK_K, splits: int | None = None
) -> tuple[int, int]:
    """(splits, KV blocks per split) for a [batch, max_len, kv_heads, D] cache; `splits` asks for
    a number of splits (default: enough for TARGET_PROGRAMS programs), at most one per block."""
    num_blocks = pl.cdiv(max_len, block_k)
    if splits is None:
        splits = pl.cdiv(TARGET_PROGRAMS, batch * kv_heads)
    splits = max(1, min(num_blocks, splits))
    per_split = pl.cdiv(num_blocks, splits)
    return pl.cdiv(num_blocks, per_split), per_split


@functools.partial(jax.jit, static_argnames=("num_new", "interpret", "block_k", "splits", "num_warps", "num_stages"))
def cache_attention_pallas(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    prefix_len: jax.Array,
    new_start: jax.Array,
    new_bits: jax.Array,
    *,
    num_new: int,
    interpret: bool = False,
    block_k: int = BLOCK_K,
    splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Partials:
    """Partials of q [B, Nk, R, D] over k/v_cache [B, S, Nk, D]: row b's query rows see slots
    [0, prefix_len[b]) and, of the num_new slots from new_start[b] (both int32 [B]), those their
    bits new_bits int32 [B, W, R] name (`new_token_bits`).

    q and the cache share a dtype; R and D are powers of two >= 16. Scale 1/sqrt(D). block_k,
    splits (see `split_plan`), num_warps and num_stages tune the GPU kernel.
    """
    batch, kv_heads, rows, head_dim = q.shape
    max_len, words = k_cache.shape[1], new_bits.shape[1]
    splits, per_split = split_plan(batch, kv_heads, max_len, block_k, splits)
    kernel = functools.partial(
        _kernel, block_k=block_k, blocks_per_split=per_split, num_new=num_new, scale=head_dim**-0.5
    )
    per_row = pl.BlockSpec((None,), lambda b, h, s: (b,))
    cache_spec = pl.BlockSpec((None, max_len, None, head_dim), lambda b, h, s: (b, 0, h, 0))
    row_stats = pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0))
    o, m, l = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, splits),
        in_specs=[
            per_row,
            per_row,
            pl.BlockSpec((None, words, rows), lambda b, h, s: (b, 0, 0)),
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
            cache_spec,
            cache_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
            row_stats,
            row_stats,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, splits, rows), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_cache_attention",
    )(prefix_len.astype(jnp.int32), new_start.astype(jnp.int32), new_bits, q, k_cache, v_cache)
    return Partials(o, m, l)


def cache_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    prefix_len: jax.Array,
    new_start: jax.Array,
    new_bits: jax.Array,
    *,
    num_new: int,
    block_k: int = BLOCK_K,
    splits: int | None = None,
) -> Partials:
    """`cache_attention_pallas`'s partials with jnp, reading every slot (masked), split as the
    kernel splits the cache for this `block_k` and `splits`."""
    batch, kv_heads, rows, head_dim = q.shape
    max_len = k_cache.shape[1]
    splits, blocks_per_split = split_plan(batch, kv_heads, max_len, block_k, splits)
    per_split = blocks_per_split * block_k
    slot = jnp.arange(max_len, dtype=jnp.int32)
    visible = jax.vmap(lambda n, s, bits: _visible(slot, n, s, list(bits), num_new, max_len))(
        prefix_len, new_start, new_bits
    )
    scores = jnp.einsum("bkrd,bskd->bkrs", q, k_cache, preferred_element_type=jnp.float32) * head_dim**-0.5
    scores = jnp.where(visible[:, None], scores, -jnp.inf)
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
    over P parts (the cache's splits). Rows that attend to nothing give 0."""
    o, m, l = partials
    top = m.max(axis=-2, keepdims=True)
    weight = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - jnp.where(top == -jnp.inf, 0.0, top)))
    total = (weight * l).sum(axis=-2)
    out = (weight[..., None] * o).sum(axis=-3)
    return out / jnp.where(total == 0, 1.0, total)[..., None]
