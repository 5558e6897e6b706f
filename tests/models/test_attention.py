"""`cache_attention`: the kernel path (the Triton attention kernel on the dense cache viewed as one
page per row, in Triton's interpreter) equals the dense masked path for decode steps, chains and
trees of new tokens, per-row prefix lengths, bf16 caches, and a cache sharded over batch and kv
heads; stale slots past the new tokens are never read. Which implementation "auto" and the
explicit impls pick, on CPU and (its choice only) on a GPU with and without jax-triton."""

import importlib.util
import logging
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import command_buffers
from jaxspec.models import ModelConfig, extend, init_cache, make_mesh
from jaxspec.models import attention as attention_module
from jaxspec.models.attention import cache_attention, kernel_impl, merge_impl
from jaxspec.models.sharding import KV_CACHE_AXES, Sharding
from tests.models.hf_reference import random_params

BATCH, MAX_LEN, HEADS, KV_HEADS, HEAD_DIM = 4, 150, 4, 2, 16
CACHE_LEN = np.array([0, 17, 64, 140], np.int32)  # the new tokens end at slot 140 + T - 1 < 150
KERNEL = "triton-interpret"
needs_triton = pytest.mark.skipif(
    not (importlib.util.find_spec("triton") and importlib.util.find_spec("torch")),
    reason="the kernel runs in Triton's interpreter (the test extra has triton and torch)",
)


def new_tokens(t: int, dtype=jnp.float32, seed: int = 0):
    """q [B, T, Nq, D] and a cache whose slots past cache_len + T hold large garbage, which would
    dominate any softmax that read them."""
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (BATCH, t, HEADS, HEAD_DIM), dtype)
    k = 2.0 * jax.random.normal(ks[1], (BATCH, MAX_LEN, KV_HEADS, HEAD_DIM), dtype)
    v = jax.random.normal(ks[2], (BATCH, MAX_LEN, KV_HEADS, HEAD_DIM), dtype)
    stale = jnp.arange(MAX_LEN)[None, :] >= (CACHE_LEN + t)[:, None]
    garbage = jnp.asarray(300.0, dtype)
    return q, jnp.where(stale[:, :, None, None], garbage, k), jnp.where(stale[:, :, None, None], garbage, v)


