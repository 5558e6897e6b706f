"""The prefill of a rollout: each distinct prompt once, its KV laid out for every batch row that
carries it. Shared by the autoregressive loop (`jaxspec.rollout.engine`) and the speculative
drafters (`jaxspec.rollout.speculative`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.models.blocks import logits_from_hidden
from jaxspec.models.config import ModelConfig
from jaxspec.models.kv_cache import KVCache, init_cache
from jaxspec.models.params import Params
from jaxspec.models.sharding import KV_CACHE_AXES, Sharding, constrain
from jaxspec.models.transformer import extend
from jaxspec.rollout.experts import EXPERT_AXES
from jaxspec.rollout.memory import prefill_chunks


def cache_shards(cfg: ModelConfig, sharding: Sharding | None, batch: int, max_len: int) -> int:
    """Number of devices the batch KV cache is split over."""
    if sharding is None:
        return 1
    spec = sharding.spec(KV_CACHE_AXES, (batch, max_len, cfg.num_kv_heads, cfg.head_dim))
    shards = 1
    for part in spec:
        for axis in part if isinstance(part, tuple) else (part,):
            if axis is not None:
                shards *= sharding.mesh.shape[axis]
    return shards


@functools.partial(
    jax.jit, static_argnames=("cfg", "max_len", "cache_dtype", "sharding", "hidden_layers", "record_experts")
)
def prefill_prompts(
    cfg: ModelConfig,
    params: Params,
    prompt_tokens: jax.Array,
    prompt_lengths: jax.Array,
    row_prompt: jax.Array,
    *,
    max_len: int,
    cache_dtype,
    sharding: Sharding | None,
    hidden_layers: tuple[int, ...] = (),
    record_experts: bool = False,
):
    """Runs the distinct prompts and lays their KV out per batch row.

    prompt_tokens int32 [U, P] right-padded; prompt_lengths int32 [U]; row_prompt int32 [B].
    Returns (cache with B rows of max_len slots, slots [0, P) filled; float32 next-token logits
    [B, V] at each row's last prompt token; the outputs of `hidden_layers` over the distinct
    prompts [len(hidden_layers), U, P, H]), and with record_experts a fourth output: the experts
    each row's prompt positions were routed to, [B, P, L_sparse, k] (`jaxspec.rollout.experts`).
    Padding never influences real tokens (causal mask), and slots past a row's prompt length are
    overwritten before they are ever attended to.
    The prompts go through the model in chunks (`prefill_chunks`) one after another, so only one
    chunk's activations are live at a time.
    """
    num_prompts, width = prompt_tokens.shape
    chunk, num_chunks = prefill_chunks(num_prompts)
    filler = chunk * num_chunks - num_prompts  # prompts of one token 0 that no row reads
    tokens = jnp.pad(prompt_tokens, ((0, filler), (0, 0)))
    lengths = jnp.pad(prompt_lengths, (0, filler), constant_values=1)
    # Chunk j holds prompts j, j + num_chunks, j + 2 * num_chunks, ...: a batch-sharded [U] then
    # splits into chunks spread over the same devices, with no data moved between them.
    chunks = (jnp.moveaxis(tokens.reshape(chunk, num_chunks, width), 1, 0), lengths.reshape(chunk, num_chunks).T)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (chunk, width))

    def run_chunk(inputs: tuple[jax.Array, jax.Array]):
        chunk_tokens, chunk_lengths = inputs  # [C, P], [C]
        cache = init_cache(cfg, chunk, width, cache_dtype)
        # Only the last layer's output is used: the full [C, P, V] logits are dead code under jit.
        _, hidden, cache, *experts = extend(
            cfg,
            params,
            cache,
            chunk_tokens,
            positions,
            jnp.zeros((chunk,), jnp.int32),
            hidden_layers=(*hidden_layers, cfg.num_layers - 1),
            sharding=sharding,
            record_experts=record_experts,
        )
        last = jnp.take_along_axis(hidden[-1], (chunk_lengths - 1)[:, None, None], axis=1)  # [C, 1, H]
        return cache, logits_from_hidden(cfg, params, last)[:, 0], hidden[:-1], experts

    # cache leaves [num_chunks, C, P, Nk, D], logits [num_chunks, C, V], hidden [num_chunks, n, C, P, H],
    # experts: [] or [[num_chunks, C, P, L_sparse, k]]
    cache, logits, hidden, experts = jax.lax.map(run_chunk, chunks)
    row_chunk, row_slot = row_prompt % num_chunks, row_prompt // num_chunks

    def to_rows(buf: jax.Array) -> jax.Array:  # [num_chunks, C, P, Nk, D] -> [B, max_len, Nk, D]
        rows = buf[row_chunk, row_slot]
        rows = jnp.pad(rows, ((0, 0), (0, max_len - width), (0, 0), (0, 0)))
        return constrain(sharding, rows, KV_CACHE_AXES)

    cache = KVCache(k=tuple(map(to_rows, cache.k)), v=tuple(map(to_rows, cache.v)))
    hidden = jnp.moveaxis(hidden, 0, 2).reshape(len(hidden_layers), chunk * num_chunks, width, cfg.hidden_size)
    out = (cache, constrain(sharding, logits[row_chunk, row_slot], ("batch", "vocab")), hidden[:, :num_prompts])
    if not record_experts:
        return out
    return *out, constrain(sharding, experts[0][row_chunk, row_slot], EXPERT_AXES)
