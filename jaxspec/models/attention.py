"""Grouped-query attention: dense over full sequences, and over a KV cache for a few new tokens.

`use_cudnn_attention` says when a full-sequence attention runs as cuDNN flash attention instead.

`cache_attention` is the attention of `extend` (decode steps, speculative verification, the
draft head's passes): T new tokens per row attend to their row's valid cache prefix and, through a
tree mask, to each other. Two implementations with the same semantics:

* "xla": dense scores over every cache slot, masked (`attention` + `cache_attention_mask`);
* "pallas": one `jaxspec.kernels.ragged_attention` kernel over the prefix and the new tokens (KV blocks
  read only up to each row's last new token, the tree mask applied inside), then a merge of its
  partials across cache splits. On GPU for 16-bit caches; it reads a fraction length / max_len of
  the cache that the dense path reads in full.

"auto" picks "pallas" on GPU where the kernel applies, else "xla"; the JAXSPEC_CACHE_ATTENTION
environment variable (auto, xla, pallas, interpret) overrides "auto" at trace time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.kernels.dispatch import requested_impl
from jaxspec.kernels.ragged_attention import Partials, cache_attention_pallas, merge, new_token_bits
from jaxspec.models.sharding import KV_CACHE_AXES, Sharding

IMPLS = ("auto", "xla", "pallas", "interpret")
IMPL_ENV = "JAXSPEC_CACHE_ATTENTION"
MAX_KERNEL_ROWS = 128  # query rows (new tokens x query heads per kv head) the kernel holds at once


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention.

    q [B, T, Nq, D], k/v [B, S, Nk, D], mask bool [B, T, S] (True = may attend) -> [B, T, Nq, D].
    Scores and softmax in float32.
    """
    b, t, nq, d = q.shape
    nk = k.shape[2]
    with jax.named_scope("attention"):
        qg = q.reshape(b, t, nk, nq // nk, d)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d**-0.5)
        scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
        return out.reshape(b, t, nq, d).astype(q.dtype)


def use_cudnn_attention(impl: str, dtype, head_dim: int, seq_len: int) -> bool:
    """Whether a full-sequence attention of `seq_len` queries runs as cuDNN flash attention: impl
    "cudnn", or "auto" on GPU for 16-bit inputs with head_dim % 8 == 0 and seq_len % 64 == 0
    ("xla": masked scores)."""
    if impl not in ("auto", "xla", "cudnn"):
        raise ValueError(f"attention_impl must be 'auto', 'xla' or 'cudnn', got {impl!r}")
    if impl == "auto":
        return (
            jax.default_backend() == "gpu"
            and head_dim % 8 == 0
            and seq_len % 64 == 0
            and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
        )
    return impl == "cudnn"


def cache_attention_mask(
    cache_len: jax.Array,
    num_new: int,
    max_len: int,
    tree_mask: jax.Array | None = None,
    active: jax.Array | None = None,
) -> jax.Array:
    """Which cache slots each of `num_new` tokens written at slots cache_len[b] + t may attend to.

    cache_len int32 [B]; tree_mask bool [B, T, T] among the new tokens (default causal); active
    bool [B] (default all): rows that see their prefix. Returns bool [B, T, max_len]: every slot
    < cache_len[b] of an active row, plus the new tokens' slots per tree_mask.
    """
    b, t = cache_len.shape[0], num_new
    tree_mask = _tree_mask(b, t, tree_mask)
    rel = jnp.arange(max_len, dtype=jnp.int32)[None, :] - cache_len[:, None]  # [B, S] slot offset from new block
    in_prefix = rel < 0 if active is None else (rel < 0) & active[:, None]
    in_new = (rel >= 0) & (rel < t)
    new_visible = jnp.take_along_axis(tree_mask, jnp.clip(rel, 0, t - 1)[:, None, :].repeat(t, axis=1), axis=2)
    return in_prefix[:, None, :] | (in_new[:, None, :] & new_visible)


def cache_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_len: jax.Array,
    tree_mask: jax.Array | None = None,
    *,
    active: jax.Array | None = None,
    sharding: Sharding | None = None,
    impl: str = "auto",
) -> jax.Array:
    """Attention of T new tokens over a cache that already holds their keys and values.

    q [B, T, Nq, D]; k/v_cache [B, S, Nk, D] with row b's prefix in slots [0, cache_len[b]) and
    the new tokens in slots cache_len[b] + t (those past the last slot were dropped and are seen by
    no one); cache_len int32 [B]; tree_mask bool [B, T, T], which new tokens each new token sees
    (default causal). active bool [B] (default all True): a row that is not active sees only its
    new tokens, not its prefix, so the kernel reads none of its cache: decode loops pass the rows
    still generating, and the outputs of the others are discarded. sharding: the mesh the cache is
    laid out on (by `KV_CACHE_AXES`), for the kernel's per-shard call. Returns [B, T, Nq, D] in
    q's dtype.
    """
    impl = _resolve_impl(impl, q, k_cache, sharding)
    if impl == "xla":
        mask = cache_attention_mask(cache_len, q.shape[1], k_cache.shape[1], tree_mask, active)
        return attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask)
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"cache attention impl {impl!r} needs one dtype for q and the cache, got q {q.dtype}, "
            f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
        )
    b, t, nq, d = q.shape
    nk = k_cache.shape[2]
    group = nq // nk
    prefix_len = cache_len if active is None else jnp.where(active, cache_len, 0)
    with jax.named_scope("attention"):
        rows = _pow2(max(16, t * group))
        q_rows = q.reshape(b, t, nk, group, d).transpose(0, 2, 1, 3, 4).reshape(b, nk, t * group, d)
        q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - t * group), (0, 0)))
        bits = new_token_bits(_tree_mask(b, t, tree_mask), group, rows)
        parts = _sharded_kernel(q_rows, k_cache, v_cache, prefix_len, cache_len, bits, t, sharding, impl == "interpret")
        out = merge(parts)[:, :, : t * group]  # [B, Nk, T*G, D]
        return out.reshape(b, nk, t, group, d).transpose(0, 2, 1, 3, 4).reshape(b, t, nq, d).astype(q.dtype)


