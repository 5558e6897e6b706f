"""Cached drafting with an EAGLE-3 head, for the speculative rollout loop.

Conventions (index j of the policy sequence: token x_j, policy aux features a_j after seeing
x_0..x_j). The head's entry at rope position j pairs a hidden input with token x_{j+1} and
predicts x_{j+2}:

* After the policy has verified/extended its sequence, the head's KV of the newly accepted
  entries is (re)computed from the policy's own features:
      draft_extend(..., tokens=x_{j+1}, hidden_in=fuse(dcfg, dparams, aux_j), positions=j, ...)
  over all new j at once (cache_len = entries already valid). The last entry's logits draft the
  first speculative token.
* Each further drafting step feeds the sampled draft token (mapped to a policy id with
  `to_target_ids`) with the previous step's `hidden_out` at the next position:
      draft_extend(..., tokens=drafted token, hidden_in=previous hidden_out, positions=j + 1, ...)
  Speculative entries are written past the accepted ones and are simply overwritten once the
  verification decides what was accepted (pass the accepted length as cache_len).

All functions are pure and jit-friendly: shapes are static, per-row offsets are data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.draft.config import DraftConfig
from jaxspec.draft.model import (
    DraftParams,
    check_embed,
    fuse,
    head_logits,
    layer_input,
    target_ids,
    to_target_ids,
)
from jaxspec.models.attention import attention, cache_attention, cache_attention_mask
from jaxspec.models.attention_prologue import layer_attention, prologue_impl
from jaxspec.models.blocks import attention_output, mlp, project_qkv
from jaxspec.models.kv_cache import KVCache
from jaxspec.models.paged import PagedKVCache, write_and_attend
from jaxspec.models.residual_norm import residual_norm
from jaxspec.models.rope import apply_rope, rope_tables
from jaxspec.models.sharding import Sharding

__all__ = ["draft_extend", "draft_logprobs_on_target_vocab", "fuse", "init_draft_cache", "to_target_ids"]


def init_draft_cache(dcfg: DraftConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """Empty one-layer cache: k/v tuples of one [batch, max_len, Nk, D] buffer each."""
    shape = (batch, max_len, dcfg.num_kv_heads, dcfg.head_dim)
    return KVCache(k=(jnp.zeros(shape, dtype),), v=(jnp.zeros(shape, dtype),))


def draft_extend(
    dcfg: DraftConfig,
    dparams: DraftParams,
    embed: jax.Array,
    cache: KVCache,
    tokens: jax.Array,
    hidden_in: jax.Array,
    positions: jax.Array,
    cache_len: jax.Array,
    tree_mask: jax.Array | None = None,
    prefix_mask: jax.Array | None = None,
    active: jax.Array | None = None,
    sharding: Sharding | None = None,
    last: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """Appends T entries per row to the head's cache and runs them through the head.

    cache: the head's one-layer `KVCache`, or a `PagedKVCache` whose slot b is row b.
    embed: the policy's token embedding [V, H] (frozen). tokens: int32 [B, T] policy token ids.
    hidden_in: [B, T, H], `fuse(...)` of the policy's aux features or a previous `hidden_out`.
    positions: int32 [B, T] rope positions. cache_len: int32 [B]; entries go to slots
    cache_len[b] + t. tree_mask: bool [B, T, T], which new entries each new entry sees (default
    causal). prefix_mask: bool [B, T, S], optional restriction of which slots < cache_len[b] each
    new entry sees (default all: for tree drafting, hide the siblings' branches in the cache).
    active: bool [B], rows still drafting (default all); the others see none of their prefix and
    their outputs are meaningless (`cache_attention`).
    sharding: the mesh the cache is laid out on (`KV_CACHE_AXES`), if any.
    last: int32 [B], or None: the outputs of entry last[b] alone (T' = 1 below; the others'
    logits are never computed).
    Returns (float32 logits [B, T', Vd] over the draft vocabulary, hidden_out [B, T', H] (layer
    output before the final norm, the next step's hidden input), updated cache); T' = T.
    """
    _check_inputs(dcfg, embed, cache, tokens, hidden_in, positions, cache_len, tree_mask, prefix_mask, active)
    b, t = tokens.shape
    layer, cfg = dparams["midlayer"], dcfg.layer_config
    cos, sin = rope_tables(cfg, positions)
    x = layer_input(dcfg, dparams, embed, tokens, hidden_in)  # XLA's norms: one fusion with the concatenation
    paged = isinstance(cache, PagedKVCache)
    if paged and prefix_mask is not None:
        raise ValueError("prefix_mask: a paged cache takes none (its tree drafting sees the whole prefix)")
    impl = "xla" if prefix_mask is not None else prologue_impl(cfg, layer, x, cache.k[0], cache.v[0], paged, sharding)
    if impl != "xla":  # one kernel from the projection to the attention kernel's query rows
        table = cache.page_table if paged else None
        attn, ck, cv = layer_attention(
            cfg,
            layer,
            x,
            cos,
            sin,
            cache.k[0],
            cache.v[0],
            table,
            cache_len,
            tree_mask,
            active,
            impl=impl,
            sharding=sharding,
        )
    else:
        q, k, v = project_qkv(x, layer, impl="auto", sharding=sharding)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if paged:
            attn, ck, cv = write_and_attend(cache, 0, q, k, v, cache_len, tree_mask, active, sharding)
        else:
            attn, ck, cv = _dense_attention(cache, q, k, v, cache_len, tree_mask, prefix_mask, active, sharding)
    logits, out = _output_and_logits(dcfg, dparams, _entries(hidden_in, last), _entries(attn, last), sharding)
    return logits, out, cache._replace(k=(ck,), v=(cv,))


def _dense_attention(cache, q, k, v, cache_len, tree_mask, prefix_mask, active, sharding):
    """The new entries' keys and values written into the dense one-layer cache, and their attention
    over it: (attention [B, T, Nq, D], k cache, v cache)."""
    b, t = q.shape[:2]
    rows = jnp.arange(b)[:, None]
    slots = cache_len[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    with jax.named_scope("kv_write"):
        ck = cache.k[0].at[rows, slots].set(k.astype(cache.k[0].dtype), mode="drop")
        cv = cache.v[0].at[rows, slots].set(v.astype(cache.v[0].dtype), mode="drop")
    if prefix_mask is None:
        return cache_attention(q, ck, cv, cache_len, tree_mask, active=active, sharding=sharding), ck, cv
    mask = cache_attention_mask(cache_len, t, cache.max_len, tree_mask, active)
    in_prefix = jnp.arange(cache.max_len)[None, None, :] < cache_len[:, None, None]
    return attention(q, ck.astype(q.dtype), cv.astype(q.dtype), mask & (prefix_mask | ~in_prefix)), ck, cv


def _output_and_logits(dcfg: DraftConfig, dparams: DraftParams, hidden: jax.Array, attn: jax.Array, sharding):
    """`model.layer_output` and `model.draft_logits` of the entries' hidden inputs [B, T, H] and
    attention [B, T, Nq, D], each residual add with the norm after it (`residual_norm`: one kernel
    where it runs): (float32 logits [B, T, Vd], layer output [B, T, H])."""
    layer = dparams["midlayer"]
    o = attention_output(layer, attn, impl="auto", sharding=sharding)
    x, normed = _add_norm(dcfg, hidden.astype(attn.dtype), o, layer["mlp_norm"], sharding)
    delta = mlp(dcfg.layer_config, layer, normed, sharding=sharding, matmul_impl="auto")[0]
    out, normed = _add_norm(dcfg, x, delta, dparams["norm"], sharding)
    return head_logits(dparams, normed, impl="auto", sharding=sharding), out


def _add_norm(dcfg: DraftConfig, x, delta, weight, sharding):
    return residual_norm(x, delta, weight, dcfg.rms_norm_eps, sharding)


def _entries(x: jax.Array, last: jax.Array | None) -> jax.Array:
    """x [B, T, ...], or its entries last int32 [B] alone [B, 1, ...] (the attention output of
    the others only fills the cache: their MLP and logits are skipped)."""
    if last is None:
        return x
    return jnp.take_along_axis(x, last.reshape(-1, *([1] * (x.ndim - 1))), axis=1)


def draft_logprobs_on_target_vocab(dparams: DraftParams, logits: jax.Array) -> jax.Array:
    """The head's distribution over the policy vocabulary: float32 logits [..., Vd] ->
    log-probabilities [..., V], -inf on tokens outside the draft vocabulary."""
    vocab = dparams["t2d"].shape[0]
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    full = jnp.full((*logits.shape[:-1], vocab), -jnp.inf, jnp.float32)
    return full.at[..., target_ids(dparams)].set(logprobs)


def _check_inputs(dcfg, embed, cache, tokens, hidden_in, positions, cache_len, tree_mask, prefix_mask, active) -> None:
    check_embed(dcfg, embed)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    b, t = tokens.shape
    expected = {
        "hidden_in": (hidden_in.shape, (b, t, dcfg.hidden_size)),
        "positions": (positions.shape, (b, t)),
        "cache_len": (cache_len.shape, (b,)),
        "cache": (
            (len(cache.k), cache.batch, *cache.k[0].shape[-2:]),
            (1, b, dcfg.num_kv_heads, dcfg.head_dim),
        ),
    }
    if tree_mask is not None:
        expected["tree_mask"] = (tree_mask.shape, (b, t, t))
    if active is not None:
        expected["active"] = (active.shape, (b,))
    if prefix_mask is not None:
        expected["prefix_mask"] = (prefix_mask.shape, (b, t, cache.max_len))
    for name, (got, want) in expected.items():
        if tuple(got) != tuple(want):
            what = "(layers, batch, kv heads, head dim)" if name == "cache" else "shape"
            raise ValueError(f"{name}: {what} {tuple(got)}, expected {tuple(want)}")
