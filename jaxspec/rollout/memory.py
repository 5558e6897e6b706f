"""Device memory a rollout needs, checked before anything is allocated."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxspec.models.config import ModelConfig
from jaxspec.models.transformer import cache_bytes
from jaxspec.rollout.prompts import count_bucket, prompt_bucket

_F32 = 4

# Most distinct prompts the prefill runs through the model at once; bounds its activations.
PREFILL_CHUNK = 32


def prefill_chunks(num_prompts: int) -> tuple[int, int]:
    """(prompts per chunk, number of chunks) for prefilling `num_prompts` distinct prompts.

    One chunk of all the prompts when they fit in `PREFILL_CHUNK`; otherwise chunks of
    `PREFILL_CHUNK`, the last one completed with filler prompts.
    """
    chunk = min(PREFILL_CHUNK, num_prompts)
    return chunk, -(-num_prompts // chunk)


def rollout_memory_bytes(
    cfg: ModelConfig,
    batch: int,
    prompt_len: int,
    max_new_tokens: int,
    cache_dtype=jnp.float32,
    num_distinct: int | None = None,
    stage_rows: int = 0,
) -> int:
    """Bytes of device memory a rollout allocates beyond the params (after shape bucketing).

    batch: rows B; prompt_len: longest prompt (padded to its bucket P); max_new_tokens: N;
    num_distinct: distinct prompts prefilled (None = batch, the worst case), bucketed to U and
    prefilled in chunks of C = min(U, PREFILL_CHUNK) prompts, U padded to a multiple of C.
    The peak is the larger of
      * prefill: the distinct-prompt cache [U, P], the batch cache [B, P + N], and one chunk's
        float32 activations (attention scores and probabilities [C, Nq, P, P], MLP [C, P, 2F],
        residual stream [C, P, H]);
      * decode: the batch cache [B, P + N] and the caches of the smaller batches the loop moves
        into as rows finish (`stage_rows` rows in all, `jaxspec.rollout.stages`), plus per-step
        float32 buffers: four [B, V] (logits,
        processed log-probs, sort and sampling temporaries), attention scores and probabilities
        [B, Nq, P + N], MLP [B, 2F], and the outputs tokens/log-probs [B, N].
    """
    if batch < 1 or prompt_len < 1 or max_new_tokens < 1:
        raise ValueError(f"batch={batch}, prompt_len={prompt_len} and max_new_tokens={max_new_tokens} must all be >= 1")
    p = prompt_bucket(prompt_len)
    s = p + max_new_tokens
    chunk, num_chunks = prefill_chunks(count_bucket(batch if num_distinct is None else num_distinct, batch))
    batch_cache = cache_bytes(cfg, batch, s, cache_dtype)
    prefill = (
        cache_bytes(cfg, chunk * num_chunks, p, cache_dtype)
        + batch_cache
        + _F32 * chunk * p * (2 * cfg.num_heads * p + 2 * cfg.intermediate_size + cfg.hidden_size)
    )
    decode = (
        batch_cache
        + cache_bytes(cfg, stage_rows, s, cache_dtype)
        + _F32 * batch * (4 * cfg.vocab_size + 2 * cfg.num_heads * s + 2 * cfg.intermediate_size)
        + 2 * _F32 * batch * max_new_tokens
    )
    return max(prefill, decode)


def device_free_bytes(memory_stats: dict | None) -> tuple[int, int] | None:
    """(bytes free, bytes_limit) of a device's `memory_stats()` dict; None when it is None or has no
    "bytes_limit" (CPU backends), where nothing can be checked."""
    if not memory_stats or "bytes_limit" not in memory_stats:
        return None
    limit = int(memory_stats["bytes_limit"])
    return limit - int(memory_stats.get("bytes_in_use", 0)), limit


def check_fits(needed: int, memory_stats: dict | None, *, batch: int, prompt_len: int, max_new_tokens: int) -> None:
    """Raises ValueError when `needed` bytes exceed what a device reports free (`device_free_bytes`)."""
    free_limit = device_free_bytes(memory_stats)
    if free_limit is not None and needed > free_limit[0]:
        free, limit = free_limit
        raise ValueError(
            f"rollout with batch={batch}, prompt length={prompt_len} (bucket {prompt_bucket(prompt_len)}), "
            f"max_new_tokens={max_new_tokens} needs {needed} bytes per device, but the device has only "
            f"{free} bytes free (bytes_limit {limit}); lower the batch, prompt length or max_new_tokens"
        )


def weights_bytes_per_device(params, shardings, dtype) -> int:
    """Bytes one device holds of `params` (arrays or ShapeDtypeStructs) laid out by `shardings` (a
    pytree of NamedShardings like it), with the floating leaves in `dtype` (the others keep
    theirs): e.g. a rollout copy of the policy. Replicated dimensions count in full, so a copy
    gathered over the batch axes (rollout.gather_weights) counts the whole policy / tensor."""
    leaves, treedef = jax.tree.flatten(params)
    total = 0
    for x, sharding in zip(leaves, treedef.flatten_up_to(shardings)):
        itemsize = jnp.dtype(dtype).itemsize if jnp.issubdtype(x.dtype, jnp.floating) else jnp.dtype(x.dtype).itemsize
        total += math.prod(sharding.shard_shape(tuple(x.shape))) * itemsize
    return total


def check_weights_fit(needed: int, memory_stats: dict | None, what: str) -> None:
    """Raises ValueError naming `what` (the boolean config key that asks for the copy) when a weights
    copy of `needed` bytes per device exceeds what a device reports free (`device_free_bytes`)."""
    free_limit = device_free_bytes(memory_stats)
    if free_limit is not None and needed > free_limit[0]:
        free, limit = free_limit
        raise ValueError(
            f"{what}: the rollout copy of the policy needs {needed / 1e9:.2f} GB per device, but the "
            f"device has only {free / 1e9:.2f} GB free (bytes_limit {limit / 1e9:.2f} GB); set {what}: false"
        )
