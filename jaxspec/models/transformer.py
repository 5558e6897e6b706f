"""Functional decoder for Qwen2/2.5, Qwen3 (dense and MoE) and Llama 3.x: its two entry points.

The params are a plain pytree (`jaxspec.models.params`); both entry points run the same layers
(`jaxspec.models.blocks`):
  * `forward` / `forward_hidden`: full sequences (training, log-prob recomputation), with a padding
    mask and optional segment ids for packed sequences.
  * `extend`: append T new tokens per row to a static-shape `KVCache` (`jaxspec.models.kv_cache`)
    at per-row offsets and attend to the cached prefix plus the new tokens (T=1 is a decode step; a
    tree mask makes it the speculative verification forward; an empty cache makes it prefill).
Softmax, norms and logits are float32 whatever the parameter dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.models.attention import attention, cache_attention, use_cudnn_attention
from jaxspec.models.attention_prologue import layer_attention, prologue_impl
from jaxspec.models.blocks import (
    attention_output,
    attn_out_and_mlp,
    embed,
    head_params,
    logits_from_hidden,
    logits_from_normed,
    mlp,
    qkv,
    rms_norm,
)
from jaxspec.models.config import ModelConfig
from jaxspec.models.kv_cache import KVCache
from jaxspec.models.moe import expert_id_dtype
from jaxspec.models.packed_attention import check_segment_cap, packed_attention, packed_layout_here
from jaxspec.models.paged import PagedKVCache, write_and_attend
from jaxspec.models.params import Params
from jaxspec.models.residual_norm import residual_norm
from jaxspec.models.rope import rope_tables
from jaxspec.models.sharding import Sharding, constrain, on_devices


def _default_positions(mask: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Index of each token within its sequence (or segment) [B, T]."""
    b, t = mask.shape
    if segment_ids is None:
        return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return segment_positions(segment_ids)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """int32 [B, T]: index of each token within its run of equal segment ids [B, T] (packed rows)."""
    b, t = segment_ids.shape
    starts = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    idx = jnp.arange(t, dtype=jnp.int32)
    start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    return idx - start_idx


def forward_hidden(
    cfg: ModelConfig, params: Params, tokens: jax.Array, hidden_layers: tuple[int, ...] = (), **kwargs
) -> tuple[jax.Array, jax.Array]:
    """Full-sequence forward returning logits and chosen layers' outputs.

    tokens int32 [B, T]; mask bool [B, T] (False = right padding: each row's valid tokens come
    first); segment_ids int32 [B, T] (packed sequences, 1, 2, ... per row, each contiguous, 0 on
    padding after them, at most `packed_attention.segment_cap(T)` per row where cuDNN's packed layout
    is selected: each attends only within itself);
    positions int32 [B, T] (default: index within sequence/segment). hidden_layers: 0-based layer
    ids whose *outputs* are returned.
    attention_impl: "xla" (masked scores), "cudnn" (flash attention on GPU; packed sequences in
        cuDNN's packed layout where it is selected and the GPUs are Hopper or newer,
        `jaxspec.models.packed_attention`, else as a mask) or "auto" (cudnn on GPU for 16-bit
        params and T % 64 == 0, else xla).
    moe_impl: a sparse layer's grouped matmuls (`moe.grouped_matmul`; default "ragged_dot", the
        training path; all are differentiable).
    Returns (float32 logits [B, T, V], hidden [len(hidden_layers), B, T, H] in param dtype).
    """
    logits, hidden, _ = forward_router(cfg, params, tokens, hidden_layers, **kwargs)
    return logits, hidden


