"""Grouped-query attention: dense over full sequences, and over a KV cache for a few new tokens.

`use_cudnn_attention` says when a full-sequence attention runs as cuDNN flash attention instead.

`cache_attention` is the attention of `extend` (decode steps, speculative verification, the
draft head's passes): T new tokens per row attend to their row's valid cache prefix and, through a
tree mask, to each other. Two implementations with the same semantics:

* "xla": dense scores over every cache slot, masked (`attention` + `cache_attention_mask`): the
  jnp reference;
* "triton": the attention kernel of `jaxspec.kernels.paged_attention_triton` (the Triton language
  through jax-triton, the `triton` extra), the one kernel of both engines: the dense cache
  [B, S, Nk, D] is a pool of B pages of S positions, row b's page table naming page b
  (`kernel_attention`), so the kernel reads KV blocks only up to each row's last new token and
  applies the tree mask inside, for the steps it applies to (bfloat16, float16 or float32, head
  dim a power of two in [16, 256], at most 128 query rows of new tokens x query heads per kv
  head; other calls run the reference). "triton-interpret" runs it in Triton's interpreter on the
  host (any backend, slow; needs torch).

`kernel_impl` resolves an impl for both engines (`jaxspec.models.paged.paged_attention` too):
"auto" is "triton" on a GPU where the kernel applies and jax-triton imports (where it does not,
the reference, with one logged warning), else "xla"; the JAXSPEC_CACHE_ATTENTION environment
variable (auto, xla, triton, triton-interpret) overrides "auto" at trace time.

The kernel leaves the partial sums of its splits of a row's cache; they are merged and laid out
as [B, T, Nq, D] by XLA (two launches), or by one kernel (`jaxspec.kernels.attention_merge_triton`):
JAXSPEC_ATTENTION_MERGE ("auto", "xla", "triton") chooses, "auto" the kernel where the Triton kernels
run inside XLA's command buffers (`merge_impl`).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from jaxspec.kernels import command_buffers
from jaxspec.kernels.attention_partials import causal_token_bits, merge, new_token_bits
from jaxspec.kernels.dispatch import requested_impl
from jaxspec.models.sharding import KV_CACHE_AXES, Sharding, on_devices

IMPLS = ("auto", "xla", "triton", "triton-interpret")
KERNEL_IMPLS = ("triton", "triton-interpret")
IMPL_ENV = "JAXSPEC_CACHE_ATTENTION"
MERGE_IMPLS = ("auto", "xla", "triton")
MERGE_ENV = "JAXSPEC_ATTENTION_MERGE"

logger = logging.getLogger(__name__)


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
    tree_mask = tree_mask_or_causal(b, t, tree_mask)
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
    laid out on (by `KV_CACHE_AXES`), for the kernel's per-shard call (a cache whose sequence axis
    the mesh splits runs the reference). impl: see the module docstring. Returns [B, T, Nq, D] in
    q's dtype.
    """
    sequence_split = sharding is not None and sharding.spec(KV_CACHE_AXES, k_cache.shape)[1] is not None
    impl = kernel_impl(impl, IMPL_ENV, "cache attention", q, k_cache, v_cache, applies=not sequence_split)
    if impl == "xla":
        mask = cache_attention_mask(cache_len, q.shape[1], k_cache.shape[1], tree_mask, active)
        return attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask)

    def dense_kernel(q, k_cache, v_cache, cache_len, tree_mask, active):
        table = jnp.arange(k_cache.shape[0], dtype=jnp.int32)[:, None]  # row b: page b, its whole cache
        return kernel_attention(
            q, k_cache, v_cache, table, cache_len, tree_mask, active, interpret=impl == "triton-interpret"
        )

    if not on_devices(sharding):
        return dense_kernel(q, k_cache, v_cache, cache_len, tree_mask, active)
    b, t = q.shape[:2]
    tree_mask = tree_mask_or_causal(b, t, tree_mask)
    active = jnp.ones((b,), bool) if active is None else active
    batch_axes, _, head_axes, _ = sharding.spec(KV_CACHE_AXES, k_cache.shape)
    P = jax.sharding.PartitionSpec
    heads, rows = P(batch_axes, None, head_axes, None), P(batch_axes)
    return jax.shard_map(
        dense_kernel,
        mesh=sharding.mesh,
        in_specs=(heads, heads, heads, rows, rows, rows),
        out_specs=heads,
        check_vma=False,
    )(q, k_cache, v_cache, cache_len, tree_mask, active)


def kernel_impl(
    impl: str, env_var: str, what: str, q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, *, applies: bool = True
) -> str:
    """The implementation ("xla", "triton" or "triton-interpret") that `impl` (or, for "auto", the
    environment variable `env_var`; ValueError naming `what` for an unknown one) picks for the
    attention of q [B, T, Nq, D] over pools [P, page_size, Nk, D] (or a dense cache): a kernel impl
    where the kernel takes the call (`jaxspec.kernels.paged_attention_triton.kernel_applies`, and
    `applies`), else "xla"; "auto" is "triton" on a GPU where jax-triton imports (else "xla", and a
    warning the first time)."""
    impl = requested_impl(impl, IMPLS, env_var, what)
    if impl == "xla" or (impl == "auto" and jax.default_backend() != "gpu"):
        return "xla"
    if impl == "auto" and not _jax_triton_imports():
        return "xla"
    if not (applies and triton_kernel().kernel_applies(q, k_pool, v_pool)):
        return "xla"
    return "triton" if impl == "auto" else impl