def random_tree_mask(t: int, seed: int) -> jnp.ndarray:
    """Ancestor-or-self masks of random trees over the T new tokens (node 0 the root)."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((BATCH, t, t), bool)
    for b in range(BATCH):
        mask[b, 0, 0] = True
        for n in range(1, t):
            mask[b, n] = mask[b, rng.integers(0, n)]
            mask[b, n, n] = True
    return jnp.asarray(mask)


@needs_triton
@pytest.mark.parametrize("t,tree", [(1, False), (4, False), (6, True)])
def test_kernel_path_equals_dense_path(t, tree):
    q, k, v = new_tokens(t)
    mask = random_tree_mask(t, seed=t) if tree else None
    cache_len = jnp.asarray(CACHE_LEN)
    want = cache_attention(q, k, v, cache_len, mask, impl="xla")
    got = cache_attention(q, k, v, cache_len, mask, impl=KERNEL)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", pytest.param(KERNEL, marks=needs_triton)])
def test_inactive_rows_read_no_prefix(impl):
    """Rows marked inactive attend to their new tokens alone: their output equals the same tokens
    at slot 0 of an empty cache, and active rows are as if no row were inactive. The kernel does
    not read an inactive row's prefix: NaN there changes nothing (the dense path multiplies every
    slot, so it only masks)."""
    t = 3
    q, k, v = new_tokens(t, seed=5)
    mask = random_tree_mask(t, seed=5)
    cache_len = jnp.asarray(CACHE_LEN)
    active = jnp.asarray([True, False, True, False])
    prefix = (jnp.arange(MAX_LEN)[None, :] < cache_len[:, None]) & ~active[:, None]
    poison = jnp.nan if impl == KERNEL else 300.0
    poisoned_k, poisoned_v = (jnp.where(prefix[:, :, None, None], poison, x) for x in (k, v))
    got = cache_attention(q, poisoned_k, poisoned_v, cache_len, mask, active=active, impl=impl)
    assert np.isfinite(np.asarray(got)).all()
    want_active = cache_attention(q, k, v, cache_len, mask, impl="xla")
    np.testing.assert_allclose(got[np.asarray(active)], want_active[np.asarray(active)], rtol=1e-5, atol=1e-5)
    slots = cache_len[:, None] + jnp.arange(t)[None, :]
    moved_k, moved_v = (
        jnp.zeros_like(x).at[:, :t].set(jnp.take_along_axis(x, slots[:, :, None, None], axis=1)) for x in (k, v)
    )
    want_inactive = cache_attention(q, moved_k, moved_v, jnp.zeros_like(cache_len), mask, impl="xla")
    inactive = ~np.asarray(active)
    np.testing.assert_allclose(got[inactive], want_inactive[inactive], rtol=1e-5, atol=1e-5)
    assert not np.allclose(got[inactive], want_active[inactive], atol=1e-3)  # the prefix really was dropped


@needs_triton
def test_new_tokens_past_the_last_slot_are_unseen():
    """Row 3's chain of 6 runs 2 tokens past the cache (dropped by `extend`'s write); both paths
    let no one attend to them."""
    ks = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(ks[0], (BATCH, 6, HEADS, HEAD_DIM))
    k, v = (jax.random.normal(key, (BATCH, MAX_LEN, KV_HEADS, HEAD_DIM)) for key in ks[1:])
    cache_len = jnp.asarray(CACHE_LEN.tolist()[:3] + [MAX_LEN - 4], jnp.int32)
    want = cache_attention(q, k, v, cache_len, impl="xla")
    np.testing.assert_allclose(cache_attention(q, k, v, cache_len, impl=KERNEL), want, rtol=1e-5, atol=1e-5)


@needs_triton
def test_kernel_path_bf16():
    q, k, v = new_tokens(3, jnp.bfloat16, seed=1)
    cache_len = jnp.asarray(CACHE_LEN)
    want = cache_attention(q, k, v, cache_len, impl="xla").astype(jnp.float32)
    got = cache_attention(q, k, v, cache_len, impl=KERNEL).astype(jnp.float32)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)  # bf16 probabilities before the value matmul


@needs_triton
def test_kernel_path_on_a_sharded_cache():
    sharding = Sharding(make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4]))
    q, k, v = new_tokens(4, seed=2)
    cache_spec = sharding.named(KV_CACHE_AXES, k.shape)
    assert cache_spec.spec[0] is not None and cache_spec.spec[2] is not None  # both axes really split
    k, v = jax.device_put(k, cache_spec), jax.device_put(v, cache_spec)
    cache_len = jnp.asarray(CACHE_LEN)
    attend = jax.jit(lambda *a: cache_attention(*a, sharding=sharding, impl=KERNEL))
    want = cache_attention(q, k, v, cache_len, impl="xla")
    np.testing.assert_allclose(attend(q, k, v, cache_len), want, rtol=1e-5, atol=1e-5)


@needs_triton
def test_calls_the_kernel_does_not_take_run_the_reference():
    """q and the cache in different dtypes, a head dim that is not a power of two, or more than 128
    query rows per kv head: impl "triton-interpret" runs the dense path (equal to impl "xla")."""
    q, k, v = new_tokens(1)
    cache_len = jnp.asarray(CACHE_LEN)
    q16 = q.astype(jnp.bfloat16)
    assert kernel_impl(KERNEL, attention_module.IMPL_ENV, "cache attention", q16, k, v) == "xla"
    np.testing.assert_array_equal(
        cache_attention(q16, k, v, cache_len, impl=KERNEL), cache_attention(q16, k, v, cache_len, impl="xla")
    )
    q12, k12 = q[..., :12], k[..., :12]
    assert kernel_impl(KERNEL, attention_module.IMPL_ENV, "cache attention", q12, k12, k12) == "xla"
    q_long, k_long, v_long = new_tokens(65)  # 65 x 2 query heads per kv head: 130 rows
    assert kernel_impl(KERNEL, attention_module.IMPL_ENV, "cache attention", q_long, k_long, v_long) == "xla"
    assert kernel_impl(KERNEL, attention_module.IMPL_ENV, "cache attention", q, k, v) == KERNEL  # the control


@needs_triton
def test_extend_uses_the_implementation_from_the_environment(monkeypatch):
    """A verification-shaped extend (4 new tokens after a prefill) gives the same logits with
    JAXSPEC_CACHE_ATTENTION=triton-interpret as with xla."""
    cfg = ModelConfig(
        family="qwen3",
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=64,
    )
    params = random_params(cfg, jax.random.key(3))
    tokens = jax.random.randint(jax.random.key(4), (2, 12), 0, cfg.vocab_size)
    prefix = jnp.asarray([5, 8], jnp.int32)

    def run():
        _, _, cache = extend(
            cfg,
            params,
            init_cache(cfg, 2, 32),
            tokens[:, :8],
            jnp.broadcast_to(jnp.arange(8), (2, 8)),
            jnp.zeros((2,), jnp.int32),
        )
        logits, _, _ = extend(cfg, params, cache, tokens[:, 8:], prefix[:, None] + jnp.arange(4), prefix)
        return logits

    monkeypatch.setenv("JAXSPEC_CACHE_ATTENTION", "xla")
    want = run()
    monkeypatch.setenv("JAXSPEC_CACHE_ATTENTION", KERNEL)
    np.testing.assert_allclose(run(), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("JAXSPEC_CACHE_ATTENTION", "flash")
    with pytest.raises(ValueError, match="JAXSPEC_CACHE_ATTENTION"):
        run()


@pytest.fixture
def fresh_jax_triton_check():
    """`kernel_impl`'s cached check that jax-triton imports, forgotten before and after the test."""
    attention_module._jax_triton_imports.cache_clear()
    yield
    attention_module._jax_triton_imports.cache_clear()


