"""The page pool of the slot engine: a free-page stack and the slots' page tables, on device.

Pages are handed out from the top of a stack of free page ids and pushed back when a slot is
released, all with static shapes and no host round trip. Slot s holds its first `held[s]`
page-table entries; the rest are `NO_PAGE` (`jaxspec.models.paged`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.models.paged import NO_PAGE


class PagePool(NamedTuple):
    """free: int32 [num_pages] stack of free page ids, valid below num_free; num_free: int32
    scalar; page_table: int32 [S, M]; held: int32 [S] pages each slot holds (entries [0, held))."""

    free: jax.Array
    num_free: jax.Array
    page_table: jax.Array
    held: jax.Array

    @classmethod
    def create(cls, num_pages: int, slots: int, pages_per_slot: int) -> PagePool:
        return cls(
            free=jnp.arange(num_pages, dtype=jnp.int32),
            num_free=jnp.asarray(num_pages, jnp.int32),
            page_table=jnp.full((slots, pages_per_slot), NO_PAGE, jnp.int32),
            held=jnp.zeros((slots,), jnp.int32),
        )


def pages_for(positions: jax.Array | int, page_size: int):
    """Pages that hold `positions` token positions (ceil division)."""
    return -(-positions // page_size)


def allocate(pool: PagePool, need: jax.Array, max_need: int) -> PagePool:
    """Gives slot s `need[s]` more pages (int32 [S], each <= max_need, static), appended to its page
    table, from the top of the free stack. The caller ensures sum(need) <= num_free and that
    held + need fits the table."""
    offsets = jnp.cumsum(need) - need  # [S] pages taken by the slots before s
    m = jnp.arange(max_need, dtype=jnp.int32)[None, :]
    take = m < need[:, None]  # [S, max_need]
    page = pool.free[jnp.clip(pool.num_free - 1 - (offsets[:, None] + m), 0, pool.free.shape[0] - 1)]
    column = jnp.where(take, pool.held[:, None] + m, pool.page_table.shape[1])  # out of range: dropped
    rows = jnp.arange(need.shape[0])[:, None]
    return pool._replace(
        num_free=pool.num_free - need.sum(),
        page_table=pool.page_table.at[rows, column].set(page, mode="drop"),
        held=pool.held + need,
    )


def release(pool: PagePool, slots: jax.Array) -> PagePool:
    """Pushes every page of the slots marked in bool [S] back onto the free stack and clears their
    page tables."""
    columns = jnp.arange(pool.page_table.shape[1], dtype=jnp.int32)[None, :]
    give = (slots[:, None] & (columns < pool.held[:, None])).reshape(-1)  # [S * M]
    position = pool.num_free + jnp.cumsum(give) - 1
    free = pool.free.at[jnp.where(give, position, pool.free.shape[0])].set(pool.page_table.reshape(-1), mode="drop")
    return PagePool(
        free=free,
        num_free=pool.num_free + give.sum(dtype=jnp.int32),
        page_table=jnp.where(slots[:, None], NO_PAGE, pool.page_table),
        held=jnp.where(slots, 0, pool.held),
    )


def newest_to_evict(admitted: jax.Array, occupied: jax.Array, held: jax.Array, need: jax.Array, num_free) -> jax.Array:
    """bool [S]: the fewest newest slots whose eviction lets the others get their pages.

    admitted int32 [S]: admission order of each slot's row (larger = newer); occupied bool [S];
    held int32 [S] pages each slot holds; need int32 [S] pages each slot needs now. Evicting a
    slot frees its pages and drops its need; slots are evicted newest first until the rest need
    at most the free pages plus those freed. Nothing is evicted when everything fits.
    """
    order = jnp.argsort(jnp.where(occupied, -admitted, jnp.iinfo(jnp.int32).max), stable=True)
    freed = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(jnp.where(occupied, held, 0)[order])])
    dropped = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(need[order])])
    fits = num_free + freed >= need.sum() - dropped  # [S + 1]: fits after evicting the first k
    count = jnp.sum(~fits)  # fits is monotone in k: the first k that fits
    return jnp.zeros(occupied.shape, bool).at[order].set(jnp.arange(occupied.shape[0]) < count) & occupied