def kernel_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    page_table: jax.Array,
    cache_len: jax.Array,
    tree_mask: jax.Array | None = None,
    active: jax.Array | None = None,
    *,
    interpret: bool = False,
    **tuning,
) -> jax.Array:
    """The attention of q [B, T, Nq, D] by the Triton kernel over k/v_pool [P, page_size, Nk, D]
    through page_table int32 [B, M] (`paged_attention`'s arguments): the query rows of each (row,
    kv head) are its T new tokens x G query heads (row r is token r // G), padded to a power of
    two >= 16; prefix_len is cache_len where active (default all), else 0. interpret runs the
    kernel in Triton's interpreter; `tuning` (block_kv, splits, num_warps, num_stages) goes to
    `paged_attention_partials`. Returns [B, T, Nq, D] in q's dtype."""
    t, nq = q.shape[1:3]
    nk = k_pool.shape[2]
    group = nq // nk
    with jax.named_scope("attention"):
        q_rows = query_rows_of(q, nk, triton_kernel().query_rows(t * group))
    return kernel_attention_rows(
        q_rows,
        k_pool,
        v_pool,
        page_table,
        cache_len,
        tree_mask,
        active,
        num_new=t,
        group=group,
        interpret=interpret,
        **tuning,
    )


def query_rows_of(q: jax.Array, kv_heads: int, rows: int) -> jax.Array:
    """q [B, T, Nq, D] as the attention kernel's query rows [B, Nk, R, D]: row r of kv head j is
    token r // G's query head j * G + r % G (G = Nq / Nk query heads per kv head), zeros from
    T * G up to R = rows (`jaxspec.kernels.paged_attention_triton.query_rows`)."""
    b, t, nq, d = q.shape
    group = nq // kv_heads
    q_rows = q.reshape(b, t, kv_heads, group, d).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, t * group, d)
    return jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - t * group), (0, 0)))


def kernel_attention_rows(
    q_rows: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    page_table: jax.Array,
    cache_len: jax.Array,
    tree_mask: jax.Array | None = None,
    active: jax.Array | None = None,
    *,
    num_new: int,
    group: int,
    interpret: bool = False,
    **tuning,
) -> jax.Array:
    """`kernel_attention` from the query rows the kernel reads, q_rows [B, Nk, R, D]: row r of kv
    head j is new token r // G's query head j * G + r % G (T = num_new new tokens, G = group query
    heads per kv head), zeros from T * G up to R (`jaxspec.kernels.paged_attention_triton.query_rows`),
    as the attention prologue kernel writes them (`jaxspec.models.attention_prologue`); the splits
    merged by XLA or by the merge kernel (`merge_impl`). Returns
    [B, T, Nq, D] in q_rows' dtype."""
    b, nk, rows, d = q_rows.shape
    t = num_new
    prefix_len = cache_len if active is None else jnp.where(active, cache_len, 0)
    with jax.named_scope("attention"):
        # A causal step's bits are a constant of one row (nothing to compute on the device).
        bits = causal_token_bits(t, group, rows) if tree_mask is None else new_token_bits(tree_mask, group, rows)
        parts = triton_kernel().paged_attention_partials(
            q_rows, k_pool, v_pool, page_table, prefix_len, cache_len, bits, num_new=t, interpret=interpret, **tuning
        )
        dtype = q_rows.dtype
        if merge_impl(interpret) == "triton":
            return merge_kernel().merge_partials(parts, num_new=t, group=group, dtype=dtype, interpret=interpret)
        out = merge(parts)[:, :, : t * group]  # [B, Nk, T*G, D]
        return out.reshape(b, nk, t, group, d).transpose(0, 2, 1, 3, 4).reshape(b, t, nk * group, d).astype(dtype)


def merge_impl(interpret: bool) -> str:
    """How the attention kernel's splits are merged: JAXSPEC_ATTENTION_MERGE ("xla", "triton"), or
    for "auto" the merge kernel where the Triton kernels run inside XLA's command buffers (not in
    the interpreter; `jaxspec.kernels.command_buffers.in_graphs`), else XLA."""
    impl = requested_impl("auto", MERGE_IMPLS, MERGE_ENV, "attention merge")
    if impl == "auto":
        return "triton" if not interpret and command_buffers.in_graphs() else "xla"
    return impl


def merge_kernel():
    """`jaxspec.kernels.attention_merge_triton`, imported with the attention kernel's (triton is an
    optional dependency)."""
    triton_kernel()
    from jaxspec.kernels import attention_merge_triton

    return attention_merge_triton


def triton_kernel():
    """`jaxspec.kernels.paged_attention_triton`, imported on first use (triton is an optional dependency)."""
    try:
        from jaxspec.kernels import paged_attention_triton
    except ImportError as e:
        raise ImportError(
            f"the Triton attention kernel needs the triton package ({e}; pip install 'jaxspec[triton]')"
        ) from e
    return paged_attention_triton


@functools.cache
def _jax_triton_imports() -> bool:
    """Whether jax_triton and triton import; logs a warning (once) where they do not."""
    try:
        import jax_triton  # noqa: F401

        triton_kernel()
    except ImportError as e:
        logger.warning(
            "attention runs its jnp reference on this GPU: the Triton attention kernel needs jax-triton "
            "(pip install 'jaxspec[triton]'): %s",
            e,
        )
        return False
    return True


def tree_mask_or_causal(b: int, t: int, tree_mask: jax.Array | None) -> jax.Array:
    """tree_mask bool [B, T, T] as given, or the causal mask of T new tokens for each of B rows."""
    if tree_mask is None:
        return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    return tree_mask