def forward_router(
    cfg: ModelConfig,
    params: Params,
    tokens: jax.Array,
    hidden_layers: tuple[int, ...] = (),
    *,
    mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    sharding: Sharding | None = None,
    remat: bool = False,
    attention_impl: str = "auto",
    moe_impl: str = "ragged_dot",
    head: bool = True,
    compute_dtype=None,
    experts: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`forward_hidden` plus the router logits of the sparse layers, float32
    [len(cfg.sparse_layers), B, T, E] (empty [0, B, T, 0] for a dense model), the input of
    `moe.load_balancing_loss`. experts: None routes every token to its own top-k experts; integer
    [B, T, len(cfg.sparse_layers), k] (ids in [0, E), e.g. a rollout's record) replays them:
    sparse layer j runs token (b, t) on experts[b, t, j] with the router's own probabilities there
    (`moe.route`); the router logits returned are the router's own either way. head=False returns
    the last layer's output [B, T, H] in the compute dtype, before the final norm, in place of the
    logits (`logits_from_hidden` maps it to them): the trainer applies the head to the response
    positions alone, in chunks.
    compute_dtype: the dtype the forward computes in (None: the params'). The params keep theirs
    (a float32 master copy, which gradients reach); each layer's weights are cast inside its
    (rematerialised) layer function, the embedding rows after the lookup and the head where it is
    applied. So no cast copy of the whole model exists: with remat a layer's saved input is its
    master weights, already alive, not a compute-dtype copy of every layer held from the forward
    to the backward pass."""
    _check_hidden_layers(cfg, hidden_layers)
    b, t = tokens.shape
    _check_experts(cfg, experts, (b, t))
    mask = jnp.ones((b, t), bool) if mask is None else mask.astype(bool)
    if positions is None:
        positions = _default_positions(mask, segment_ids)
    causal = jnp.tril(jnp.ones((t, t), bool))[None]
    attn_mask = causal & mask[:, None, :]
    if segment_ids is not None:
        attn_mask = attn_mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    cos, sin = rope_tables(cfg, positions)

    dtype = params["embed"].dtype if compute_dtype is None else jnp.dtype(compute_dtype)
    use_cudnn = use_cudnn_attention(attention_impl, dtype, cfg.head_dim, t)
    packed = use_cudnn and segment_ids is not None and packed_layout_here(t, on_mesh=on_devices(sharding))
    if packed:
        check_segment_cap(segment_ids)
    lengths = mask.sum(axis=-1).astype(jnp.int32)
    # Elsewhere flash attention takes packed segments as a [B, 1, T, T] mask (an additive bias shared by heads).
    same_segment = None
    if segment_ids is not None and not packed:
        same_segment = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]

    def layer_fn(layer, x, layer_experts):
        layer = jax.tree.map(lambda w: w.astype(dtype), layer)
        q, k, v = qkv(cfg, layer, rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps), cos, sin)
        if packed:  # each sequence's own causal blocks only
            attn = packed_attention(q, k, v, segment_ids)
        elif use_cudnn:  # flash attention; right padding expressed as per-row key lengths
            attn = jax.nn.dot_product_attention(
                q, k, v, mask=same_segment, is_causal=True, key_value_seq_lengths=lengths, implementation="cudnn"
            )
        else:
            attn = attention(q, k, v, attn_mask)
        x, router_logits, _ = attn_out_and_mlp(cfg, layer, x, attn, moe_impl, sharding, layer_experts)
        return constrain(sharding, x, ("batch", "seq", "act_embed")), router_logits

    if remat:
        layer_fn = jax.checkpoint(layer_fn)
    x = constrain(sharding, embed(params, tokens).astype(dtype), ("batch", "seq", "act_embed"))
    hidden, routers = {}, []
    for i, layer in enumerate(params["layers"]):
        layer_experts = None
        if experts is not None and "router" in layer:
            layer_experts = constrain(sharding, experts[:, :, len(routers)], ("batch", "seq", None))
        x, router_logits = layer_fn(layer, x, layer_experts)
        if router_logits is not None:
            routers.append(router_logits)
        if i in hidden_layers:
            hidden[i] = x
    routers = jnp.stack(routers) if routers else jnp.zeros((0, b, t, 0), jnp.float32)
    if not head:
        return x, _stack_hidden(hidden, hidden_layers, x), routers
    logits = logits_from_hidden(cfg, head_params(params, dtype), x)
    logits = constrain(sharding, logits, ("batch", "seq", "vocab"))
    return logits, _stack_hidden(hidden, hidden_layers, x), routers


def forward(cfg: ModelConfig, params: Params, tokens: jax.Array, **kwargs) -> jax.Array:
    """int32 tokens [B, T] -> float32 logits [B, T, V]. Keyword args as `forward_hidden`."""
    return forward_hidden(cfg, params, tokens, (), **kwargs)[0]


# ----------------------------------------------------------------------------- cached extension


def extend(
    cfg: ModelConfig,
    params: Params,
    cache: KVCache,
    tokens: jax.Array,
    positions: jax.Array,
    cache_len: jax.Array,
    *,
    tree_mask: jax.Array | None = None,
    active: jax.Array | None = None,
    hidden_layers: tuple[int, ...] = (),
    sharding: Sharding | None = None,
    record_experts: bool = False,
):
    """Append T new tokens per row to the cache and run them through the model.

    cache: a dense `KVCache`, or a `PagedKVCache` whose slot b is row b (`jaxspec.models.paged`;
    the same semantics, positions in place of slots, returned with the same page table).
    tokens int32 [B, T]; positions int32 [B, T] (rope positions); cache_len int32 [B]: row b's
    valid prefix occupies slots [0, cache_len[b]) and the new tokens are written to slots
    cache_len[b] + t. tree_mask bool [B, T, T] says which new tokens each new token sees
    (default causal); every new token sees the whole valid prefix. active bool [B]: rows still
    generating (default all); the others see only their new tokens and their outputs are
    meaningless, but their cache is not read (`cache_attention`).
    Returns (float32 logits [B, T, V], hidden [len(hidden_layers), B, T, H], updated cache), and
    with record_experts a fourth output: the experts each new token's sparse layers ran it on,
    [B, T, len(cfg.sparse_layers), k] in `moe.expert_id_dtype(E)` (the top-k in descending
    probability, as `moe.route` picks them).
    Slots past cache_len[b] + T are neither read nor written.
    """
    _check_hidden_layers(cfg, hidden_layers)
    b, t = tokens.shape
    slots = cache_len[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    rows = jnp.arange(b)[:, None]
    cos, sin = rope_tables(cfg, positions)

    x = constrain(sharding, embed(params, tokens), ("batch", "seq", "act_embed"))
    new_k, new_v, hidden, experts = [], [], {}, []
    is_paged = isinstance(cache, PagedKVCache)
    page_table = cache.page_table if is_paged else None  # the prologue's: a dense row is one page

    def attend(i, layer, h):
        """Layer i's attention of the new tokens from its normed input h, and its new k and v cache (or pools)."""
        impl = prologue_impl(cfg, layer, h, cache.k[i], cache.v[i], is_paged, sharding)
        if impl != "xla":  # one kernel from the projection to the attention kernel's query rows
            k, v = cache.k[i], cache.v[i]
            return layer_attention(
                cfg, layer, h, cos, sin, k, v, page_table, cache_len, tree_mask, active, impl=impl, sharding=sharding
            )
        q, k, v = qkv(cfg, layer, h, cos, sin, impl="auto", sharding=sharding)
        if is_paged:
            return write_and_attend(cache, i, q, k, v, cache_len, tree_mask, active, sharding)
        with jax.named_scope("kv_write"):
            ck = cache.k[i].at[rows, slots].set(k.astype(cache.k[i].dtype), mode="drop")
            cv = cache.v[i].at[rows, slots].set(v.astype(cache.v[i].dtype), mode="drop")
        return cache_attention(q, ck, cv, cache_len, tree_mask, active=active, sharding=sharding), ck, cv

    def add_and_norm(x, delta, weight):
        """The residual stream x + delta (delta None: x) and its norm by `weight`, laid out as x."""
        x, h = residual_norm(x, delta, weight, cfg.rms_norm_eps, sharding)
        return constrain(sharding, x, ("batch", "seq", "act_embed")), h

    # A sublayer's output is added to the residual stream together with the next norm (one kernel
    # where `residual_norm` runs it), so layer i's output x is complete at layer i + 1's first norm.
    delta = None
    for i, layer in enumerate(params["layers"]):
        x, h = add_and_norm(x, delta, layer["attn_norm"])
        if i - 1 in hidden_layers:
            hidden[i - 1] = x
        attn, ck, cv = attend(i, layer, h)
        x, h = add_and_norm(x, attention_output(layer, attn, impl="auto", sharding=sharding), layer["mlp_norm"])
        # no gradient: the kernels where they apply
        delta, _, layer_experts = mlp(cfg, layer, h, "auto", sharding, matmul_impl="auto")
        if record_experts and layer_experts is not None:
            experts.append(layer_experts.astype(expert_id_dtype(cfg.num_experts)))
        new_k.append(ck)
        new_v.append(cv)
    x, h = add_and_norm(x, delta, params["final_norm"])
    if cfg.num_layers - 1 in hidden_layers:
        hidden[cfg.num_layers - 1] = x
    logits = logits_from_normed(cfg, params, h, impl="auto", sharding=sharding)
    out = logits, _stack_hidden(hidden, hidden_layers, x), cache._replace(k=tuple(new_k), v=tuple(new_v))
    if not record_experts:
        return out
    if not experts:
        raise ValueError("record_experts: the policy is dense (no mixture-of-experts layers)")
    return *out, jnp.stack(experts, axis=2)


def _check_experts(cfg: ModelConfig, experts: jax.Array | None, rows: tuple[int, int]) -> None:
    """ValueError unless `experts` (replayed routing) is None or [B, T, len(cfg.sparse_layers), k] integers."""
    if experts is None:
        return
    want = (*rows, len(cfg.sparse_layers), cfg.num_experts_per_tok)
    if not cfg.sparse_layers:
        raise ValueError("experts: the policy is dense (no mixture-of-experts layers to replay routing in)")
    if tuple(experts.shape) != want or not jnp.issubdtype(experts.dtype, jnp.integer):
        raise ValueError(
            f"experts must be integer [B, T, sparse layers, top_k] = {list(want)}, got "
            f"{experts.dtype} {list(experts.shape)}"
        )


def _check_hidden_layers(cfg: ModelConfig, hidden_layers: tuple[int, ...]) -> None:
    for i in hidden_layers:
        if not 0 <= i < cfg.num_layers:
            raise ValueError(f"hidden layer id {i} outside [0, {cfg.num_layers})")


def _stack_hidden(hidden: dict[int, jax.Array], hidden_layers: tuple[int, ...], x: jax.Array) -> jax.Array:
    """Layer outputs in the requested order (ids may repeat) -> [len(hidden_layers), B, T, H]."""
    if not hidden_layers:
        return jnp.zeros((0, *x.shape), x.dtype)
    return jnp.stack([hidden[i] for i in hidden_layers])