@needs_triton
def test_auto_picks_the_kernel_on_a_gpu_with_jax_triton(monkeypatch, fresh_jax_triton_check):
    """What runs on the GPU itself is not testable on CPU: only the choice "auto" makes."""
    q, k, v = new_tokens(1, jnp.bfloat16)
    q32, k32, v32 = new_tokens(1)

    def choice(q, k, v, **kw):
        return kernel_impl("auto", attention_module.IMPL_ENV, "cache attention", q, k, v, **kw)

    assert choice(q, k, v) == "xla"  # the CPU backend
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace())
    assert choice(q, k, v) == "triton" and choice(q32, k32, v32) == "triton"
    assert choice(q, k, v, applies=False) == "xla"  # e.g. a mesh splits the cache's sequence axis
    assert choice(q[..., :12], k[..., :12], v[..., :12]) == "xla"
    monkeypatch.setenv(attention_module.IMPL_ENV, "xla")
    assert choice(q, k, v) == "xla"


@needs_triton
def test_auto_without_jax_triton_runs_the_reference_and_says_so_once(monkeypatch, caplog, fresh_jax_triton_check):
    """On a GPU where jax_triton does not import, "auto" runs the reference with one warning naming
    the extra to install; an explicit "triton" raises, naming it too."""
    q, k, v = new_tokens(1)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setitem(sys.modules, "jax_triton", None)  # import jax_triton raises ImportError
    with caplog.at_level(logging.WARNING, logger=attention_module.__name__):
        for _ in range(2):
            assert kernel_impl("auto", attention_module.IMPL_ENV, "cache attention", q, k, v) == "xla"
    warnings = [r.getMessage() for r in caplog.records if r.name == attention_module.__name__]
    assert len(warnings) == 1 and "pip install 'jaxspec[triton]'" in warnings[0]
    with pytest.raises(ImportError, match=r"jax-triton .*pip install 'jaxspec\[triton\]'"):
        cache_attention(q, k, v, jnp.asarray(CACHE_LEN), impl="triton")


def test_the_merge_kernel_is_the_default_where_the_kernels_run_in_command_buffers(monkeypatch):
    """ "auto" merges the splits with XLA's pieces unless the Triton kernels run inside XLA's command
    buffers, and then not in the interpreter; the variable overrides it."""
    assert merge_impl(interpret=False) == "xla"  # the CPU
    monkeypatch.setattr(command_buffers, "in_graphs", lambda: True)
    assert merge_impl(interpret=False) == "triton"
    assert merge_impl(interpret=True) == "xla"
    monkeypatch.setenv(attention_module.MERGE_ENV, "xla")
    assert merge_impl(interpret=False) == "xla"
    monkeypatch.setenv(attention_module.MERGE_ENV, "triton")
    assert merge_impl(interpret=True) == "triton"
