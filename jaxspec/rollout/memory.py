"""Device memory a rollout needs, checked before anything is allocated (what a device has free, and
what a copy of the weights needs: `jaxspec.models.memory`)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxspec.models.config import ModelConfig
from jaxspec.models.kv_cache import cache_bytes
from jaxspec.models.memory import device_free_bytes
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


def check_fits(
    needed: int,
    memory_stats: dict | None,
    *,
    batch: int,
    prompt_len: int,
    max_new_tokens: int,
    slots: int | None = None,
    kv_pages: int | None = None,
) -> None:
    """Raises ValueError when `needed` bytes exceed what a device reports free (`device_free_bytes`);
    slots, kv_pages: the slot engine's (its message then names them and slots='auto')."""
    free_limit = device_free_bytes(memory_stats)
    if free_limit is not None and needed > free_limit[0]:
        free, limit = free_limit
        engine = "" if slots is None else f" on slots={slots} (kv_pages={kv_pages})"
        advice = (
            "lower the batch, prompt length or max_new_tokens"
            if slots is None
            else "lower slots or kv_pages (slots='auto' picks the most slots that fit), or max_new_tokens"
        )
        raise ValueError(
            f"rollout with batch={batch}, prompt length={prompt_len} (bucket {prompt_bucket(prompt_len)}), "
            f"max_new_tokens={max_new_tokens}{engine} needs {needed} bytes per device, but the device has "
            f"only {free} bytes free (bytes_limit {limit}); {advice}"
        )
