"""The slot loop's carry (`jaxspec.rollout.slots`), its groups on a mesh and their layout.

On one device the carry is one group's. With G > 1 groups (`jaxspec.rollout.slot_layout`) every
leaf gains a leading group axis [G, ...], split over the mesh's batch axes: the group's rows,
slots, page pools, page tables, queue, prefix cache and counters live on its own devices, and
the pools' KV heads are split over the tensor axis (`KV_PAGES_AXES`), so each device holds its
share of the pages. The bookkeeping, written for one group, runs on all of them with `map_groups`
(a `jax.vmap` over the group axis); the model's forwards take every group's slots as one batch
(`slots_flat`: the pools keep their group axis, `jaxspec.models.paged`), so that the model runs
as on one device, with rows split over the batch axes; the loop's branches (`lax.switch`,
`while_loop`) are taken on all groups at once, so that every device runs the same program in step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.models.paged import PagedKVCache
from jaxspec.models.sharding import KV_PAGES_AXES, Sharding
from jaxspec.rollout.experts import SlotExperts
from jaxspec.rollout.page_pool import PagePool
from jaxspec.rollout.prefix_cache import PrefixCache
from jaxspec.rollout.slot_layout import Layout

COUNTERS = ("iterations", "decode_steps", "prefill_chunks", "preemptions", "peak_pages", "prefix_pages_shared")


class LoopState(NamedTuple):
    """The slot loop's carry, of one group (module docstring). Per row (B): tokens int32 [B, N],
    logprobs float32 [B, N], lengths int32 [B] (tokens emitted), done bool [B]; the queue int32 [B]
    of rows, pending from `head`. Per slot (S): row int32 (-1 = free), decoding bool (else
    prefilling), ctx_len (context tokens its prefill writes), prefilled (context tokens written so
    far), cache_len (decoding: positions in the cache = prompt + emitted - 1), last (decoding: the
    last emitted token, not yet in the cache), admitted (admission order). pool: the `PagePool`,
    whose page table is the one in effect (the cache's is set where it is used). prefix: the
    `PrefixCache`. counters: int32 scalars `COUNTERS`, and width_steps int32 [len(layout.widths)]
    (decode steps run at each step width, `jaxspec.rollout.slot_width`). draft: the drafter's per-slot state, or
    None. first_row: int32 scalar, the call's index of the group's row 0 (rows above are the
    group's own indices). experts: the recorded routing (`jaxspec.rollout.experts.SlotExperts`),
    or None."""

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    done: jax.Array
    queue: jax.Array
    head: jax.Array
    row: jax.Array
    decoding: jax.Array
    ctx_len: jax.Array
    prefilled: jax.Array
    cache_len: jax.Array
    last: jax.Array
    admitted: jax.Array
    next_admit: jax.Array
    pool: PagePool
    cache: PagedKVCache
    prefix: PrefixCache
    counters: dict
    draft: object
    first_row: jax.Array
    experts: SlotExperts | None


class Prompts(NamedTuple):
    """The call's prompts on device: tokens int32 [U, P] distinct prompts, lengths int32 [U],
    row_prompt int32 [B], row_lengths int32 [B], row_max_new int32 [B] (the most tokens each row
    emits, at most the call's max_new_tokens: `row_limits`) (`jaxspec.rollout.prompts.PromptBatch`);
    with G groups the last three are [G, B / G], a group's rows."""

    tokens: jax.Array
    lengths: jax.Array
    row_prompt: jax.Array
    row_lengths: jax.Array
    row_max_new: jax.Array

    @classmethod
    def of(cls, batch, groups: int = 1) -> Prompts:
        """The device arrays of a `PromptBatch` whose rows split into `groups` groups."""
        rows = batch.row_prompt.shape[0]
        by_group = (lambda x: x.reshape(groups, rows // groups)) if groups > 1 else (lambda x: x)
        return cls(
            jnp.asarray(batch.tokens),
            jnp.asarray(batch.lengths),
            jnp.asarray(by_group(batch.row_prompt)),
            jnp.asarray(by_group(batch.row_lengths)),
            jnp.asarray(by_group(batch.row_max_new)),
        )


def map_groups(layout: Layout, fn: Callable) -> Callable:
    """fn(state, prompts, *per_slot), written for one group (its layout `layout.group()`), applied
    to every group: itself on one group, vmapped over the group axis otherwise (the per-slot
    arguments [G, S / G, ...] too, `slots_grouped`)."""
    if layout.groups == 1:
        return fn

    def mapped(state: LoopState, prompts: Prompts, *per_slot):
        return jax.vmap(fn, in_axes=(0, Prompts(None, None, 0, 0, 0)) + (0,) * len(per_slot))(state, prompts, *per_slot)

    return mapped


def slots_flat(layout: Layout, tree):
    """Per-slot (or per-lane) arrays of every group [G, S / G, ...] as one batch [S, ...], the rows
    of a model forward; a `PagedKVCache`'s pools keep their group axis (`jaxspec.models.paged`:
    slot s's pages are in group s // (S / G)'s pool), its page table is flattened."""
    return _per_slot(layout, tree, lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]))


def slots_grouped(layout: Layout, tree):
    """The inverse of `slots_flat`: [S, ...] -> [G, S / G, ...]."""
    return _per_slot(layout, tree, lambda x: x.reshape(layout.groups, x.shape[0] // layout.groups, *x.shape[1:]))


def _per_slot(layout: Layout, tree, reshape: Callable):
    if layout.groups == 1:
        return tree

    def node(x):
        return x._replace(page_table=reshape(x.page_table)) if isinstance(x, PagedKVCache) else reshape(x)

    return jax.tree.map(node, tree, is_leaf=lambda x: isinstance(x, PagedKVCache))


def initial_state(
    layout: Layout, prompts: Prompts, cache: PagedKVCache, pad_id: int, draft=None, experts: SlotExperts | None = None
) -> LoopState:
    """Every row pending (each group's queue 0..B/G - 1), every slot free, every page in its group's
    pool. cache, draft, experts: one group's (made for `layout.group()`), which every group starts
    from."""
    group = layout.group()
    b, s = group.rows, group.slots
    zeros = jnp.zeros((s,), jnp.int32)
    state = LoopState(
        tokens=jnp.full((b, layout.max_new), pad_id, jnp.int32),
        logprobs=jnp.zeros((b, layout.max_new), jnp.float32),
        lengths=jnp.zeros((b,), jnp.int32),
        done=jnp.zeros((b,), bool),
        queue=jnp.arange(b, dtype=jnp.int32),
        head=jnp.zeros((), jnp.int32),
        row=jnp.full((s,), -1, jnp.int32),
        decoding=jnp.zeros((s,), bool),
        ctx_len=zeros,
        prefilled=zeros,
        cache_len=zeros,
        last=zeros,
        admitted=zeros,
        next_admit=jnp.zeros((), jnp.int32),
        pool=PagePool.create(group.num_pages, s, layout.pages_per_slot),
        cache=cache,
        prefix=PrefixCache.create(prompts.tokens.shape[0], layout.prefix_pages),
        counters={name: jnp.zeros((), jnp.int32) for name in COUNTERS}
        | {"width_steps": jnp.zeros((len(layout.widths),), jnp.int32)},
        draft=draft,
        first_row=jnp.zeros((), jnp.int32),
        experts=experts,
    )
    if layout.groups == 1:
        return state
    state = jax.tree.map(lambda x: jnp.broadcast_to(x, (layout.groups, *x.shape)), state)
    return state._replace(first_row=jnp.arange(layout.groups, dtype=jnp.int32) * b)


def lay_out(sharding: Sharding | None, layout: Layout, state: LoopState) -> LoopState:
    """The carry constrained to its layout on the mesh (module docstring): the group axis over the
    batch axes, the page pools' KV heads over the tensor axis. No-op without a mesh."""
    if sharding is None:
        return state
    grouped = layout.groups > 1

    def leaf(x: jax.Array) -> jax.Array:
        return sharding.constrain(x, ("batch",) + (None,) * (x.ndim - 1)) if grouped and x.ndim else x

    def node(x):
        if not isinstance(x, PagedKVCache):
            return leaf(x)
        axes = KV_PAGES_AXES if grouped else KV_PAGES_AXES[1:]
        pools = [tuple(sharding.constrain(p, axes) for p in side) for side in (x.k, x.v)]
        return PagedKVCache(*pools, leaf(x.page_table))

    return jax.tree.map(node, state, is_leaf=lambda x: isinstance(x, PagedKVCache))


def rows_of(layout: Layout, x: jax.Array) -> jax.Array:
    """A per-row output [G, B / G, ...] of every group as [B, ...] (the call's row order)."""
    return x.reshape(layout.rows, *x.shape[2:]) if layout.groups > 1 else x


def summed(layout: Layout, x):
    """A per-group count summed over the groups (a pytree of them)."""
    return jax.tree.map(lambda v: v.sum(0), x) if layout.groups > 1 else x


def first_group(layout: Layout, x):
    """Group 0's value of a count every group keeps alike (loop iterations)."""
    return jax.tree.map(lambda v: v[0], x) if layout.groups > 1 else x
