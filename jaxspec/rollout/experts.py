"""The experts a mixture-of-experts policy routed each rollout token to, recorded for routing replay (R3).

With `generate(..., record_experts=True)` the rollout keeps, for every row, position and sparse
layer, the top-k experts the policy's router chose when it computed that position's hidden state:
prompt positions in the prefill, response positions in the decode step or the speculative
verification forward that wrote their KV (for a verified tree, the accepted path's nodes, moved to
the consecutive positions their KV moves to). The trainer replays them
(`jaxspec.models.forward_router(..., experts=...)`), so that it computes its log-probs with the
experts the rollout sampled with.

The record is [B, S, L_sparse, k] in `moe.expert_id_dtype(E)` (uint8 up to 256 experts), indexed by
the position in the row's own sequence, as the KV cache's slots are: a row with a prompt of p tokens
has its prompt at [0, p) and response token j at p + j. Positions the rollout never ran through the
policy (the prompt bucket's padding, the last emitted token, anything past it) hold unspecified
expert ids in [0, E).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.models.config import ModelConfig
from jaxspec.models.moe import expert_id_dtype
from jaxspec.models.sharding import Sharding, constrain

EXPERT_AXES = ("batch", None, None, None)  # [B, positions, sparse layers, k]: rows split like the KV cache's


def recorded_experts_bytes(cfg: ModelConfig, rows: int, positions: int) -> int:
    """Bytes of a record of `rows` rows x `positions` positions (0 for a dense policy)."""
    per_position = len(cfg.sparse_layers) * cfg.num_experts_per_tok
    return rows * positions * per_position * (expert_id_dtype(cfg.num_experts).itemsize if per_position else 0)


def expert_buffer(prompt_experts: jax.Array, positions: int, sharding: Sharding | None) -> jax.Array:
    """The loop's record: prompt_experts [B, P, L_sparse, k] (the prefill's) padded with expert 0 to
    [B, positions, L_sparse, k]."""
    pad = positions - prompt_experts.shape[1]
    return constrain(sharding, jnp.pad(prompt_experts, ((0, 0), (0, pad), (0, 0), (0, 0))), EXPERT_AXES)


def write_experts(
    record: jax.Array, experts: jax.Array, start: jax.Array, written: jax.Array, sharding: Sharding | None
) -> jax.Array:
    """`record` [B, S, L_sparse, k] with experts [B, T, L_sparse, k] written at positions start[b] + t
    (start int32 [B]) where written bool [B, T] is set; positions past S are dropped."""
    rows = jnp.arange(record.shape[0])[:, None]
    positions = start[:, None] + jnp.arange(experts.shape[1], dtype=jnp.int32)[None, :]
    positions = jnp.where(written, positions, record.shape[1])
    return constrain(sharding, record.at[rows, positions].set(experts.astype(record.dtype), mode="drop"), EXPERT_AXES)
