"""`extend` through the attention-prologue kernel gives the logits and caches of the model's own
pieces: dense caches and paged pools, a prefill and a tree-masked verification step after it,
a family with q/k norms and one with q/k/v biases. The kernels run in Triton's interpreter (float32);
each case also checks which path ran (the prologue's kernel in the traced program, or not), so
that a comparison of the reference with itself cannot pass for one of the kernel."""

import functools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import command_buffers
from jaxspec.models import ModelConfig, extend, init_cache
from jaxspec.models import attention as attention_module
from jaxspec.models.attention_prologue import prologue_impl
from jaxspec.models.paged import NO_PAGE, PagedKVCache, init_paged_cache
from jaxspec.models.params import fuse_qkv
from jaxspec.models.sharding import KV_CACHE_AXES, KV_PAGES_AXES, Sharding, make_mesh, shard_params
from tests.kernels.fake_jax_triton import kernels_in
from tests.models.hf_reference import random_params

pytest.importorskip("triton", reason="the kernels run in Triton's interpreter (the test extra has triton)")
pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")

KERNEL = "triton-interpret"
FAMILIES = {"qwen3": dict(family="qwen3"), "qwen2": dict(family="qwen2", attention_bias=True)}
ROWS, PAGE, PAGES_PER_ROW = 3, 4, 5


def config(name: str) -> ModelConfig:
    return ModelConfig(
        **FAMILIES[name],
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )


def caches(cfg: ModelConfig, paged: bool):
    if not paged:
        return init_cache(cfg, ROWS, 16)
    rng = np.random.default_rng(0)
    table = rng.permutation(ROWS * PAGES_PER_ROW + 2)[: ROWS * PAGES_PER_ROW].reshape(ROWS, PAGES_PER_ROW)
    table = jnp.asarray(table, jnp.int32).at[2, 4].set(NO_PAGE)  # row 2's last page missing
    return init_paged_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, ROWS * PAGES_PER_ROW + 2, PAGE, table)


