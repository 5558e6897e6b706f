"""Prefix sharing in the slot engine: the rows of one prompt (a GRPO group) share its KV pages.

Prompt u's first k_u = (len_u - 1) // page_size pages hold positions that come before its last
token, so they are the same for every row of u, in the policy's cache and in the EAGLE-3 head's
(entry j pairs position j with token j + 1, still in the prompt). The first row of u to write
them publishes them to the prefix cache (`publish`), which holds them while rows of u are
unfinished; a row of u admitted later takes them in place of its own first k_u pages and
prefills only the rest (`attach`). A row admitted while an older row of its prompt is writing
the prefix waits for it (`waiting`) instead of writing it again. Under page pressure the cache
lets go of every prefix before any row is preempted (`drop`), and when the next pending row does
not fit it lets go of the prefixes no running row holds (`orphans`); rows then prefill on their
own.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.models.paged import NO_PAGE
from jaxspec.rollout.page_pool import add_refs, drop_refs


class PrefixCache(NamedTuple):
    """pages: int32 [U, K] the shared pages of each distinct prompt (`NO_PAGE` past its k_u);
    ready: bool [U] whether prompt u's pages are cached."""

    pages: jax.Array
    ready: jax.Array

    @classmethod
    def create(cls, num_prompts: int, max_pages: int) -> PrefixCache:
        return cls(pages=jnp.full((num_prompts, max_pages), NO_PAGE, jnp.int32), ready=jnp.zeros((num_prompts,), bool))


def shared_count(prompt_lengths: jax.Array, page_size: int, max_pages: int) -> jax.Array:
    """int32: pages of a prompt of these lengths that every row of it shares (at most max_pages)."""
    return jnp.clip((prompt_lengths - 1) // page_size, 0, max_pages)


def _slot_prompts(state, layout, prompts) -> tuple[jax.Array, jax.Array]:
    """(distinct prompt int32 [S], its shared pages int32 [S]) of each slot's row."""
    u = prompts.row_prompt[jnp.clip(state.row, 0, layout.rows - 1)]
    return u, shared_count(prompts.lengths[u], layout.page_size, layout.prefix_pages)


def attach(state, layout, prompts):
    """Slots that have written nothing yet and whose prompt's prefix is cached take its pages in
    place of their first k_u pages (which return to the pool) and skip their prefill there."""
    u, k = _slot_prompts(state, layout, prompts)
    go = (state.row >= 0) & ~state.decoding & (state.prefilled == 0) & state.prefix.ready[u] & (k > 0)
    first = go[:, None] & (jnp.arange(layout.pages_per_slot)[None, :] < k[:, None])  # [S, M]
    pool = drop_refs(state.pool, jnp.where(first, state.pool.page_table, NO_PAGE))
    cached = jnp.pad(state.prefix.pages[u], ((0, 0), (0, layout.pages_per_slot - layout.prefix_pages)))
    table = jnp.where(first, cached, pool.page_table)
    pool = add_refs(pool._replace(page_table=table), jnp.where(first, table, NO_PAGE))
    shared = state.counters["prefix_pages_shared"] + jnp.sum(jnp.where(go, k, 0))
    return state._replace(
        pool=pool,
        prefilled=jnp.where(go, k * layout.page_size, state.prefilled),
        counters={**state.counters, "prefix_pages_shared": shared},
    )


def waiting(state, layout, prompts) -> jax.Array:
    """bool [S]: prefilling slots that have written nothing while an older slot of their prompt
    holds it and its prefix is not cached yet: the older one writes it (or has written it, and it
    is published at the end of the loop's iteration: a cache that let go of it under pressure),
    and they attach to it then (`jaxspec.rollout.slots`: the prefill step that completes a prefix
    publishes it and attaches them)."""
    u, k = _slot_prompts(state, layout, prompts)
    occupied = state.row >= 0
    prefilling = occupied & ~state.decoding
    big = jnp.iinfo(jnp.int32).max
    num_prompts = state.prefix.ready.shape[0]
    oldest = (
        jnp.full((num_prompts,), big, jnp.int32)
        .at[jnp.where(occupied, u, num_prompts)]
        .min(state.admitted, mode="drop")
    )
    return prefilling & (state.prefilled == 0) & ~state.prefix.ready[u] & (k > 0) & (state.admitted != oldest[u])


def publish(state, layout, prompts):
    """Caches the prefix of every uncached prompt that a slot has written past (the lowest such
    slot's pages); the cache holds them as one more holder."""
    u, k = _slot_prompts(state, layout, prompts)
    slots = state.row.shape[0]
    past = (state.row >= 0) & (state.decoding | (state.prefilled >= k * layout.page_size))
    past = past & ~state.prefix.ready[u] & (k > 0)
    num_prompts = state.prefix.ready.shape[0]
    winner = (
        jnp.full((num_prompts,), slots, jnp.int32)
        .at[jnp.where(past, u, num_prompts)]
        .min(jnp.arange(slots, dtype=jnp.int32), mode="drop")
    )
    won = winner < slots
    count = shared_count(prompts.lengths, layout.page_size, layout.prefix_pages)  # [U]
    columns = jnp.arange(layout.prefix_pages)[None, :]
    pages = state.pool.page_table[jnp.clip(winner, 0, slots - 1), : layout.prefix_pages]
    pages = jnp.where(won[:, None] & (columns < count[:, None]), pages, NO_PAGE)
    return state._replace(
        pool=add_refs(state.pool, pages),
        prefix=PrefixCache(pages=jnp.where(won[:, None], pages, state.prefix.pages), ready=state.prefix.ready | won),
    )


def drop(state, which: jax.Array):
    """The cache lets go of the prefixes of the prompts marked in bool [U]."""
    which = which & state.prefix.ready
    return state._replace(
        pool=drop_refs(state.pool, jnp.where(which[:, None], state.prefix.pages, NO_PAGE)),
        prefix=PrefixCache(
            pages=jnp.where(which[:, None], NO_PAGE, state.prefix.pages), ready=state.prefix.ready & ~which
        ),
    )


def orphans(state, layout, prompts) -> jax.Array:
    """bool [U]: cached prefixes that no occupied slot holds (the cache alone keeps their pages)."""
    u, _ = _slot_prompts(state, layout, prompts)
    num_prompts = state.prefix.ready.shape[0]
    held = jnp.zeros((num_prompts,), bool).at[jnp.where(state.row >= 0, u, num_prompts)].set(True, mode="drop")
    return state.prefix.ready & ~held


def drop_finished(state, prompts):
    """Lets go of the prefixes of prompts whose rows have all finished."""
    remaining = jnp.zeros(state.prefix.ready.shape, jnp.int32).at[prompts.row_prompt].add(~state.done)
    return drop(state, remaining == 0)