def _sharded_kernel(
    q_rows, k_cache, v_cache, prefix_len, new_start, bits, num_new: int, sharding: Sharding | None, interpret: bool
) -> Partials:
    """The kernel per device shard of the batch and kv-head axes of the cache."""

    def kernel(q, k, v, n, s, w):
        return cache_attention_pallas(q, k, v, n, s, w, num_new=num_new, interpret=interpret)

    if sharding is None or sharding.mesh.size == 1:
        return kernel(q_rows, k_cache, v_cache, prefix_len, new_start, bits)
    batch_axes, _, head_axes, _ = sharding.spec(KV_CACHE_AXES, k_cache.shape)
    P = jax.sharding.PartitionSpec
    cache_spec, rows_spec = P(batch_axes, None, head_axes, None), P(batch_axes, head_axes)
    return jax.shard_map(
        kernel,
        mesh=sharding.mesh,
        in_specs=(rows_spec, cache_spec, cache_spec, P(batch_axes), P(batch_axes), P(batch_axes)),
        out_specs=Partials(rows_spec, rows_spec, rows_spec),
        check_vma=False,
    )(q_rows, k_cache, v_cache, prefix_len, new_start, bits)


def _resolve_impl(impl: str, q: jax.Array, k_cache: jax.Array, sharding: Sharding | None) -> str:
    impl = requested_impl(impl, IMPLS, IMPL_ENV, "cache attention")
    if impl == "auto":
        return "pallas" if _kernel_applies(q, k_cache, sharding) else "xla"
    return impl


def _kernel_applies(q: jax.Array, k_cache: jax.Array, sharding: Sharding | None) -> bool:
    """GPU, one 16-bit dtype, a power-of-two head dim, few query rows, the sequence unsharded."""
    b, t, nq, d = q.shape
    nk = k_cache.shape[2]
    if sharding is not None and sharding.spec(KV_CACHE_AXES, k_cache.shape)[1] is not None:
        return False
    return (
        jax.default_backend() == "gpu"
        and q.dtype == k_cache.dtype
        and jnp.dtype(q.dtype) in (jnp.bfloat16, jnp.float16)
        and d >= 16
        and d == _pow2(d)
        and t * (nq // nk) <= MAX_KERNEL_ROWS
    )


def _tree_mask(b: int, t: int, tree_mask: jax.Array | None) -> jax.Array:
    if tree_mask is None:
        return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    return tree_mask


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
