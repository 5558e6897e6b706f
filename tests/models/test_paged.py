"""The paged KV cache computes what the dense cache computes.

`paged_attention` against the dense `cache_attention` (xla) over the same keys and values laid out
in pages by random page tables (pages shuffled over the pool, unallocated entries), random
lengths, random tree masks and inactive slots; `extend` on a `PagedKVCache` against `extend` on a
dense `KVCache` (prefill, then tree-masked verification blocks).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import extend, init_cache
from jaxspec.models.attention import cache_attention
from jaxspec.models.paged import (
    NO_PAGE,
    PagedKVCache,
    gather_pages,
    init_paged_cache,
    page_of,
    paged_attention,
    write_and_attend,
)
from jaxspec.models.sharding import KV_PAGES_AXES, Sharding, make_mesh
from jaxspec.rollout.speculative.step import commit_path
from tests.models.test_cache import model  # noqa: F401  (fixture)

SLOTS, PAGE, PAGES_PER_SLOT, NEW = 4, 4, 6, 5
MAX_LEN = PAGE * PAGES_PER_SLOT


def random_tree_mask(rng, slots: int, t: int) -> np.ndarray:
    """bool [slots, t, t]: node i sees itself and the chain of its random parents (< i)."""
    mask = np.zeros((slots, t, t), bool)
    for s in range(slots):
        for i in range(t):
            mask[s, i, i] = True
            if i:
                mask[s, i] |= mask[s, rng.integers(0, i)]
    return mask


def random_page_table(rng, lengths: np.ndarray, num_pages: int) -> np.ndarray:
    """int32 [slots, PAGES_PER_SLOT]: every slot's needed pages drawn without replacement from a
    shuffled pool; entries past its need are NO_PAGE."""
    pool = iter(rng.permutation(num_pages))
    table = np.full((len(lengths), PAGES_PER_SLOT), NO_PAGE, np.int64)
    for s, n in enumerate(lengths):
        for m in range(-(-int(n) // PAGE)):
            table[s, m] = next(pool)
    return table.astype(np.int32)


@pytest.mark.parametrize("seed", range(4))
def test_paged_attention_equals_dense(seed):
    rng = np.random.default_rng(seed)
    nq, nk, d = 4, 2, 8
    cache_len = rng.integers(0, MAX_LEN - NEW + 1, SLOTS).astype(np.int32)
    num_pages = SLOTS * PAGES_PER_SLOT + 3
    table = random_page_table(rng, cache_len + NEW, num_pages)
    dense_k = rng.standard_normal((SLOTS, MAX_LEN, nk, d)).astype(np.float32)
    dense_v = rng.standard_normal((SLOTS, MAX_LEN, nk, d)).astype(np.float32)
    k_pool = rng.standard_normal((num_pages, PAGE, nk, d)).astype(np.float32)  # garbage where unowned
    v_pool = rng.standard_normal((num_pages, PAGE, nk, d)).astype(np.float32)
    positions = np.broadcast_to(np.arange(MAX_LEN), (SLOTS, MAX_LEN))
    page, offset = map(np.asarray, page_of(jnp.asarray(table), jnp.asarray(positions), PAGE))
    owned = page != NO_PAGE
    k_pool[page[owned], offset[owned]] = dense_k[owned]
    v_pool[page[owned], offset[owned]] = dense_v[owned]
    q = rng.standard_normal((SLOTS, NEW, nq, d)).astype(np.float32)
    tree = random_tree_mask(rng, SLOTS, NEW)
    active = np.array([True, False, True, True])
    # slots past a slot's pages read as zeros in the gathered view, and the mask never reaches them
    dense_k[~owned], dense_v[~owned] = 0.0, 0.0
    np.testing.assert_array_equal(gather_pages(jnp.asarray(k_pool), jnp.asarray(table)), dense_k)
    for mask, act in ((tree, active), (None, None)):
        got = paged_attention(
            jnp.asarray(q),
            jnp.asarray(k_pool),
            jnp.asarray(v_pool),
            jnp.asarray(table),
            jnp.asarray(cache_len),
            None if mask is None else jnp.asarray(mask),
            None if act is None else jnp.asarray(act),
        )
        want = cache_attention(
            jnp.asarray(q),
            jnp.asarray(dense_k),
            jnp.asarray(dense_v),
            jnp.asarray(cache_len),
            None if mask is None else jnp.asarray(mask),
            active=None if act is None else jnp.asarray(act),
            impl="xla",
        )
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_wrong_page_is_caught():
    """Negative control: a slot reading another slot's page in place of its own changes its output
    (and no other slot's). Attention is invariant to the order of a slot's keys, so the control
    substitutes a page rather than permuting them."""
    rng = np.random.default_rng(0)
    cache_len = np.full((SLOTS,), 2 * PAGE + 1, np.int32)
    table = random_page_table(rng, cache_len + NEW, SLOTS * PAGES_PER_SLOT)
    pools = [jnp.asarray(rng.standard_normal((SLOTS * PAGES_PER_SLOT, PAGE, 2, 8)), jnp.float32) for _ in "kv"]
    q = jnp.asarray(rng.standard_normal((SLOTS, NEW, 4, 8)), jnp.float32)
    swapped = table.copy()
    swapped[0, 0] = table[1, 0]
    right = paged_attention(q, *pools, jnp.asarray(table), jnp.asarray(cache_len))
    wrong = paged_attention(q, *pools, jnp.asarray(swapped), jnp.asarray(cache_len))
    assert not np.allclose(right[0], wrong[0], atol=1e-3)
    np.testing.assert_array_equal(right[1:], wrong[1:])


extend_jit = jax.jit(extend, static_argnums=0)


def test_extend_on_pages_equals_dense_extend(model):  # noqa: F811
    cfg, params = model
    rng = np.random.default_rng(3)
    lengths = np.array([3, 9, 1, 6], np.int32)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (SLOTS, 9)), jnp.int32)
    num_pages = SLOTS * PAGES_PER_SLOT
    table = jnp.asarray(random_page_table(rng, np.full((SLOTS,), MAX_LEN), num_pages))
    dense = init_cache(cfg, SLOTS, MAX_LEN)
    paged = init_paged_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_pages, PAGE, table)
    zero = jnp.zeros((SLOTS,), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (SLOTS, 9))
    want, _, dense = extend_jit(cfg, params, dense, prompt, positions, zero)
    got, _, paged = extend_jit(cfg, params, paged, prompt, positions, zero)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    cache_len = jnp.asarray(lengths)
    for step in range(3):  # tree-verification blocks at ragged offsets, one slot inactive
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (SLOTS, NEW)), jnp.int32)
        tree = jnp.asarray(random_tree_mask(rng, SLOTS, NEW))
        active = jnp.asarray([True, True, step != 1, True])
        pos = cache_len[:, None] + jnp.arange(NEW, dtype=jnp.int32)[None, :]
        kw = dict(tree_mask=tree, active=active)
        want, _, dense = extend_jit(cfg, params, dense, tokens, pos, cache_len, **kw)
        got, _, paged = extend_jit(cfg, params, paged, tokens, pos, cache_len, **kw)
        assert paged.page_table is not None and paged.k[0].shape == (num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim)
        live = np.asarray(active)
        np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want)[live], rtol=1e-5, atol=1e-5)
        cache_len = cache_len + 2


def test_grouped_pools_keep_each_group_on_its_own_pages():
    """Pools with a group axis [G, P, ...] (the slot engine on a mesh): slots in G blocks write,
    attend and move through page ids of their own group's pool, exactly as each group alone; a
    pool read with the ids taken over all groups' pages (the groups' pools laid end to end) is
    caught."""
    rng = np.random.default_rng(5)
    groups, num_pages, nk, d = 2, SLOTS * PAGES_PER_SLOT, 2, 8
    slots = groups * SLOTS
    cache_len = rng.integers(0, MAX_LEN - NEW + 1, slots).astype(np.int32)
    table = np.concatenate(
        [random_page_table(rng, cache_len[g * SLOTS : (g + 1) * SLOTS] + NEW, num_pages) for g in range(2)]
    )
    k_pool, v_pool = (jnp.asarray(rng.standard_normal((groups, num_pages, PAGE, nk, d)), jnp.float32) for _ in "kv")
    q, k, v = (jnp.asarray(rng.standard_normal((slots, NEW, n, d)), jnp.float32) for n in (4, nk, nk))
    path = jnp.asarray(np.where(rng.random((slots, NEW)) < 0.5, rng.integers(0, NEW, (slots, NEW)), -1), jnp.int32)

    def run(k_pool, v_pool, table, cache_len, q, k, v, path):
        cache = PagedKVCache(k=(k_pool,), v=(v_pool,), page_table=table)
        attn, k_pool, v_pool = write_and_attend(cache, 0, q, k, v, cache_len)
        moved = commit_path(cache._replace(k=(k_pool,), v=(v_pool,)), cache_len, path)
        return attn, moved.k[0], moved.v[0]

    grouped = run(k_pool, v_pool, jnp.asarray(table), jnp.asarray(cache_len), q, k, v, path)
    blocks = [slice(g * SLOTS, (g + 1) * SLOTS) for g in range(groups)]
    alone = [
        run(k_pool[g], v_pool[g], jnp.asarray(table[b]), jnp.asarray(cache_len[b]), q[b], k[b], v[b], path[b])
        for g, b in enumerate(blocks)
    ]
    np.testing.assert_array_equal(grouped[0], jnp.concatenate([a[0] for a in alone]))
    for i in (1, 2):
        np.testing.assert_array_equal(grouped[i], jnp.stack([a[i] for a in alone]))
    end_to_end = [p.reshape(groups * num_pages, *p.shape[2:]) for p in (k_pool, v_pool)]
    mixed = run(*end_to_end, jnp.asarray(table), jnp.asarray(cache_len), q, k, v, path)
    assert not np.allclose(mixed[0][blocks[1]], grouped[0][blocks[1]], atol=1e-3)


@pytest.mark.parametrize("groups", [2, 4, 0], ids=["a-group-a-device", "two-groups-a-device", "one-pool"])
def test_the_kernel_on_a_mesh_equals_the_reference(groups):
    """On a data x tensor mesh the attention kernel runs on each device (Triton's interpreter): its
    slots and KV heads, grouped pools read as one pool of the device's pages (with two groups on a
    device, the second group's slots moved to its pages: the groups' page ids overlap, so a slot
    reading the other group's pages shows); tree masks, inactive slots and unallocated entries as
    above. The traced program must call the kernel, so that the reference is not compared with
    itself."""
    pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")
    from tests.kernels.fake_jax_triton import kernels_in

    rng = np.random.default_rng(7)
    grouped = groups > 0
    num_pages, nq, nk, d = SLOTS * PAGES_PER_SLOT, 4, 2, 16
    slots = max(groups, 2) * SLOTS
    cache_len = rng.integers(0, MAX_LEN - NEW + 1, slots).astype(np.int32)
    if grouped:  # each group's slots hold page ids of its own pool
        lens = cache_len.reshape(groups, SLOTS) + NEW
        table, pool_shape = np.concatenate([random_page_table(rng, n, num_pages) for n in lens]), (groups, num_pages)
        pool_shape = (*pool_shape, PAGE, nk, d)
    else:
        table = random_page_table(rng, cache_len + NEW, slots * PAGES_PER_SLOT)
        pool_shape = (slots * PAGES_PER_SLOT, PAGE, nk, d)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal(pool_shape), jnp.float32) for _ in "kv")
    q = jnp.asarray(rng.standard_normal((slots, NEW, nq, d)), jnp.float32)
    tree = jnp.asarray(random_tree_mask(rng, slots, NEW))
    active = jnp.asarray(rng.random(slots) < 0.8)
    sharding = Sharding(make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4]))
    axes = KV_PAGES_AXES if grouped else KV_PAGES_AXES[1:]
    k_pool, v_pool = (jax.device_put(p, sharding.named(axes, p.shape)) for p in (k_pool, v_pool))
    args = (q, k_pool, v_pool, jnp.asarray(table), jnp.asarray(cache_len), tree, active)
    on_mesh = functools.partial(paged_attention, impl="triton-interpret", sharding=sharding)
    assert "_paged_attention" in kernels_in(str(jax.make_jaxpr(on_mesh)(*args)))
    want = paged_attention(*args, impl="xla")
    np.testing.assert_allclose(jax.jit(on_mesh)(*args), want, rtol=1e-5, atol=1e-5)
