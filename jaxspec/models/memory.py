"""Device memory of a model's weights and what a device reports free, checked before a copy is
allocated."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def device_free_bytes(memory_stats: dict | None) -> tuple[int, int] | None:
    """(bytes free, bytes_limit) of a device's `memory_stats()` dict; None when it is None or has no
    "bytes_limit" (CPU backends), where nothing can be checked."""
    if not memory_stats or "bytes_limit" not in memory_stats:
        return None
    limit = int(memory_stats["bytes_limit"])
    return limit - int(memory_stats.get("bytes_in_use", 0)), limit


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
