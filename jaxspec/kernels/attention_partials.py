"""Flash-attention partials of a few new tokens per row, and the tree-mask bits that say which new
tokens each query row sees: the contract of the attention kernel
(`jaxspec.kernels.paged_attention_triton`) and its jnp reference.

A decode step (one new token per row) or a speculative verification step (a few drafted nodes
per row) attends to the row's cached prefix and, through a tree mask, to the new tokens, whose
keys and values are already in the cache at positions new_start[b] + j for j < num_new. Every
query row sees the positions below prefix_len[b] (new_start[b] for a row still generating, 0 for
a finished one, which then reads none of its prefix) and the new tokens its bits name
(`new_token_bits`).

The kernel returns partials per split of a row's positions, unnormalised and relative to a
running maximum, which `merge` combines:

    o [B, Nk, splits, R, D] float32 = sum_s exp(score_s - m) v_s
    m [B, Nk, splits, R]    float32 = max_s score_s   (-inf where the split holds no visible position)
    l [B, Nk, splits, R]    float32 = sum_s exp(score_s - m)

R is the number of query rows per (row, kv head): T new tokens x G query heads per kv head (row r
is token r // G), padded to a power of two, at most MAX_QUERY_ROWS (what one kernel program
holds in registers). `partials_reference` computes the same partials with jnp, split as the
kernel splits.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

WORD_BITS = 32  # new tokens per int32 word of a query row's bits
MAX_QUERY_ROWS = 128  # query rows per (row, kv head) the kernel takes: new tokens x query heads per kv head


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
    words = -(-t // WORD_BITS)
    padded = jnp.pad(tree_mask, ((0, 0), (0, 0), (0, words * WORD_BITS - t)))
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(WORD_BITS, dtype=jnp.uint32))
    bits = jnp.sum(padded.reshape(b, t, words, WORD_BITS).astype(jnp.uint32) * weights, axis=-1, dtype=jnp.uint32)
    bits = jnp.repeat(lax.bitcast_convert_type(bits, jnp.int32), group, axis=1)  # [B, T*G, W]
    return jnp.pad(bits, ((0, 0), (0, rows - t * group), (0, 0))).transpose(0, 2, 1)


def causal_token_bits(num_new: int, group: int, rows: int) -> np.ndarray:
    """`new_token_bits` of the causal mask of `num_new` new tokens, for one row: int32 [1, W, rows]
    (a constant; the kernel reads a leading axis of 1 as every row's bits), so that a causal step
    computes no bits on the device."""
    words = -(-num_new // WORD_BITS)
    token = np.minimum(np.arange(rows) // group, num_new)  # padding rows: past the last token
    seen = (np.arange(words * WORD_BITS)[None, :] <= token[:, None]) & (token < num_new)[:, None]  # [R, 32 W]
    weights = np.left_shift(np.uint64(1), np.arange(WORD_BITS, dtype=np.uint64))
    packed = (seen.reshape(rows, words, WORD_BITS) * weights).sum(axis=-1).astype(np.uint32)  # [R, W]
    return packed.view(np.int32).T[None].copy()


def _visible(
    slot: jax.Array, prefix_len: jax.Array, new_start: jax.Array, words: list[jax.Array], num_new: int, max_len: int
) -> jax.Array:
    """bool [R, K]: which of the positions int32 [K] each query row sees, given its bits words[w]
    int32 [R] (see `new_token_bits`)."""
    rel = jnp.where(slot < max_len, slot - new_start, -1)  # new tokens past the last position were dropped
    sees = jnp.broadcast_to((slot < prefix_len)[None, :], (words[0].shape[0], slot.shape[0]))
    for w, word in enumerate(words):
        in_word = (rel >= w * WORD_BITS) & (rel < min((w + 1) * WORD_BITS, num_new))
        shift = jnp.clip(rel - w * WORD_BITS, 0, WORD_BITS - 1)
        bit = jnp.right_shift(word[:, None], shift[None, :]) & 1
        sees = sees | (in_word[None, :] & (bit == 1))
    return sees


def split_runs(
    prefix_len: jax.Array, new_start: jax.Array, *, num_new: int, max_len: int, block_kv: int, splits: int
) -> tuple[jax.Array, jax.Array]:
    """(first, last) int32 [B, splits]: the blocks of `block_kv` positions [first, last) that each
    split of a row reads, as the kernel shares them: the row's blocks up to its last new token
    (new tokens past max_len dropped), from block 0, or from its new tokens' first block for a
    finished row (prefix_len 0), in `splits` contiguous runs of equal length (the last ones short
    or empty)."""
    end = jnp.minimum(new_start + num_new, max_len)
    lo = jnp.where(prefix_len > 0, 0, new_start // block_kv)
    hi = (end + block_kv - 1) // block_kv
    per_split = (jnp.maximum(hi - lo, 0) + splits - 1) // splits
    first = lo[:, None] + jnp.arange(splits, dtype=jnp.int32)[None, :] * per_split[:, None]
    return first, jnp.minimum(hi[:, None], first + per_split[:, None])


def partials_reference(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    page_table: jax.Array,
    prefix_len: jax.Array,
    new_start: jax.Array,
    new_bits: jax.Array,
    *,
    num_new: int,
    block_kv: int,
    splits: int,
) -> Partials:
    """The kernel's partials with jnp: q [B, Nk, R, D] over the pages of k/v_pool [num_pages,
    page_size, Nk, D] that page_table int32 [B, M] names (an entry outside the pool reads as a
    page of zeros), row b's query rows seeing positions [0, prefix_len[b]) and the new tokens from
    new_start[b] their bits new_bits int32 [B, W, R] name (or [1, W, R]: every row's); every
    position is scored (masked) and assigned to the split whose run (`split_runs`) holds its block.
    Returns o [B, Nk, splits, R, D], m and l [B, Nk, splits, R], float32."""
    batch, kv_heads, rows, head_dim = q.shape
    max_len = page_table.shape[1] * k_pool.shape[1]

    def dense(pool):
        view = jnp.take(pool, page_table, axis=0, mode="fill", fill_value=0)  # [B, M, page, Nk, D]
        return view.reshape(batch, max_len, kv_heads, head_dim)

    k, v = dense(k_pool), dense(v_pool)
    position = jnp.arange(max_len, dtype=jnp.int32)
    new_bits = jnp.broadcast_to(new_bits, (batch, *new_bits.shape[1:]))
    visible = jax.vmap(lambda n, s, bits: _visible(position, n, s, list(bits), num_new, max_len))(
        prefix_len, new_start, new_bits
    )  # [B, R, S]
    first, last = split_runs(prefix_len, new_start, num_new=num_new, max_len=max_len, block_kv=block_kv, splits=splits)
    block = (position // block_kv)[None, None, :]
    in_split = (block >= first[:, :, None]) & (block < last[:, :, None])  # [B, splits, S]
    scores = jnp.einsum("bkrd,bskd->bkrs", q, k, preferred_element_type=jnp.float32) * head_dim**-0.5
    seen = visible[:, None, None, :, :] & in_split[:, None, :, None, :]  # [B, 1, splits, R, S]
    scores = jnp.where(seen, scores[:, :, None], -jnp.inf)  # [B, Nk, splits, R, S]
    m = scores.max(axis=-1)
    p = jnp.exp(scores - jnp.where(m == -jnp.inf, 0.0, m)[..., None])
    o = jnp.einsum("bkcrs,bskd->bkcrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
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
