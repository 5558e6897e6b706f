"""Drafting with an EAGLE-3 head over the policy's hidden states (`jaxspec.draft`).

Head entry j (rope position j) pairs the fused policy features of token x_j with token x_{j+1}
and predicts x_{j+2}. With the root x_{L-1} at policy slot cache_len = L - 1, the head's cache
holds entries 0 .. L - 3 (head length cache_len - 1) and the state keeps the fused features of
x_{L-2}, the root's hidden input. Each tree level runs the head over the tree built so far:
the root with those features, every other node with its parent's head output (before the
final norm). After verification the committed tokens' entries are recomputed from the policy's
own features at the accepted nodes.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.draft import DraftConfig, draft_extend, fuse, init_draft_cache, target_ids, to_target_ids
from jaxspec.models.sharding import KV_CACHE_AXES, Sharding
from jaxspec.models.transformer import KVCache
from jaxspec.rollout.sampling import Sampling, processed_logprobs
from jaxspec.rollout.speculative.drafter import Prefill, Verified
from jaxspec.rollout.speculative.tree import DraftTree, dynamic_tree


class HeadState(NamedTuple):
    """cache: the head's KV (slots [0, cache_len - 1) valid); root_hidden [B, H]: fused policy
    features of the token before the root."""

    cache: KVCache
    root_hidden: jax.Array


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter:
    """dcfg: the head's config. dparams passed to the methods: {"head": head params, "embed":
    the policy's token embedding [V, H]}. Other fields as `DraftModelDrafter`."""

    dcfg: DraftConfig
    sampling: Sampling
    depth: int
    width: int
    num_nodes: int
    stochastic: bool
    sharding: Sharding | None = None

    @property
    def policy_layers(self) -> tuple[int, ...]:
        return self.dcfg.aux_layer_ids

    def init(self, dparams, prefill: Prefill) -> HeadState:
        head, embed = dparams["head"], dparams["embed"]
        prompts = prefill.prompt_tokens
        num_prompts, width = prompts.shape
        fused = fuse(self.dcfg, head, prefill.policy_hidden)  # [U, P, H]: features of x_j
        next_tokens = jnp.concatenate([prompts[:, 1:], jnp.zeros((num_prompts, 1), prompts.dtype)], axis=1)
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (num_prompts, width))
        cache = init_draft_cache(self.dcfg, num_prompts, width, prefill.cache_dtype)
        _, _, cache = draft_extend(self.dcfg, head, embed, cache, next_tokens, fused, positions,
                                   jnp.zeros((num_prompts,), jnp.int32))

        def to_rows(buf: jax.Array) -> jax.Array:  # [U, P, Nk, D] -> [B, max_len, Nk, D]
            rows = jnp.take(buf, prefill.row_prompt, axis=0)
            return self._constrain(jnp.pad(rows, ((0, 0), (0, prefill.max_len - width), (0, 0), (0, 0))))

        root_hidden = fused[prefill.row_prompt, prefill.row_lengths - 1]
        return HeadState(cache=KVCache(k=tuple(map(to_rows, cache.k)), v=tuple(map(to_rows, cache.v))),
                         root_hidden=root_hidden)

    def propose(self, dparams, state: HeadState, root: jax.Array, cache_len: jax.Array, key: jax.Array
                ) -> tuple[HeadState, DraftTree]:
        head, embed = dparams["head"], dparams["embed"]
        head_len = cache_len - 1

        def draft_pass(carry, tokens, parents, depth, mask, frontier):
            cache, previous_out = carry
            if previous_out is None:
                hidden_in = state.root_hidden[:, None]
            else:
                parent_out = jnp.take_along_axis(previous_out, jnp.maximum(parents, 0)[:, :, None], axis=1)
                hidden_in = jnp.where((parents < 0)[:, :, None], state.root_hidden[:, None], parent_out)
            logits, out, cache = draft_extend(self.dcfg, head, embed, cache, tokens, hidden_in,
                                              head_len[:, None] + depth, head_len, tree_mask=mask)
            return (self._constrain_cache(cache), out), processed_logprobs(logits[:, frontier], self.sampling)

        ids = target_ids(head)
        (cache, _), tree = dynamic_tree(
            draft_pass, (state.cache, None), root, key, depth=self.depth, width=self.width,
            num_nodes=self.num_nodes, stochastic=self.stochastic,
            to_target=lambda draft_ids: to_target_ids(head, draft_ids),
            probs_to_target=lambda q: jnp.zeros((*q.shape[:-1], self.dcfg.vocab_size), q.dtype).at[..., ids].set(q))
        return state._replace(cache=cache), tree

    def update(self, dparams, state: HeadState, verified: Verified) -> HeadState:
        head, embed = dparams["head"], dparams["embed"]
        batch, width = verified.committed.shape
        fused = fuse(self.dcfg, head, verified.hidden)  # [B, E, H]: features of the committed tokens
        hidden_in = jnp.concatenate([state.root_hidden[:, None], fused[:, :-1]], axis=1)
        head_len = verified.cache_len - 1
        positions = head_len[:, None] + jnp.arange(width, dtype=jnp.int32)
        _, _, cache = draft_extend(self.dcfg, head, embed, state.cache, verified.committed, hidden_in, positions,
                                   head_len)
        last = fused[jnp.arange(batch), verified.num_accepted]
        return HeadState(cache=self._constrain_cache(cache),
                         root_hidden=jnp.where(verified.active[:, None], last, state.root_hidden))

    def _constrain(self, buf: jax.Array) -> jax.Array:
        return buf if self.sharding is None else self.sharding.constrain(buf, KV_CACHE_AXES)

    def _constrain_cache(self, cache: KVCache) -> KVCache:
        return jax.tree.map(self._constrain, cache)
