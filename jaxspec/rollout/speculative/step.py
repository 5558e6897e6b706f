"""One speculative step of B rows: draft -> verify -> commit, shared by the staged loop
(`jaxspec.rollout.speculative.loop`) and the slot engine (`jaxspec.rollout.speculative.slots`).

  1. the drafter proposes a tree rooted at each row's last committed token;
  2. one policy forward (`extend`) runs all tree nodes with a tree attention mask (a node sees
     the prefix and its ancestors) at positions cache_len + depth, writing their KV at slots
     cache_len .. cache_len + N - 1;
  3. the caller's verification (`jaxspec.kernels.tree_verify`) accepts a path and samples the next
     token exactly from p (a step without drafts samples it as an autoregressive step does);
  4. the accepted nodes' KV moves to consecutive slots (`commit_path`) and the drafter is updated.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec import kernels
from jaxspec.kernels.tree_verify_reference import VerifyResult, per_row_keys
from jaxspec.models.config import ModelConfig
from jaxspec.models.kv_cache import KVCache
from jaxspec.models.paged import PagedKVCache, paged_move
from jaxspec.models.params import Params
from jaxspec.models.sharding import Sharding
from jaxspec.models.transformer import extend
from jaxspec.rollout.sampling import Sampling, choose_per_row, choose_tokens, processed_logprobs
from jaxspec.rollout.speculative.drafter import Drafter, Verified, defers_step
from jaxspec.rollout.speculative.tree import DraftTree, ancestor_mask


def commit_path(cache: KVCache | PagedKVCache, cache_len: jax.Array, path: jax.Array) -> KVCache | PagedKVCache:
    """Moves the KV of accepted tree nodes to consecutive slots (positions, in a paged cache).

    The verification forward wrote node n of row b at slot cache_len[b] + n; path int32 [B, E]
    lists accepted node ids from the root (-1 after). Afterwards slot cache_len[b] + i holds
    node path[b, i]. Entries past the path are left as they are (they lie past the new length).
    """
    rows = jnp.arange(path.shape[0])[:, None]
    offsets = jnp.arange(path.shape[1], dtype=jnp.int32)[None, :]
    src = cache_len[:, None] + jnp.where(path >= 0, path, offsets)
    dst = cache_len[:, None] + offsets
    if isinstance(cache, PagedKVCache):  # positions through the page table

        def move(buf: jax.Array) -> jax.Array:
            return paged_move(buf, cache.page_table, src, dst)

    else:

        def move(buf: jax.Array) -> jax.Array:
            return buf.at[rows, dst].set(buf[rows, src], mode="drop")

    return cache._replace(k=tuple(map(move, cache.k)), v=tuple(map(move, cache.v)))


def _root_alone(root: jax.Array) -> DraftTree:
    """The tree of an autoregressive step: the root int32 [B], no draft nodes."""
    column = jnp.zeros((root.shape[0], 1), jnp.int32)
    return DraftTree(
        tokens=root[:, None], parents=column - 1, depth=column, num_nodes=column[:, 0] + 1, draft_probs=None
    )


def _sample_root(logits: jax.Array, key: jax.Array, sampling: Sampling) -> VerifyResult:
    """The verification of roots alone (no draft nodes): the next token sampled from p as an
    autoregressive step samples it, without the tree kernel. logits float32 [B, V]; key: one key,
    or one per row (`kernels.tree_verify`'s keys)."""
    choose = choose_per_row if per_row_keys(key) else choose_tokens
    token, logprob = choose(key, logits, sampling)
    zero = jnp.zeros_like(token)
    return VerifyResult(path=zero[:, None], num_accepted=zero, next_token=token, logprobs=logprob[:, None])


def _pad_to(x: jax.Array, size: int, axis: int, value) -> jax.Array:
    """`x` padded with `value` to `size` entries along `axis` (a shallower stage's tree)."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


class StepOutcome(NamedTuple):
    """One draft-and-verify step of B rows (W = max_depth + 1, the most tokens a step emits; E = W,
    or 1 for a step without drafts: it emits one token, and its caller writes no wider into the
    rows' tokens than an autoregressive step).

    cache, draft: the policy's cache (accepted nodes' KV at consecutive positions) and the
    drafter's state after the step; tree: the verified `DraftTree`; path int32 [B, W] accepted
    node ids from the root (-1 after); emitted int32 [B, E]: the accepted drafts then the next
    token (entry `accepted`), 0 after; logprobs float32 [B, E] log p of each emitted token, 0
    after; accepted int32 [B] draft tokens accepted; next_token int32 [B] the next root;
    node_experts: the tree nodes' routing [B, N, L_sparse, k] when recorded, else None.
    """

    cache: object
    draft: object
    tree: object
    path: jax.Array
    emitted: jax.Array
    logprobs: jax.Array
    accepted: jax.Array
    next_token: jax.Array
    node_experts: jax.Array | None


def speculative_step(
    cfg: ModelConfig,
    params: Params,
    sampling: Sampling,
    drafter: Drafter,
    dparams,
    cache,
    draft,
    root: jax.Array,
    cache_len: jax.Array,
    active: jax.Array,
    draft_key: jax.Array,
    verify_key: jax.Array,
    *,
    max_depth: int,
    chain: bool,
    sharding: Sharding | None = None,
    record: bool = False,
    drafts: bool = True,
) -> StepOutcome:
    """Steps 1-4 of the module docstring for rows root int32 [B] at cache_len int32 [B], the rows
    in active bool [B] still generating. cache: a dense `KVCache` or a `PagedKVCache`.
    verify_key: the key of the exact acceptance (`kernels.tree_verify`): one key, or one per row
    (the slot engine's, so that a row draws the same in any slot); with `sampling.coupled`, keys
    [B, max_depth + 1] by depth (`sampling.depth_keys`: the keys of the tokens the step may emit),
    each node verified under its depth's key. chain: the deepest drafter
    drafts chains (node n is node n - 1's only child); drafts=False verifies the root alone (an
    autoregressive step through the same code)."""
    width = max_depth + 1
    loop_rows = root.shape[0]
    steps = jnp.arange(width, dtype=jnp.int32)[None, :]
    defers = defers_step(drafter, drafts)  # `defer` below queues the step instead
    with jax.named_scope("propose"):
        if drafts:
            draft, tree = drafter.propose(dparams, draft, root, cache_len, active, draft_key)
        else:
            if not (defers or getattr(drafter, "propose_keeps_state", False)):  # e.g. a head's pending entries
                one = dataclasses.replace(drafter, depth=1, num_nodes=1)
                draft, _ = one.propose(dparams, draft, root, cache_len, active, draft_key)
            tree = _root_alone(root)
    with jax.named_scope("verify_forward"):
        logits, hidden, cache, *node_experts = extend(
            cfg,
            params,
            cache,
            tree.tokens,
            cache_len[:, None] + tree.depth,
            cache_len,
            tree_mask=None if chain else ancestor_mask(tree.parents, max_depth),
            active=active,
            hidden_layers=drafter.policy_layers,
            sharding=sharding,
            record_experts=record,
        )
    with jax.named_scope("verify"):
        if drafts:
            result = kernels.tree_verify(
                logits if sampling.greedy else processed_logprobs(logits, sampling),
                tree.parents,
                tree.tokens,
                tree.num_nodes,
                verify_key[jnp.arange(loop_rows)[:, None], tree.depth] if sampling.coupled else verify_key,
                temperature=0.0 if sampling.greedy else 1.0,
                draft_probs=tree.draft_probs,
            )
        else:
            result = _sample_root(logits[:, 0], verify_key[:, 0] if sampling.coupled else verify_key, sampling)
    # A stage that drafts less deep than the deepest pads its outcome to the loop's width.
    path = _pad_to(result.path[:, :width], width, 1, -1)
    accepted, next_token = result.num_accepted, result.next_token
    committed = (
        _pad_to(tree.tokens[:, :width], width, 1, 0)
        if chain
        else jnp.take_along_axis(tree.tokens, jnp.maximum(path, 0), axis=1)
    )
    emitted = jnp.concatenate([committed[:, 1:], jnp.zeros((loop_rows, 1), jnp.int32)], axis=1)
    emitted = jnp.where(steps == accepted[:, None], next_token[:, None], emitted)
    node_hidden = (
        _pad_to(hidden[:, :, :width], width, 2, 0)
        if chain or hidden.shape[0] == 0
        else (jnp.take_along_axis(hidden, jnp.maximum(path, 0)[None, :, :, None], axis=2))
    )
    with jax.named_scope("draft_update"):
        draft = (drafter.defer if defers else drafter.update)(
            dparams,
            draft,
            Verified(
                committed=committed,
                next_root=next_token,
                num_accepted=accepted,
                cache_len=cache_len,
                hidden=node_hidden,
                active=active,
            ),
        )
    if drafts and not chain:  # a chain's accepted nodes, and a lone root, already sit at consecutive slots
        with jax.named_scope("commit"):
            cache = commit_path(cache, cache_len, path)
    emits = width if drafts else 1
    return StepOutcome(
        cache=cache,
        draft=draft,
        tree=tree,
        path=path,
        emitted=emitted[:, :emits],
        logprobs=_pad_to(result.logprobs[:, :width], width, 1, 0.0)[:, :emits],
        accepted=accepted,
        next_token=next_token,
        node_experts=node_experts[0] if record else None,
    )
