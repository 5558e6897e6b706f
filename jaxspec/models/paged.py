"""Paged KV cache: a pool of fixed-size pages per layer and a page table per decode slot.

A dense `KVCache` holds rows x max_len slots whatever the rows' lengths; a `PagedKVCache` holds
`num_pages` pages of `page_size` token positions per layer, and slot s's position p lives in
page `page_table[s, p // page_size]` at offset `p % page_size`. A slot holds pages only for the
positions it has written, so the memory is bounded by the live tokens, not slots x max length.
A page-table entry >= num_pages (`NO_PAGE`) is a position with no page: writes there are
dropped and reads are masked out (they lie past the slot's length).

`extend` and `jaxspec.draft.draft_extend` take a `PagedKVCache` wherever they take a `KVCache`
(they call `write_and_attend`), with the same semantics: row b of the batch is slot b of the page
table, cache_len[b] its filled positions.

`paged_attention` is the one function the attention kernel replaces. Two implementations with
the same semantics:

* "xla": the jnp reference: it gathers each slot's pages into a dense view [S, M * page_size] and
  runs the masked dense attention (`jaxspec.models.attention`);
* "triton": the attention kernel of both engines, `jaxspec.kernels.paged_attention_triton` (the
  Triton language through jax-triton, the `triton` extra), which reads only each slot's pages up
  to its last new token, for the steps it applies to (bfloat16, float16 or float32, head dim a
  power of two in [16, 256], at most 128 query rows of new tokens x query heads per kv head, any
  page size); other calls (a long prefill chunk) run the reference. "triton-interpret" runs it in
  Triton's interpreter on the host (any backend, slow; needs torch).

"auto" is "triton" on a GPU where the kernel applies and jax-triton imports, else the reference
(`jaxspec.models.attention.kernel_impl`); the JAXSPEC_PAGED_ATTENTION environment variable (auto,
xla, triton, triton-interpret) overrides "auto" at trace time. On a mesh the call names, the kernel
runs on each device (`shard_map` over the batch and tensor axes) on its slots and KV heads, grouped
pools (below) as one pool of their pages; grouped pools without the mesh run the reference.

Grouped pools (the slot engine on a mesh, `jaxspec.rollout.slot_state`): a pool may carry a
leading group axis, [G, num_pages, page_size, Nk, D]; the S slots then form G consecutive blocks
of S / G, and a slot's page-table entries are page ids within its group's pool. Every function
here maps over the groups (`per_group`), so that a group's reads and writes stay within its own
pool (on a mesh whose batch axes split the group axis, on its own devices).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxspec.models.attention import attention, cache_attention_mask, kernel_attention, kernel_impl, tree_mask_or_causal
from jaxspec.models.sharding import KV_PAGES_AXES, Sharding, on_devices

NO_PAGE = 2**31 - 1  # a page-table entry with no page behind it (int32 max)
IMPL_ENV = "JAXSPEC_PAGED_ATTENTION"


class PagedKVCache(NamedTuple):
    """k, v: per-layer page pools, each [num_pages, page_size, Nk, D] (or grouped, [G, num_pages,
    page_size, Nk, D]: module docstring); page_table: int32 [S, M], the pages of slot s in position
    order (entries past its allocation `NO_PAGE`). A slot's positions [0, M * page_size) are
    addressable."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    page_table: jax.Array

    @property
    def num_pages(self) -> int:
        """Pages of a pool (of a group's pool, for grouped pools)."""
        return self.k[0].shape[-4]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[-3]

    @property
    def batch(self) -> int:
        return self.page_table.shape[0]

    @property
    def max_len(self) -> int:
        """Positions a slot can address (pages per slot x page size)."""
        return self.page_table.shape[1] * self.page_size


def init_paged_cache(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    num_pages: int,
    page_size: int,
    page_table: jax.Array,
    dtype=jnp.float32,
) -> PagedKVCache:
    """Zeroed pools of `num_pages` pages of `page_size` positions per layer, with `page_table`
    int32 [S, M]."""
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    return PagedKVCache(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        page_table=page_table.astype(jnp.int32),
    )


