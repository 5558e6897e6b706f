"""The slot engine's page pool: allocation, release and the preemption choice, against plain Python."""

import jax.numpy as jnp
import numpy as np

from jaxspec.models.paged import NO_PAGE
from jaxspec.rollout.page_pool import PagePool, allocate, newest_to_evict, release


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


def test_newest_rows_are_evicted_until_the_rest_fits():
    admitted = jnp.asarray([4, 1, 7, 3])
    occupied = jnp.asarray([True, True, True, False])
    held = jnp.asarray([3, 5, 2, 0])
    need = jnp.asarray([1, 1, 1, 0])

    def evicted(num_free):
        return np.flatnonzero(np.asarray(newest_to_evict(admitted, occupied, held, need, num_free))).tolist()

    assert evicted(3) == []  # everything fits
    assert evicted(2) == [2]  # the newest (admitted 7): its 2 pages and 1 need -> 4 free for 2 needs
    assert evicted(0) == [2]  # 2 freed >= 2 still needed
    # with no free pages and the newest holding nothing, the next newest goes too
    assert np.flatnonzero(
        np.asarray(newest_to_evict(admitted, occupied, jnp.asarray([3, 5, 0, 0]), need, 0))
    ).tolist() == [0, 2]
