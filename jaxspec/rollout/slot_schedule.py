"""Scheduling of the slot loop (`jaxspec.rollout.slots`, steps 1, 2 and 5): rows onto slots and
pages onto slots, within one group (`jaxspec.rollout.slot_state`). Admission takes pending rows
in queue order while the pool holds them; when a decode step's pages run short the prefix cache
lets go first, then the newest rows are preempted back to the front of the queue; finished rows
return their pages."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.rollout import prefix_cache
from jaxspec.rollout.page_pool import allocate, newest_to_evict, pages_for, release
from jaxspec.rollout.slot_layout import Layout
from jaxspec.rollout.slot_state import LoopState, Prompts


def longest_sequence(prompts: Prompts, layout: Layout, row: jax.Array) -> jax.Array:
    """Positions of each row's longest sequence (its prompt and its own limit on emitted tokens),
    its last step's writes included (int32, the shape of `row`; rows clipped into range, so a free
    slot's -1 reads row 0)."""
    row = jnp.clip(row, 0, layout.rows - 1)
    return prompts.row_lengths[row] + prompts.row_max_new[row] - 1 + layout.lookahead


def make_room(state: LoopState, layout: Layout, prompts: Prompts) -> LoopState:
    """Gives every decoding slot the pages of the iteration's decode steps (`Layout.reach`
    positions past its length, no further than its row's longest sequence), preempting the newest
    rows first when the pool runs short (`jaxspec.rollout.slots`, step 1)."""
    size = layout.page_size
    reach = jnp.minimum(state.cache_len + layout.reach, longest_sequence(prompts, layout, state.row))
    need = jnp.where(state.decoding, jnp.maximum(0, pages_for(reach, size) - state.pool.held), 0)
    # a `cond`: most iterations are not short, and the preemption's kernels (a sort, scatters over
    # the pages) would cost them more than the one wait for its predicate
    short = need.sum() > state.pool.num_free
    state = jax.lax.cond(short, lambda s: preempt(s, layout, need), lambda s: s, state)
    need = jnp.where(state.decoding, need, 0)  # a preempted row's need is gone
    return state._replace(pool=allocate(state.pool, need, pages_for(layout.reach, size)))


def preempt(state: LoopState, layout: Layout, need: jax.Array) -> LoopState:
    """The prefix cache lets go of its pages (they stay only where rows hold them), then the newest
    rows are preempted, their pages released and their rows put back at the front of the queue,
    until the pool holds the `need` int32 [S] pages of the decoding slots left (`make_room`)."""
    state = prefix_cache.drop(state, state.prefix.ready)
    evict = newest_to_evict(state.admitted, state.row >= 0, state.pool, need)
    order = jnp.argsort(jnp.where(evict, -state.admitted, jnp.iinfo(jnp.int32).max), stable=True)  # newest first
    count = evict.sum(dtype=jnp.int32)
    i = jnp.arange(layout.slots, dtype=jnp.int32)
    front = jnp.where(i < count, state.head - 1 - i, layout.rows)  # the oldest evicted row ends up first
    return state._replace(
        queue=state.queue.at[front].set(state.row[order], mode="drop"),
        head=state.head - count,
        row=jnp.where(evict, -1, state.row),
        decoding=state.decoding & ~evict,
        counters={**state.counters, "preemptions": state.counters["preemptions"] + count},
        pool=release(state.pool, evict),
    )


def admit(state: LoopState, layout: Layout, prompts: Prompts) -> LoopState:
    """Free slots take the next pending rows while the pool holds their context's pages plus one
    iteration's decode pages (`Layout.reach`) for every running row and every row admitted before
    them, each capped at the pages its row's longest sequence can still take, so that a pool of
    every slot's longest sequence admits every slot (`jaxspec.rollout.slots`, step 2). An admitted
    row also takes its own iteration's pages where the pool still holds them, so that it decodes as
    soon as its prefill completes (else from the next iteration, `make_room`). When the next row
    does not fit, the prefix cache first lets go of the prefixes no running row holds."""
    size = layout.page_size
    j = jnp.arange(layout.slots, dtype=jnp.int32)
    free = state.row < 0
    position = state.head + j
    candidate = state.queue[jnp.clip(position, 0, layout.rows - 1)]
    ctx = prompts.row_lengths[candidate] + state.lengths[candidate]
    pages = pages_for(ctx, size)
    reach = pages_for(layout.reach, size)
    room = jnp.clip(pages_for(longest_sequence(prompts, layout, state.row), size) - state.pool.held, 0, reach)
    with_room = jnp.minimum(pages + reach, pages_for(longest_sequence(prompts, layout, candidate), size))
    reserved = jnp.sum(jnp.where(free, 0, room)) + jnp.cumsum(with_room)  # [S]: up to row j, its reach too
    need = reserved - with_room + pages  # [S]: up to row j
    short = (state.head < layout.rows) & jnp.any(free) & (need[0] > state.pool.num_free)
    state = prefix_cache.drop(state, short & prefix_cache.orphans(state, layout, prompts))
    pool = state.pool
    ok = (position < layout.rows) & (j < free.sum()) & (need <= pool.num_free)
    count = jnp.sum(jnp.cumprod(ok), dtype=jnp.int32)  # a prefix of the queue
    # a row takes its iteration's pages too where they fit (a prefix of the admitted: need grows)
    take = jnp.where(reserved <= pool.num_free, with_room, pages)
    # the i-th free slot (in index order) takes the i-th admitted row: a gather per field, no scatter
    rank = jnp.cumsum(free) - 1  # [S]: a free slot's index among the free slots
    taken = free & (rank < count)
    of_slot = jnp.clip(rank, 0, layout.slots - 1)

    def put(field: jax.Array, values: jax.Array) -> jax.Array:
        return jnp.where(taken, values[of_slot], field)

    return state._replace(
        head=state.head + count,
        row=put(state.row, candidate),
        decoding=state.decoding & ~taken,
        ctx_len=put(state.ctx_len, ctx),
        prefilled=jnp.where(taken, 0, state.prefilled),
        admitted=put(state.admitted, state.next_admit + j),
        next_admit=state.next_admit + count,
        pool=allocate(pool, jnp.where(taken, take[of_slot], 0), layout.pages_per_slot),
    )


def release_finished(state: LoopState, layout: Layout) -> LoopState:
    """Slots whose row is done return their pages to the pool (`jaxspec.rollout.slots`, step 5)."""
    finished = (state.row >= 0) & state.done[jnp.clip(state.row, 0, layout.rows - 1)]
    return state._replace(
        pool=release(state.pool, finished),
        row=jnp.where(finished, -1, state.row),
        decoding=state.decoding & ~finished,
    )
