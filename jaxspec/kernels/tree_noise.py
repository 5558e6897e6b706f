"""Counter-based Gumbel noise shared by the tree-verification kernel and its jnp reference.

Each (row b, node n) gets hashed seeds from the key, and each token or vocabulary tile its own
uniform from a hash of (seed, index), so the Triton kernels regenerate exactly the noise the
reference uses, one tile at a time, without a PRNG state. All arithmetic is int32 with wrap-around
multiplication and logical shifts, which the Triton kernels write out in unsigned 32-bit words
(their right shifts are then logical): the same bits in XLA and in Triton.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_GOLDEN = -1640531535  # 0x9E3779B1 as int32


def _int32(c: int) -> jnp.int32:
    return jnp.int32(c - (1 << 32) if c >= 1 << 31 else c)


def triple32(x: jax.Array) -> jax.Array:
    """The `triple32` integer hash (a bijection of 32-bit words with strong avalanche); int32 -> int32."""
    x = x ^ lax.shift_right_logical(x, jnp.int32(17))
    x = x * _int32(0xED5AD4BB)
    x = x ^ lax.shift_right_logical(x, jnp.int32(11))
    x = x * _int32(0xAC4C1B51)
    x = x ^ lax.shift_right_logical(x, jnp.int32(15))
    x = x * _int32(0x31848BAB)
    x = x ^ lax.shift_right_logical(x, jnp.int32(14))
    return x


def _key_words(key: jax.Array) -> jax.Array:
    """The key's raw words as int32 [k] (typed keys and legacy uint32 keys alike)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return lax.bitcast_convert_type(jnp.ravel(key).astype(jnp.uint32), jnp.int32)


def node_hashes(key: jax.Array, batch: int, num_nodes: int, streams: int) -> jax.Array:
    """int32 [streams, batch, num_nodes]: independent hashed words per (stream, row, node) from a key.

    The key's words are hashed directly (no PRNG program to compile), then each (row, node)
    counter is hashed twice under per-stream seeds.
    """
    words = _key_words(key)
    h = jnp.int32(0x243F6A88)
    for i in range(words.shape[0]):
        h = triple32(h ^ words[i])
    odd = jnp.arange(1, 2 * streams, 2, dtype=jnp.int32)[:, None, None] * jnp.int32(_GOLDEN)
    first, second = triple32(h + odd), triple32(h + odd + jnp.int32(_GOLDEN))
    counter = jnp.arange(batch * num_nodes, dtype=jnp.int32).reshape(1, batch, num_nodes)
    return triple32(triple32(counter ^ first) + second)


def uniform_from_bits(bits: jax.Array) -> jax.Array:
    """float32 in [0, 1) from the top 24 bits of int32 words."""
    return lax.shift_right_logical(bits, jnp.int32(8)).astype(jnp.float32) * (1.0 / (1 << 24))


LOG2E = 1.4426950408889634  # race scores are kept in log2 units: cheaper exp2/log2 on GPUs


def race_noise(seed: jax.Array, token: jax.Array, log2=jnp.log2) -> jax.Array:
    """float32 Gumbel noise in log2 units for token ids `token` (int32) under `seed` (int32, broadcast).

    Returns -log2(-log2(u)) = log2(e) * G - log2(log2(e)) for a standard Gumbel G, so
    argmax(LOG2E * x + noise) is a Gumbel-max sample from softmax(x). The uniform u has 24 random
    bits, centred in its bin so it is strictly inside (0, 1). `log2` is replaceable so a GPU kernel
    can use the hardware approximation.
    """
    u = uniform_from_bits(triple32((token * jnp.int32(_GOLDEN)) ^ seed)) + 0.5 / (1 << 24)
    return -log2(-log2(u))