def paged_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, page_size: int, dtype) -> int:
    """Bytes of the k and v pools of a `PagedKVCache` of this shape."""
    return 2 * num_layers * num_pages * page_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def page_of(page_table: jax.Array, positions: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """(page int32 [S, T], offset int32 [S, T]) of positions int32 [S, T] of each slot; the page is
    `NO_PAGE` for a position outside the slot's table (negative, or past M * page_size)."""
    index = positions // page_size
    in_table = (positions >= 0) & (index < page_table.shape[1])
    page = jnp.take_along_axis(page_table, jnp.clip(index, 0, page_table.shape[1] - 1), axis=1)
    return jnp.where(in_table, page, NO_PAGE), positions % page_size


def per_group(fn, pool: jax.Array, page_table: jax.Array, *per_slot: jax.Array):
    """fn(pool [num_pages, ...], page_table [S, M], *per_slot [S, ...]) of an ungrouped pool, or of
    each group of a grouped one [G, num_pages, ...] with its block of S / G slots (vmapped; the
    outputs keep the group axis)."""
    if pool.ndim == 4:
        return fn(pool, page_table, *per_slot)
    groups = pool.shape[0]

    def split(x: jax.Array) -> jax.Array:
        return x.reshape(groups, x.shape[0] // groups, *x.shape[1:])

    return jax.vmap(fn)(pool, split(page_table), *map(split, per_slot))


def paged_write(pool: jax.Array, page_table: jax.Array, positions: jax.Array, values: jax.Array) -> jax.Array:
    """`pool` [num_pages, page_size, Nk, D] (or grouped) with values [S, T, Nk, D] written at each
    slot's positions int32 [S, T]; positions with no page are dropped."""

    def write(pool, page_table, positions, values):
        page, offset = page_of(page_table, positions, pool.shape[1])
        return pool.at[page, offset].set(values.astype(pool.dtype), mode="drop")

    return per_group(write, pool, page_table, positions, values)


def paged_move(pool: jax.Array, page_table: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """`pool` (or grouped) with each slot's entries at positions src int32 [S, T] copied to
    positions dst int32 [S, T] (through its page table; a source with no page is never asked
    for, a destination with none is dropped)."""

    def move(pool, page_table, src, dst):
        src_page, src_offset = page_of(page_table, src, pool.shape[1])
        dst_page, dst_offset = page_of(page_table, dst, pool.shape[1])
        src_page = jnp.clip(src_page, 0, pool.shape[0] - 1)
        return pool.at[dst_page, dst_offset].set(pool[src_page, src_offset], mode="drop")

    return per_group(move, pool, page_table, src, dst)


def gather_pages(pool: jax.Array, page_table: jax.Array) -> jax.Array:
    """Dense view [S, M * page_size, Nk, D] of every slot's pages (zeros where it has none)."""

    def gather(pool, page_table):
        s, m = page_table.shape
        view = jnp.take(pool, page_table, axis=0, mode="fill", fill_value=0)  # [S, M, page, Nk, D]
        return view.reshape(s, m * pool.shape[1], *pool.shape[2:])

    view = per_group(gather, pool, page_table)
    return view.reshape(page_table.shape[0], *view.shape[-3:])


def paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    page_table: jax.Array,
    cache_len: jax.Array,
    tree_mask: jax.Array | None = None,
    active: jax.Array | None = None,
    *,
    impl: str = "auto",
    sharding: Sharding | None = None,
) -> jax.Array:
    """Attention of T new tokens per slot over the slot's pages, which already hold their keys and
    values (`cache_attention` on a paged cache).

    q [S, T, Nq, D]; k/v_pool [num_pages, page_size, Nk, D] (or grouped); page_table int32 [S, M];
    slot s's prefix is at positions [0, cache_len[s]) and its new tokens at cache_len[s] + t; tree_mask
    bool [S, T, T] among the new tokens (default causal); active bool [S] (default all): a slot
    that is not active sees only its new tokens. impl: see the module docstring. sharding: the mesh
    the pools are laid out on (`KV_PAGES_AXES`), for the kernel's call per device. Returns
    [S, T, Nq, D] in q's dtype.
    """
    flat = jax.ShapeDtypeStruct((1, *k_pool.shape[-3:]), k_pool.dtype)  # a page of a (grouped) pool: the checks
    on_mesh = on_devices(sharding)
    pools = sharding.spec(KV_PAGES_AXES[5 - k_pool.ndim :], k_pool.shape) if on_mesh else None
    applies = (not on_mesh and k_pool.ndim == 4) or (on_mesh and pools[-3] is None)  # a page's positions whole
    impl = kernel_impl(impl, IMPL_ENV, "paged attention", q, flat, flat, applies=applies)
    if impl == "xla":
        k = gather_pages(k_pool, page_table).astype(q.dtype)
        v = gather_pages(v_pool, page_table).astype(q.dtype)
        mask = cache_attention_mask(cache_len, q.shape[1], k.shape[1], tree_mask, active)
        return attention(q, k, v, mask)
    interpret = impl == "triton-interpret"
    if not on_mesh:
        return kernel_attention(q, k_pool, v_pool, page_table, cache_len, tree_mask, active, interpret=interpret)
    b, t = q.shape[:2]
    tree_mask = tree_mask_or_causal(b, t, tree_mask)
    active = jnp.ones((b,), bool) if active is None else active

    def local_kernel(q, k_pool, v_pool, page_table, cache_len, tree_mask, active):
        """The kernel on a device's slots and pools (grouped ones as one, `one_pool`)."""
        k_pool, v_pool, page_table = one_pool(k_pool, v_pool, page_table)
        return kernel_attention(q, k_pool, v_pool, page_table, cache_len, tree_mask, active, interpret=interpret)

    heads = pools[-2]
    batch = pools[0] if k_pool.ndim == 5 else sharding.spec(("batch",), (b,))[0]  # the slots' split
    P = PartitionSpec
    rows = P(batch)
    return jax.shard_map(
        local_kernel,
        mesh=sharding.mesh,
        in_specs=(P(batch, None, heads), pools, pools, rows, rows, rows, rows),
        out_specs=P(batch, None, heads),
        check_vma=False,
    )(q, k_pool, v_pool, page_table, cache_len, tree_mask, active)


def one_pool(k_pool: jax.Array, v_pool: jax.Array, page_table: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Grouped pools [G, P, page_size, Nk, D] as one pool of G x P pages, and page_table int32 [S, M]
    with each slot's entries moved to its group's pages (slot s in group s // (S / G); an entry with
    no page keeps none): what the attention kernels read. Ungrouped pools are returned as they are."""
    if k_pool.ndim == 4:
        return k_pool, v_pool, page_table
    groups, pages = k_pool.shape[:2]
    slots = page_table.shape[0]
    first_page = (jnp.arange(slots, dtype=jnp.int32) // (slots // groups) * pages)[:, None]
    held = (page_table >= 0) & (page_table < pages)
    page_table = jnp.where(held, page_table + first_page, NO_PAGE)
    k_pool, v_pool = (pool.reshape(groups * pages, *pool.shape[2:]) for pool in (k_pool, v_pool))
    return k_pool, v_pool, page_table


def write_and_attend(
    cache: PagedKVCache,
    layer: int,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache_len: jax.Array,
    tree_mask: jax.Array | None = None,
    active: jax.Array | None = None,
    sharding: Sharding | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer of a cached extension: writes k/v [S, T, Nk, D] at positions cache_len[s] + t of
    layer `layer`'s pools, then attends q [S, T, Nq, D] over them (`paged_attention`; sharding: the
    mesh the pools are laid out on). Returns (attention [S, T, Nq, D], the layer's new k pool, its
    new v pool)."""
    positions = cache_len[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    with jax.named_scope("kv_write"):
        k_pool = paged_write(cache.k[layer], cache.page_table, positions, k)
        v_pool = paged_write(cache.v[layer], cache.page_table, positions, v)
    attn = paged_attention(q, k_pool, v_pool, cache.page_table, cache_len, tree_mask, active, sharding=sharding)
    return attn, k_pool, v_pool
