"""The residual / bonus sample of a node as a two-level Gumbel race over vocabulary tiles.

A flat Gumbel-max race over V tokens needs a hash and two logs per token, which makes a
vocabulary-streaming kernel compute-bound. Max-stability of the Gumbel distribution gives the
same law for much less: the maximum of x_v + G_v over a tile is distributed as
log(sum over the tile of e^{x_v}) + G, and which token attains it is independent of its value.
So a node's sample is drawn in two steps:

1. tile race: each tile t (tokens [t * tile, (t + 1) * tile)) scores log(M_t) + G_t, where M_t is
   the tile's mass of candidate tokens (not children of the node, p > 0) and G_t is Gumbel noise
   from the node's tile seed; the highest score wins (first on ties). Only per-tile sums are
   needed, which the streaming pass computes anyway for the normaliser.
2. token race: inside the winning tile a flat race over the candidates, with per-token noise from
   the node's token seed (one tile of logits per node is read again).

P(v) = M_t / sum(M) * e^{x_v} / M_t = e^{x_v} / sum(M): exactly the residual distribution.
Greedy verification uses the same two steps without noise (tile maxima, then the argmax inside
the winning tile: the first global argmax). Scores are in log2 units (LOG2E * x + log2-noise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.kernels.tree_noise import LOG2E, race_noise
from jaxspec.kernels.tree_structure import child_tile_mask

RACE_TILE = 2048  # default tile; the law of the sample does not depend on it, the sample does


def race_tile(vocab: int, tile: int) -> int:
    """The tile actually used for a vocabulary: `tile` (a power of 2), capped at next_pow2(V)."""
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of 2, got {tile}")
    return min(tile, next_power_of_2(vocab))


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def tile_scores(tile_max, tile_candidates, tile_ids, tile_seeds, temperature: float) -> jax.Array:
    """float32 race score of each tile (any broadcastable shapes).

    tile_max: max of x = logits * inv_t over the tile. tile_candidates: sum over the tile's
    candidate tokens of exp(x - tile_max) (0 when none). tile_ids: int32 tile index.
    tile_seeds: int32 seed of the node. Greedy: the tile maximum itself.
    """
    if temperature == 0:
        return tile_max
    return tile_max * LOG2E + jnp.log2(tile_candidates) + race_noise(tile_seeds, tile_ids)


def inverse_temperature(temperature: float) -> np.float32:
    """The float32 factor applied to logits: 1 / temperature, or 1 for greedy."""
    return np.float32(1.0 if temperature == 0 else 1.0 / temperature)


def sample_in_tile(
    logits, winner_tile, parents, draft_tokens, num_nodes, token_seeds, temperature: float, tile: int
) -> jax.Array:
    """int32 [B, N]: the token race inside each node's winning tile (int32 [B, N]); logits [B, N, V]."""
    vocab = logits.shape[-1]
    start = winner_tile * tile
    token = start[..., None] + jnp.arange(tile, dtype=jnp.int32)
    inside = token < vocab
    x = jnp.take_along_axis(logits, jnp.minimum(token, vocab - 1), axis=-1).astype(jnp.float32)
    x = x * inverse_temperature(temperature)
    if temperature == 0:
        score = jnp.where(inside, x, -jnp.inf)
    else:
        child = child_tile_mask(parents, draft_tokens, num_nodes, start, tile)
        score = jnp.where(child | ~inside, -jnp.inf, x * LOG2E + race_noise(token_seeds[..., None], token))
    return start + jnp.argmax(score, axis=-1).astype(jnp.int32)
