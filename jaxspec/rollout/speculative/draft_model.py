"""Drafting with a smaller policy that shares the policy's vocabulary.

The draft keeps its own KV cache with the same layout as the policy's: slots [0, cache_len)
hold the committed tokens before the root. `update` only records the tokens a verification
step committed (`Pending`: the accepted drafts, then the new root); the first pass of the next
`propose` writes them at their final slots and reads the root's logits at the last one. Each
further depth of the EAGLE-2 tree runs the draft over the tree built so far (root at slot
cache_len, nodes after it, tree attention mask), so the draft sees exactly the prefix and each
node's ancestors.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.models.blocks import logits_from_hidden
from jaxspec.models.config import ModelConfig
from jaxspec.models.kv_cache import KVCache
from jaxspec.models.sharding import KV_CACHE_AXES, Sharding, constrain
from jaxspec.models.transformer import extend
from jaxspec.rollout.prefill import prefill_prompts
from jaxspec.rollout.sampling import Sampling, processed_logprobs
from jaxspec.rollout.speculative.drafter import Prefill, Verified, new_tokens
from jaxspec.rollout.speculative.tree import DraftTree, dynamic_tree


class Pending(NamedTuple):
    """cache: the draft's KV (slots before the pending tokens valid); tokens int32 [B, E]: the
    tokens not yet in it, `count` int32 [B] of them valid, the last valid one the root."""

    cache: KVCache
    tokens: jax.Array
    count: jax.Array


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    """cfg: the draft model's config; sampling: the rollout's (draft distributions q are the
    draft's logits processed the same way as the policy's); depth/width/num_nodes: the tree
    shape (num_nodes draft nodes per step); stochastic: draw children from q."""

    cfg: ModelConfig
    sampling: Sampling
    depth: int
    width: int
    num_nodes: int
    stochastic: bool
    sharding: Sharding | None = None
    policy_layers: tuple[int, ...] = ()

    @property
    def chunk(self) -> int:
        """Pending tokens `init` keeps: the longest accepted run + 1. `propose` takes any width, so
        loop stages that draft to different depths share the state of the deepest."""
        return min(self.depth, self.num_nodes) + 1

    def init(self, dparams, prefill: Prefill) -> Pending:
        cache, _, _ = prefill_prompts(
            self.cfg,
            dparams,
            prefill.prompt_tokens,
            prefill.prompt_lengths,
            prefill.row_prompt,
            max_len=prefill.max_len,
            cache_dtype=prefill.cache_dtype,
            sharding=self.sharding,
        )
        batch = prefill.first_token.shape[0]
        return Pending(
            cache=cache,
            tokens=jnp.zeros((batch, self.chunk), jnp.int32).at[:, 0].set(prefill.first_token),
            count=jnp.ones((batch,), jnp.int32),
        )

    def propose(
        self, dparams, state: Pending, root: jax.Array, cache_len: jax.Array, active: jax.Array, key: jax.Array
    ) -> tuple[Pending, DraftTree]:
        last_layer = (self.cfg.num_layers - 1,)

        def draft_pass(first, tokens, parents, depth, mask, frontier):
            cache, is_first = first
            if is_first:  # the pending tokens, the last valid one the root at slot cache_len
                start = cache_len - (state.count - 1)
                tokens, mask = state.tokens, None
                positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
            elif self.width == 1:  # a chain: its newest node alone, the nodes before it in the cache
                start = cache_len + tokens.shape[1] - 1
                tokens, positions, mask, frontier = tokens[:, -1:], start[:, None], None, slice(0, 1)
            else:
                start, positions = cache_len, cache_len[:, None] + depth
            _, hidden, cache = extend(
                self.cfg,
                dparams,
                cache,
                tokens,
                positions,
                start,
                tree_mask=mask,
                active=active,
                hidden_layers=last_layer,
                sharding=self.sharding,
            )
            hidden = hidden[0]
            hidden = (
                jnp.take_along_axis(hidden, (state.count - 1)[:, None, None], axis=1)
                if is_first
                else hidden[:, frontier]
            )
            logits = logits_from_hidden(self.cfg, dparams, hidden)
            return (self._constrain(cache), False), logits

        (cache, _), tree = dynamic_tree(
            draft_pass,
            (state.cache, True),
            root,
            key,
            depth=self.depth,
            width=self.width,
            num_nodes=self.num_nodes,
            stochastic=self.stochastic,
            process=lambda logits: processed_logprobs(logits, self.sampling),
        )
        return state._replace(cache=cache), tree

    def update(self, dparams, state: Pending, verified: Verified) -> Pending:
        active = verified.active
        return Pending(
            cache=state.cache,
            tokens=jnp.where(active[:, None], new_tokens(verified), state.tokens),
            count=jnp.where(active, verified.num_accepted + 1, state.count),
        )

    def _constrain(self, cache: KVCache) -> KVCache:
        return jax.tree.map(lambda buf: constrain(self.sharding, buf, KV_CACHE_AXES), cache)
