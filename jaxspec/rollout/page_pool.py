"""The page pool of the slot engine: a free-page stack, reference counts and the slots' page
tables, on device.

Pages are handed out from the top of a stack of free page ids and pushed back when their last
holder lets go, all with static shapes and no host round trip. Slot s holds its first `held[s]`
page-table entries (`NO_PAGE` entries among them hold nothing; past them all are `NO_PAGE`,
`jaxspec.models.paged`). A page may have several holders (rows of one prompt sharing its
prefix, and the prefix cache itself): `refs` counts them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.models.paged import NO_PAGE


class PagePool(NamedTuple):
    """free: int32 [num_pages] stack of free page ids, valid below num_free; num_free: int32
    scalar; refs: int32 [num_pages] holders of each page (0 = free); page_table: int32 [S, M];
    held: int32 [S] page-table entries each slot holds ([0, held))."""

    free: jax.Array
    num_free: jax.Array
    refs: jax.Array
    page_table: jax.Array
    held: jax.Array

    @classmethod
    def create(cls, num_pages: int, slots: int, pages_per_slot: int) -> PagePool:
        return cls(
            free=jnp.arange(num_pages, dtype=jnp.int32),
            num_free=jnp.asarray(num_pages, jnp.int32),
            refs=jnp.zeros((num_pages,), jnp.int32),
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
        refs=pool.refs.at[jnp.where(take, page, NO_PAGE)].set(1, mode="drop"),
        page_table=pool.page_table.at[rows, column].set(page, mode="drop"),
        held=pool.held + need,
    )


def add_refs(pool: PagePool, pages: jax.Array) -> PagePool:
    """One more holder for every page id in `pages` (any shape; `NO_PAGE` entries are skipped)."""
    return pool._replace(refs=pool.refs.at[pages.reshape(-1)].add(1, mode="drop"))


def drop_refs(pool: PagePool, pages: jax.Array) -> PagePool:
    """One holder fewer for every page id in `pages` (any shape, ids may repeat; `NO_PAGE` entries
    are skipped); pages left with no holder go back onto the free stack."""
    num_pages = pool.refs.shape[0]
    refs = pool.refs.at[pages.reshape(-1)].add(-1, mode="drop")
    back = (pool.refs > 0) & (refs == 0)  # a page dropped was held: only those can reach 0
    position = pool.num_free + jnp.cumsum(back) - 1
    free = pool.free.at[jnp.where(back, position, num_pages)].set(jnp.arange(num_pages, dtype=jnp.int32), mode="drop")
    return pool._replace(free=free, num_free=pool.num_free + back.sum(dtype=jnp.int32), refs=refs)


def held_pages(pool: PagePool, slots: jax.Array) -> jax.Array:
    """int32 [S, M]: the pages the slots marked in bool [S] hold, `NO_PAGE` elsewhere."""
    columns = jnp.arange(pool.page_table.shape[1], dtype=jnp.int32)[None, :]
    return jnp.where(slots[:, None] & (columns < pool.held[:, None]), pool.page_table, NO_PAGE)


def release(pool: PagePool, slots: jax.Array) -> PagePool:
    """The slots marked in bool [S] let go of their pages (those with no other holder go back to
    the free stack) and their page tables are cleared."""
    pool = drop_refs(pool, held_pages(pool, slots))
    return pool._replace(
        page_table=jnp.where(slots[:, None], NO_PAGE, pool.page_table),
        held=jnp.where(slots, 0, pool.held),
    )


def newest_to_evict(admitted: jax.Array, occupied: jax.Array, pool: PagePool, need: jax.Array) -> jax.Array:
    """bool [S]: the fewest newest slots whose eviction lets the others get their pages.

    admitted int32 [S]: admission order of each slot's row (larger = newer); occupied bool [S];
    need int32 [S] new pages each slot needs now. Evicting a set of slots frees the pages that
    no one else holds (a page shared with a slot kept, or held by the prefix cache, stays) and
    drops their need; slots are evicted newest first until the rest need at most the free pages
    plus those freed. Nothing is evicted when everything fits.
    """
    slots = occupied.shape[0]
    order = jnp.argsort(jnp.where(occupied, -admitted, jnp.iinfo(jnp.int32).max), stable=True)
    rank = jnp.zeros((slots,), jnp.int32).at[order].set(jnp.arange(slots, dtype=jnp.int32))  # 0 = newest
    pages = held_pages(pool, occupied)
    num_pages = pool.refs.shape[0]
    holders = jnp.zeros((num_pages,), jnp.int32).at[pages.reshape(-1)].add(1, mode="drop")
    last = (
        jnp.full((num_pages,), -1, jnp.int32)
        .at[pages.reshape(-1)]
        .max(jnp.broadcast_to(rank[:, None], pages.shape).reshape(-1), mode="drop")
    )  # a page is freed once its last holder in eviction order goes
    freeable = (holders > 0) & (holders == pool.refs)
    by_rank = jnp.zeros((slots + 1,), jnp.int32).at[jnp.where(freeable, last, slots)].add(1)
    freed = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(by_rank[:slots])])
    dropped = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(need[order])])
    fits = pool.num_free + freed >= need.sum() - dropped  # [S + 1]: fits after evicting the first k
    count = jnp.sum(~fits)  # fits is monotone in k: the first k that fits
    return (rank < count) & occupied
