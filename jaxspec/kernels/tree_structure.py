"""Index helpers for draft trees given as parent arrays (node 0 is the root, parents[b, n] < n)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_structure(parents: jax.Array, num_nodes: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(is_child bool [B, N], parent int32 [B, N], child_of bool [B, N, N]).

    is_child: node is a valid draft node (0 < n < num_nodes). parent: its parent, 0 where not a
    child (a safe gather index). child_of[b, n, m]: node m is a valid child of node n.
    """
    idx = jnp.arange(parents.shape[1], dtype=jnp.int32)
    is_child = (idx[None, :] < num_nodes[:, None]) & (idx[None, :] > 0)
    parent = jnp.where(is_child, parents, 0)
    child_of = is_child[:, None, :] & (parent[:, None, :] == idx[None, :, None])
    return is_child, parent, child_of


def child_token_mask(parents, draft_tokens, num_nodes, vocab: int) -> jax.Array:
    """bool [B, N, V]: token v is the token of a valid child of node n."""
    batch, n = parents.shape
    is_child, parent, _ = tree_structure(parents, num_nodes)
    rows = jnp.where(is_child, parent, n)  # out of range for non-children: dropped
    mask = jnp.zeros((batch, n, vocab), bool)
    return mask.at[jnp.arange(batch)[:, None], rows, draft_tokens].set(True, mode="drop")


def child_tile_mask(parents, draft_tokens, num_nodes, tile_start, tile: int) -> jax.Array:
    """bool [B, N, tile]: token tile_start[b, n] + i is the token of a valid child of node n."""
    batch, n = parents.shape
    is_child, parent, _ = tree_structure(parents, num_nodes)
    offset = draft_tokens - jnp.take_along_axis(tile_start, parent, axis=1)
    offset = jnp.where(is_child & (offset >= 0) & (offset < tile), offset, tile)  # tile: dropped
    mask = jnp.zeros((batch, n, tile), bool)
    return mask.at[jnp.arange(batch)[:, None], parent, offset].set(True, mode="drop")


def children_lists(parents, draft_tokens, num_nodes) -> tuple[jax.Array, jax.Array]:
    """(tokens int32 [B, N, N], count int32 [B, N]): each node's children's tokens first, in node order."""
    _, _, child_of = tree_structure(parents, num_nodes)
    order = jnp.argsort(~child_of, axis=-1, stable=True)
    tokens = jnp.take_along_axis(jnp.broadcast_to(draft_tokens[:, None, :], child_of.shape), order, axis=-1)
    return tokens, jnp.sum(child_of, axis=-1, dtype=jnp.int32)
