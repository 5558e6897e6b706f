"""The dense KV cache `extend` appends to: per-layer buffers with a slot per position of each row
(the paged one: `jaxspec.models.paged`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.models.config import ModelConfig


class KVCache(NamedTuple):
    """Per-layer key/value buffers, each [B, S, Nk, D]; slot s of row b holds position s."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)))


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> int:
    """Bytes of a KVCache of this shape."""
    per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize
    return batch * max_len * per_slot
