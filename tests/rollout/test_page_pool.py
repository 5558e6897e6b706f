"""The slot engine's page pool: allocation, release and the preemption choice, against plain Python."""

import jax.numpy as jnp
import numpy as np

from jaxspec.models.paged import NO_PAGE
from jaxspec.rollout.page_pool import PagePool, add_refs, allocate, drop_refs, newest_to_evict, release


def owned(pool: PagePool) -> list[list[int]]:
    table, held = np.asarray(pool.page_table), np.asarray(pool.held)
    return [table[s, : held[s]].tolist() for s in range(table.shape[0])]


def test_pages_are_owned_once_and_return_to_the_pool():
    pool = PagePool.create(num_pages=10, slots=3, pages_per_slot=4)
    pool = allocate(pool, jnp.asarray([2, 0, 3]), 4)
    pool = allocate(pool, jnp.asarray([1, 2, 0]), 4)
    pages = owned(pool)
    assert [len(p) for p in pages] == [3, 2, 3] and int(pool.num_free) == 2
    flat = sum(pages, [])
    free = np.asarray(pool.free)[: int(pool.num_free)].tolist()
    assert sorted(flat + free) == list(range(10))  # every page is owned once or free
    assert np.all(np.asarray(pool.page_table)[1, 2:] == NO_PAGE)
    pool = release(pool, jnp.asarray([True, False, True]))
    assert owned(pool) == [[], pages[1], []] and int(pool.num_free) == 8
    assert sorted(np.asarray(pool.free)[:8].tolist() + pages[1]) == list(range(10))
    assert np.all(np.asarray(pool.page_table)[[0, 2]] == NO_PAGE)


def pool_holding(pages: list[list[int]], num_pages: int, extra_refs: tuple[int, ...] = ()) -> PagePool:
    """A pool whose slot s holds pages[s] (pages may be shared), with one more holder for each of
    extra_refs (the prefix cache)."""
    pool = PagePool.create(num_pages, len(pages), 4)
    table = np.full((len(pages), 4), NO_PAGE, np.int64)
    refs = np.zeros(num_pages, np.int32)
    for s, owned_pages in enumerate(pages):
        table[s, : len(owned_pages)] = owned_pages
        refs[owned_pages] += 1
    refs[list(extra_refs)] += 1
    free = [p for p in range(num_pages) if refs[p] == 0]
    return pool._replace(
        free=jnp.asarray(free + [0] * (num_pages - len(free)), jnp.int32),
        num_free=jnp.asarray(len(free), jnp.int32),
        refs=jnp.asarray(refs),
        page_table=jnp.asarray(table.astype(np.int32)),
        held=jnp.asarray([len(p) for p in pages], jnp.int32),
    )


def test_a_shared_page_returns_to_the_pool_with_its_last_holder():
    pool = pool_holding([[0, 1, 2], [0, 1, 3], [4]], num_pages=6, extra_refs=(0,))
    pool = release(pool, jnp.asarray([True, False, False]))
    assert sorted(np.asarray(pool.free)[: int(pool.num_free)].tolist()) == [2, 5]  # 0 and 1 are still held
    pool = release(pool, jnp.asarray([False, True, False]))
    assert sorted(np.asarray(pool.free)[: int(pool.num_free)].tolist()) == [1, 2, 3, 5]  # 0: the cache
    pool = drop_refs(pool, jnp.asarray([0, NO_PAGE]))
    assert sorted(np.asarray(pool.free)[: int(pool.num_free)].tolist()) == [0, 1, 2, 3, 5]
    assert np.asarray(pool.refs).tolist() == [0, 0, 0, 0, 1, 0]
    pool = add_refs(pool, jnp.asarray([4, 4]))
    assert int(pool.refs[4]) == 3


def test_newest_rows_are_evicted_until_the_rest_fits():
    admitted = jnp.asarray([4, 1, 7, 3])
    occupied = jnp.asarray([True, True, True, False])
    need = jnp.asarray([1, 1, 1, 0])
    # slot 0 holds 3 pages, slot 1 five, slot 2 two; none shared
    pages = [[0, 1, 2], [3, 4, 5, 6], [7, 8], []]

    def evicted(pool):
        return np.flatnonzero(np.asarray(newest_to_evict(admitted, occupied, pool, need))).tolist()

    def with_free(pool, num_free):
        return pool._replace(num_free=jnp.asarray(num_free, jnp.int32))

    pool = pool_holding(pages, num_pages=12)
    assert evicted(with_free(pool, 3)) == []  # everything fits
    assert evicted(with_free(pool, 1)) == [2]  # the newest (admitted 7): 2 pages and 1 need -> 3 free for 2 needs
    assert evicted(with_free(pool, 0)) == [2]  # 2 freed >= 2 still needed
    # the newest's pages are shared with slot 0 (kept): evicting it frees nothing, so slot 0 goes too
    shared = pool_holding([[0, 1, 2], [3, 4, 5, 6], [0, 1], []], num_pages=12)
    assert evicted(with_free(shared, 0)) == [0, 2]
    # the same pages also held by the prefix cache: evicting both frees only slot 0's own page 2,
    # the one page slot 1 needs
    cached = pool_holding([[0, 1, 2], [3, 4, 5, 6], [0, 1], []], num_pages=12, extra_refs=(0, 1))
    assert evicted(with_free(cached, 0)) == [0, 2]
    # pages no eviction frees never count: with only the cache's pages left, everything goes
    assert evicted(with_free(pool_holding([[0, 1], [3], [0, 1], []], 12, (0, 1)), 0)) == [0, 1, 2]
