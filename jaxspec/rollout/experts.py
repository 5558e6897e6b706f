"""The experts a mixture-of-experts policy routed each rollout token to, recorded for routing replay (R3).

With `generate(..., record_experts=True)` the rollout keeps, for every row, position and sparse
layer, the top-k experts the policy's router chose when it computed that position's hidden state:
prompt positions in the prefill, response positions in the decode step or the speculative
verification forward that wrote their KV (for a verified tree, the accepted path's nodes, moved to
the consecutive positions their KV moves to). The slot engine records the same, in its prefill
chunks and decode steps (`SlotExperts`). The trainer replays them
(`jaxspec.models.forward_router(..., experts=...)`), so that it computes its log-probs with the
experts the rollout sampled with.

The record is [B, S, L_sparse, k] in `moe.expert_id_dtype(E)` (uint8 up to 256 experts), indexed by
the position in the row's own sequence, as the KV cache's slots are: a row with a prompt of p tokens
has its prompt at [0, p) and response token j at p + j. Positions the rollout never ran through the
policy (the prompt bucket's padding, the last emitted token, anything past it) hold unspecified
expert ids in [0, E).
"""

from __future__ import annotations

from typing import NamedTuple

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


class SlotExperts(NamedTuple):
    """The slot engine's record (`jaxspec.rollout.slots`), of one group: rows [B, P + N, L_sparse,
    k] each row's positions as the record above, written where the row ran them through the policy
    (its prefill chunks, re-run after a preemption, and its decode steps); prompts [U, P, L_sparse,
    k] each distinct prompt's positions, written by whichever row prefilled them, so that a row
    that took its prompt's prefix pages from the prefix cache (and never ran those positions
    itself) finds their experts there."""

    rows: jax.Array
    prompts: jax.Array

    @classmethod
    def create(cls, cfg: ModelConfig, rows: int, num_prompts: int, prompt_width: int, positions: int) -> SlotExperts:
        shape = (len(cfg.sparse_layers), cfg.num_experts_per_tok)
        dtype = expert_id_dtype(cfg.num_experts)
        return cls(
            rows=jnp.zeros((rows, positions, *shape), dtype),
            prompts=jnp.zeros((num_prompts, prompt_width, *shape), dtype),
        )

    def write(
        self,
        row: jax.Array,
        prompt: jax.Array,
        prompt_len: jax.Array,
        experts: jax.Array,
        start: jax.Array,
        written: jax.Array,
    ) -> SlotExperts:
        """The record with experts [R, T, L_sparse, k] at positions start[r] + t (start int32 [R])
        of row row[r] where written bool [R, T] is set, and, at positions below prompt_len[r],
        of distinct prompt prompt[r] (row, prompt, prompt_len int32 [R])."""
        positions = start[:, None] + jnp.arange(experts.shape[1], dtype=jnp.int32)[None, :]
        experts = experts.astype(self.rows.dtype)
        at_row = jnp.where(written, positions, self.rows.shape[1])
        at_prompt = jnp.where(written & (positions < prompt_len[:, None]), positions, self.prompts.shape[1])
        return SlotExperts(
            rows=self.rows.at[row[:, None], at_row].set(experts, mode="drop"),
            prompts=self.prompts.at[prompt[:, None], at_prompt].set(experts, mode="drop"),
        )

    def output(self, row_prompt: jax.Array, row_lengths: jax.Array) -> jax.Array:
        """[B, P + N, L_sparse, k]: each row's prompt positions (row_lengths int32 [B]) from its
        distinct prompt's (row_prompt int32 [B]) record, the rest from its own."""
        width = self.prompts.shape[1]
        prompt = jnp.pad(self.prompts[row_prompt], ((0, 0), (0, self.rows.shape[1] - width), (0, 0), (0, 0)))
        in_prompt = jnp.arange(self.rows.shape[1])[None, :, None, None] < row_lengths[:, None, None, None]
        return jnp.where(in_prompt, prompt, self.rows)