def prefill_then_verify(cfg, params, cache):
    """A 6-token prefill (rows of 6, 4 and 2 tokens), then 3 tree-masked nodes per row: logits of
    both and the final cache."""
    tokens = jax.random.randint(jax.random.key(1), (ROWS, 9), 0, cfg.vocab_size)
    lens = jnp.asarray([6, 4, 2], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (ROWS, 6))
    first, _, cache = extend(cfg, params, cache, tokens[:, :6], positions, jnp.zeros((ROWS,), jnp.int32))
    tree = jnp.asarray([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)  # nodes 1 and 2 both children of node 0
    tree = jnp.broadcast_to(tree, (ROWS, 3, 3))
    positions = lens[:, None] + jnp.asarray([0, 1, 1], jnp.int32)
    second, _, cache = extend(cfg, params, cache, tokens[:, 6:], positions, lens, tree_mask=tree)
    return first, second, cache


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_prologue_kernel_gives_the_models_logits_and_caches(monkeypatch, family, paged):
    cfg = config(family)
    params = fuse_qkv(random_params(cfg, jax.random.key(0)))
    monkeypatch.setenv("JAXSPEC_PAGED_ATTENTION" if paged else "JAXSPEC_CACHE_ATTENTION", KERNEL)
    run = jax.jit(functools.partial(prefill_then_verify, cfg))
    cache = caches(cfg, paged)

    monkeypatch.setenv("JAXSPEC_ATTENTION_PROLOGUE", "xla")
    assert "_attention_prologue" not in kernels_in(str(jax.make_jaxpr(run)(params, cache)))
    want = run(params, cache)
    monkeypatch.setenv("JAXSPEC_ATTENTION_PROLOGUE", "triton")
    run = jax.jit(functools.partial(prefill_then_verify, cfg))  # traced again under the new setting
    assert {"_attention_prologue", "_paged_attention"} <= kernels_in(str(jax.make_jaxpr(run)(params, cache)))
    got = run(params, cache)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_unfused_params_the_reference_and_the_default_keep_the_models_pieces(monkeypatch):
    """q and kv apart (a trainer's params), the attention's reference, or the variable unset where
    the Triton kernels do not run in command buffers (the CPU): no prologue kernel."""
    cfg = config("qwen3")
    params = random_params(cfg, jax.random.key(0))
    cache = caches(cfg, paged=False)
    monkeypatch.setenv("JAXSPEC_CACHE_ATTENTION", KERNEL)

    def kernels(params):
        jax.clear_caches()  # traced afresh under the variables set now
        return kernels_in(str(jax.make_jaxpr(functools.partial(prefill_then_verify, cfg))(params, cache)))

    assert "_attention_prologue" not in kernels(fuse_qkv(params))  # the default
    monkeypatch.setenv("JAXSPEC_ATTENTION_PROLOGUE", "triton")
    assert "_attention_prologue" in kernels(fuse_qkv(params))  # the control
    assert "_attention_prologue" not in kernels(params)
    monkeypatch.setenv("JAXSPEC_CACHE_ATTENTION", "xla")
    assert not kernels(fuse_qkv(params))
    jax.clear_caches()


def assert_the_kernels_give_xlas(monkeypatch, attention_env: str, run, *args):
    """run(*args) through the prologue and the attention kernel (`attention_env` names the
    attention's variable) equals it through XLA's pieces; the traced program calls both kernels."""
    want = jax.jit(run)(*args)
    monkeypatch.setenv(attention_env, KERNEL)
    monkeypatch.setenv("JAXSPEC_ATTENTION_PROLOGUE", "triton")
    jax.clear_caches()
    assert {"_attention_prologue", "_paged_attention"} <= kernels_in(str(jax.make_jaxpr(run)(*args)))
    got = jax.jit(run)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
    jax.clear_caches()


def test_on_a_mesh_each_device_runs_the_kernels_on_its_rows_and_kv_heads(monkeypatch):
    """A dense cache split over data x fsdp (rows) and tensor (KV heads): the prologue and the
    attention kernel on every device (shard_map) give XLA's logits and cache."""
    cfg = config("qwen2")
    sharding = Sharding(make_mesh(2, 2, 2))
    params = shard_params(sharding, fuse_qkv(random_params(cfg, jax.random.key(0))))
    cache = init_cache(cfg, 4, 16)
    cache = jax.device_put(cache, sharding.named(KV_CACHE_AXES, cache.k[0].shape))
    assert cache.k[0].sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"), None, "tensor", None)
    tokens = jax.random.randint(jax.random.key(1), (4, 5), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (4, 5))

    def run(params, cache):
        return extend(cfg, params, cache, tokens, positions, jnp.asarray([0, 2, 1, 3], jnp.int32), sharding=sharding)

    assert_the_kernels_give_xlas(monkeypatch, "JAXSPEC_CACHE_ATTENTION", run, params, cache)


@pytest.mark.parametrize("groups", [2, 0], ids=["grouped", "one-pool"])
def test_on_a_mesh_each_device_runs_the_kernels_on_its_pages(monkeypatch, groups):
    """Paged pools on a data x fsdp x tensor mesh: grouped ones (the slot engine's: a group's slots
    hold page ids of its own pool, one group per batch shard) and one pool of all pages; the
    prologue writes each device's new keys and values into its pages and the attention kernel
    reads them: XLA's logits and pools."""
    cfg = config("qwen3")
    sharding = Sharding(make_mesh(2, 1, 2, devices=jax.devices()[:4]))
    params = shard_params(sharding, fuse_qkv(random_params(cfg, jax.random.key(0))))
    rng = np.random.default_rng(1)
    slots = 4
    if groups:
        pages = slots // groups * PAGES_PER_ROW + 1
        table = np.concatenate([rng.permutation(pages)[: slots // groups * PAGES_PER_ROW] for _ in range(groups)])
        pool_shape, axes = (groups, pages, PAGE, cfg.num_kv_heads, cfg.head_dim), KV_PAGES_AXES
    else:
        pages = slots * PAGES_PER_ROW + 1
        table = rng.permutation(pages)[: slots * PAGES_PER_ROW]
        pool_shape, axes = (pages, PAGE, cfg.num_kv_heads, cfg.head_dim), KV_PAGES_AXES[1:]
    pools = [jax.device_put(jnp.zeros(pool_shape), sharding.named(axes, pool_shape)) for _ in range(2 * cfg.num_layers)]
    table = jnp.asarray(table.reshape(slots, PAGES_PER_ROW), jnp.int32)
    cache = PagedKVCache(k=tuple(pools[::2]), v=tuple(pools[1::2]), page_table=table)
    tokens = jax.random.randint(jax.random.key(1), (slots, 5), 0, cfg.vocab_size)
    lens = jnp.asarray([0, 2, 1, 3], jnp.int32)
    positions = lens[:, None] + jnp.arange(5, dtype=jnp.int32)[None, :]

    def run(params, cache):
        return extend(cfg, params, cache, tokens, positions, lens, sharding=sharding)

    assert_the_kernels_give_xlas(monkeypatch, "JAXSPEC_PAGED_ATTENTION", run, params, cache)


def test_auto_is_the_kernel_off_a_mesh_where_the_kernels_run_in_command_buffers(monkeypatch):
    """The default on a GPU with jax-triton: the prologue kernel where the Triton kernels run inside
    XLA's command buffers, not on a mesh, not where they do not; the variable overrides it."""
    cfg = config("qwen3")
    layer = fuse_qkv(random_params(cfg, jax.random.key(0)))["layers"][0]
    cache = caches(cfg, paged=True)
    x = jnp.zeros((ROWS, 1, cfg.hidden_size))
    mesh = Sharding(make_mesh(data=2, fsdp=1, tensor=1, devices=jax.devices()[:2]))

    def choice(sharding=None):
        return prologue_impl(cfg, layer, x, cache.k[0], cache.v[0], True, sharding)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace())
    attention_module._jax_triton_imports.cache_clear()  # seen afresh: it imports now
    try:
        assert choice() == "xla"
        monkeypatch.setattr(command_buffers, "in_graphs", lambda: True)
        assert choice() == "triton"
        assert choice(mesh) == "xla"
        monkeypatch.setenv("JAXSPEC_ATTENTION_PROLOGUE", "xla")
        assert choice() == "xla"
    finally:
        attention_module._jax_triton_imports.cache_clear()
