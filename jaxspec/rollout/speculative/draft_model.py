"""Drafting with a smaller policy that shares the policy's vocabulary.

The draft keeps its own KV cache with the same layout as the policy's: slots [0, cache_len)
hold the committed tokens before the root. Each depth of the EAGLE-2 tree runs the draft over
the tree built so far (root at slot cache_len, nodes after it, tree attention mask), so the
draft sees exactly the prefix and each node's ancestors; after verification the committed
tokens are written at their final slots.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.models.config import ModelConfig
from jaxspec.models.sharding import KV_CACHE_AXES, Sharding
from jaxspec.models.transformer import KVCache, extend, logits_from_hidden
from jaxspec.rollout.engine import _prefill
from jaxspec.rollout.sampling import Sampling, processed_logprobs
from jaxspec.rollout.speculative.drafter import Prefill, Verified
from jaxspec.rollout.speculative.tree import DraftTree, dynamic_tree


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

    def init(self, dparams, prefill: Prefill) -> KVCache:
        cache, _, _ = _prefill(self.cfg, dparams, prefill.prompt_tokens, prefill.prompt_lengths, prefill.row_prompt,
                            max_len=prefill.max_len, cache_dtype=prefill.cache_dtype, sharding=self.sharding)
        return cache

    def propose(self, dparams, cache: KVCache, root: jax.Array, cache_len: jax.Array, key: jax.Array
                ) -> tuple[KVCache, DraftTree]:
        last_layer = (self.cfg.num_layers - 1,)

        def draft_pass(cache, tokens, parents, depth, mask, frontier):
            _, hidden, cache = extend(self.cfg, dparams, cache, tokens, cache_len[:, None] + depth, cache_len,
                                      tree_mask=mask, hidden_layers=last_layer, sharding=self.sharding)
            logits = logits_from_hidden(self.cfg, dparams, hidden[0][:, frontier])
            return self._constrain(cache), processed_logprobs(logits, self.sampling)

        return dynamic_tree(draft_pass, cache, root, key, depth=self.depth, width=self.width,
                            num_nodes=self.num_nodes, stochastic=self.stochastic)

    def update(self, dparams, cache: KVCache, verified: Verified) -> KVCache:
        width = verified.committed.shape[1]
        positions = verified.cache_len[:, None] + jnp.arange(width, dtype=jnp.int32)
        # Only the cache is used: the logits are dead code under jit.
        _, _, cache = extend(self.cfg, dparams, cache, verified.committed, positions, verified.cache_len,
                             sharding=self.sharding)
        return self._constrain(cache)

    def _constrain(self, cache: KVCache) -> KVCache:
        if self.sharding is None:
            return cache
        return jax.tree.map(lambda buf: self.sharding.constrain(buf, KV_CACHE_AXES), cache)
