"""N-gram (prompt-lookup) drafting: propose what followed earlier occurrences of the last n tokens.

The state is each row's token history (prompt, then every committed token, the root last).
For each suffix length n in `sizes` (in order of preference) every earlier position where the
last n tokens occurred is a match; matches are ranked by preferred n, then by recency. The
best match's continuation (up to `depth` committed tokens) is a chain below the root; with
`width` > 1 the next best matches whose first continuation token differs from the chosen ones
become sibling chains. Nodes are kept in that priority order up to `num_nodes`. Everything is
vectorised over rows with static shapes; a row without a match drafts nothing that step.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.rollout.speculative.drafter import Prefill, Verified, new_tokens
from jaxspec.rollout.speculative.tree import DraftTree, select_nodes


class History(NamedTuple):
    """tokens int32 [B, S] (slots past `length` unused); length int32 [B], the root included."""

    tokens: jax.Array
    length: jax.Array


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    sizes: tuple[int, ...]
    depth: int
    width: int
    num_nodes: int
    policy_layers: tuple[int, ...] = ()
    propose_keeps_state = True  # `propose` returns its state as it was (an autoregressive step may skip it)

    def init(self, dparams, prefill: Prefill) -> History:
        prompts = jnp.take(prefill.prompt_tokens, prefill.row_prompt, axis=0)
        tokens = jnp.zeros((prompts.shape[0], prefill.max_len), jnp.int32).at[:, : prompts.shape[1]].set(prompts)
        rows = jnp.arange(prompts.shape[0])
        tokens = tokens.at[rows, prefill.row_lengths].set(prefill.first_token)
        return History(tokens=tokens, length=prefill.row_lengths + 1)

    def propose(
        self, dparams, history: History, root: jax.Array, cache_len: jax.Array, active: jax.Array, key: jax.Array
    ) -> tuple[History, DraftTree]:
        h, length = history.tokens, history.length
        batch, slots = h.shape
        ends = jnp.arange(slots, dtype=jnp.int32)[None, :]  # a match's last position j

        def at(index: jax.Array) -> jax.Array:
            index = jnp.broadcast_to(jnp.clip(index, 0, slots - 1), (batch, index.shape[1]))
            return jnp.take_along_axis(h, index, axis=1)

        priorities = []
        for rank, n in enumerate(self.sizes):
            match = (ends >= n - 1) & (ends <= length[:, None] - 2)
            for i in range(n):
                match &= at(ends - i) == at(length[:, None] - 1 - i)
            priorities.append(jnp.where(match, (len(self.sizes) - rank) * slots + ends, -1))
        priority = jnp.concatenate(priorities, axis=1)  # [B, R * S]
        match_end = jnp.tile(ends, (1, len(self.sizes)))
        first = jnp.tile(at(ends + 1), (1, len(self.sizes)))

        starts, found = [], []
        for _ in range(self.width):
            best = jnp.argmax(priority, axis=1)[:, None]
            found.append(jnp.take_along_axis(priority, best, axis=1)[:, 0] >= 0)
            starts.append(jnp.take_along_axis(match_end, best, axis=1)[:, 0] + 1)
            priority = jnp.where(first == jnp.take_along_axis(first, best, axis=1), -1, priority)
        # Candidate node 1 + b * depth + d: branch b's d-th continuation token.
        offsets = jnp.arange(self.depth, dtype=jnp.int32)[None, :]
        positions = jnp.concatenate([s[:, None] + offsets for s in starts], axis=1)  # [B, W * depth]
        valid = jnp.concatenate(
            [f[:, None] & (s[:, None] + offsets <= length[:, None] - 1) for s, f in zip(starts, found)], axis=1
        )
        valid &= jnp.cumsum(valid, axis=1) <= self.num_nodes
        d = np.tile(np.arange(self.depth), self.width)
        candidate_parents = np.where(d == 0, 0, np.arange(1, 1 + self.width * self.depth) - 1)
        ones = jnp.ones((batch, 1), bool)
        tree = select_nodes(
            keep=jnp.concatenate([ones, valid], axis=1),
            tokens=jnp.concatenate([root[:, None], at(positions)], axis=1),
            parents=jnp.broadcast_to(
                jnp.asarray(np.concatenate([[-1], candidate_parents]), jnp.int32),
                valid.shape[:1] + (valid.shape[1] + 1,),
            ),
            depth=jnp.broadcast_to(
                jnp.asarray(np.concatenate([[0], d + 1]), jnp.int32), valid.shape[:1] + (valid.shape[1] + 1,)
            ),
            num_out=1 + self.num_nodes,
        )
        return history, tree

    def update(self, dparams, history: History, verified: Verified) -> History:
        batch, width = verified.committed.shape
        rows = jnp.arange(batch)[:, None]
        steps = jnp.arange(width, dtype=jnp.int32)[None, :]
        accepted = verified.num_accepted[:, None]
        new = new_tokens(verified)
        write = verified.active[:, None] & (steps <= accepted)
        slots = jnp.where(write, history.length[:, None] + steps, history.tokens.shape[1])
        return History(
            tokens=history.tokens.at[rows, slots].set(new, mode="drop"),
            length=history.length + jnp.where(verified.active, verified.num_accepted + 1, 0),
        )
