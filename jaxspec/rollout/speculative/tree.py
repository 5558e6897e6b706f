"""Draft trees with static shapes: the EAGLE-2 dynamic tree, node compaction, attention masks.

A tree of N nodes per row is given by parallel arrays: node 0 is the root (the last committed
token, already sampled, not yet in the policy's KV cache); `parents[n] < n`; children of a node
are verified in increasing node index, so that order is the draft order (deterministic top-k:
descending draft probability; stochastic: draw order). Rows may use fewer than N nodes
(`num_nodes`); the unused tail holds token 0 with parent 0.

Scores and exactness. The EAGLE-2 tree keeps nodes by a score that never increases from a node
to its children, so any "best n nodes" set is a connected tree (ties go to the shallower, then
the lower-index node). Greedy drafts score by cumulative draft log-probability. Stochastic
drafts score by the Gumbel-perturbed log-probability of stochastic beam search (Kool et al.,
2019): a node's children are drawn without replacement from q by Gumbel-top-k, and their
perturbed scores are shifted so the largest equals the parent's. Whether a drawn child is kept
depends only on how many nodes outrank it; the nodes whose existence or score depends on the
child's identity (its later siblings, its descendants, the candidates they displace) all rank
below it, and given the earlier draws the child's identity is independent of its own perturbed
value. So every kept child is distributed as q conditioned on the earlier draws, each node keeps
a prefix of its draw order, and multi-draft verification with q stays exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class DraftTree(NamedTuple):
    """One draft tree per row, N = 1 + draft nodes.

    tokens: int32 [B, N] (node 0 = root). parents: int32 [B, N] (-1 at the root).
    depth: int32 [B, N] (0 at the root). num_nodes: int32 [B] nodes in use, root included.
    draft_probs: float32 [B, N, V] the draft distribution q each node's children were drawn from
        (stochastic drafts), or None (deterministic drafts).
    scores: float32 [B, N] the scores the drafter kept its nodes by (never larger at a child than
        at its parent; -inf past num_nodes), or None; a hybrid tree (`hybrid`) keeps a source's
        nodes in this order.
    """

    tokens: jax.Array
    parents: jax.Array
    depth: jax.Array
    num_nodes: jax.Array
    draft_probs: jax.Array | None
    scores: jax.Array | None = None


def ancestor_mask(parents: jax.Array, max_depth: int) -> jax.Array:
    """bool [B, N, N]: entry [b, i, j] is True when node j is node i or one of its ancestors.

    parents int32 [B, N] (-1 at the root); max_depth: deepest node's depth (static).
    """
    num_nodes = parents.shape[1]
    eye = jnp.eye(num_nodes, dtype=bool)[None]
    has_parent = (parents >= 0)[:, :, None]
    parent_rows = jnp.clip(parents, 0)[:, :, None]
    mask = jnp.broadcast_to(eye, (parents.shape[0], num_nodes, num_nodes))
    for _ in range(max_depth):
        mask = eye | (has_parent & jnp.take_along_axis(mask, parent_rows, axis=1))
    return mask


def select_nodes(
    keep: jax.Array,
    tokens: jax.Array,
    parents: jax.Array,
    depth: jax.Array,
    num_out: int,
    draft_probs: jax.Array | None = None,
    scores: jax.Array | None = None,
) -> DraftTree:
    """Packs the kept nodes of candidate trees into the first slots of an N = `num_out` tree.

    keep bool [B, M] (node 0, the root, must be kept; kept nodes' parents are kept; at most
    num_out per row). tokens, parents (indices into M, -1 at the root), depth: int32 [B, M], in
    an order where parents precede children and siblings come in draft order, which the packed
    tree keeps. draft_probs float32 [B, M, V] or None; scores float32 [B, M] or None.
    """
    rows = jnp.arange(keep.shape[0])[:, None]
    new_index = jnp.cumsum(keep, axis=1, dtype=jnp.int32) - 1
    dest = jnp.where(keep, new_index, num_out)  # dropped nodes scatter out of range

    def pack(values: jax.Array, fill) -> jax.Array:
        out = jnp.full((keep.shape[0], num_out, *values.shape[2:]), fill, values.dtype)
        return out.at[rows, dest].set(values, mode="drop")

    new_parents = jnp.where(parents >= 0, jnp.take_along_axis(new_index, jnp.clip(parents, 0), axis=1), -1)
    return DraftTree(
        tokens=pack(tokens, 0),
        parents=pack(new_parents, 0),
        depth=pack(depth, 0),
        num_nodes=keep.sum(axis=1, dtype=jnp.int32),
        draft_probs=None if draft_probs is None else pack(draft_probs, 0.0),
        scores=None if scores is None else pack(scores, -jnp.inf),
    )


def best_nodes(scores: jax.Array, count: int) -> jax.Array:
    """bool [B, M]: the root plus the `count` best nodes by score (ties: lower index first).

    scores float32 [B, M] non-increasing from parent to child, nodes in an order where parents
    precede children (so the kept set is connected); -inf marks nodes that are never kept.
    """
    rows = jnp.arange(scores.shape[0])[:, None]
    ranked = jnp.argsort(-scores.at[:, 0].set(jnp.inf), axis=1, stable=True)[:, : count + 1]
    return jnp.zeros(scores.shape, bool).at[rows, ranked].set(True) & (scores > -jnp.inf)


def shifted_gumbel(parent_score: jax.Array, children: jax.Array) -> jax.Array:
    """Stochastic beam search: perturbed child scores shifted so that their maximum is parent_score.

    children float32 [..., W] Gumbel-perturbed log-probabilities in descending order (children[..., 0]
    is the maximum over the whole vocabulary); parent_score float32 [...]. Returns float32
    [..., W] = -log(exp(-parent) - exp(-max) + exp(-child)), -inf where a child or the parent
    is -inf, and never above the parent's score.
    """
    top = children[..., :1]
    finite = jnp.isfinite(children) & jnp.isfinite(parent_score)[..., None]
    gap = jnp.where(finite, children - top, -1.0)  # <= 0
    log1mexp = jnp.where(gap > -0.6931472, jnp.log(-jnp.expm1(gap)), jnp.log1p(-jnp.exp(gap)))
    v = parent_score[..., None] - children + log1mexp
    shifted = parent_score[..., None] - jnp.maximum(v, 0.0) - jnp.log1p(jnp.exp(-jnp.abs(v)))
    return jnp.where(finite, jnp.minimum(shifted, parent_score[..., None]), -jnp.inf)


# draft_pass(carry, tokens [B, T], parents [B, T], depth [B, T], mask [B, T, T], frontier: slice) ->
#     (carry, the draft's raw logits [B, F, Vd] at the nodes in `frontier`)
DraftPass = Callable[[object, jax.Array, jax.Array, jax.Array, jax.Array, slice], tuple[object, jax.Array]]


def dynamic_tree(
    draft_pass: DraftPass,
    carry,
    root: jax.Array,
    key: jax.Array,
    *,
    depth: int,
    width: int,
    num_nodes: int,
    stochastic: bool,
    process: Callable[[jax.Array], jax.Array],
    to_target: Callable[[jax.Array], jax.Array] = lambda ids: ids,
    probs_to_target: Callable[[jax.Array], jax.Array] = lambda q: q,
):
    """Builds an EAGLE-2 dynamic tree of `depth` levels, `width` nodes per level, pruned to `num_nodes`.

    Level 1 is the root's top-`width` children; each further level expands every node of the
    previous level into its top-`width` children and keeps the best `width` by score (see the
    module docstring); finally the `num_nodes` best nodes overall are kept (stochastic drafts: those
    with q > 0 alone, so a row may keep fewer).
    draft_pass: runs the draft over the tree built so far (nodes in level order) and returns its
        raw logits over the draft vocabulary at the frontier's nodes; called `depth` times with
        T = 1, 1 + width, ..., 1 + (depth - 1) * width nodes.
    process: raw logits [..., Vd] -> the draft distribution's float32 log-probabilities (the
        rollout's `processed_logprobs`). A deterministic chain (width 1) skips it: it needs only
        each level's most likely token, which processing keeps (temperature scales the logits,
        top-k and top-p keep the most likely token), and its nodes need no scores (the best
        `num_nodes` of a chain are its first).
    root int32 [B]; key: PRNG key for the stochastic draws.
    to_target: draft-vocabulary ids -> policy ids; probs_to_target: [..., Vd] -> [..., V].
    Returns (carry, DraftTree with 1 + num_nodes nodes).
    """
    batch = root.shape[0]
    total = 1 + depth * width
    level = np.concatenate([[0], np.repeat(np.arange(1, depth + 1), width)]).astype(np.int32)
    levels = [root[:, None].astype(jnp.int32)]  # the tokens level by level (one concatenation each pass, none updated)
    parents = jnp.full((batch, total), -1, jnp.int32)
    log_q = jnp.zeros((batch, total), jnp.float32)  # cumulative draft log-probability
    scores = jnp.zeros((batch, total), jnp.float32)
    node_depth = jnp.broadcast_to(jnp.asarray(level), (batch, total))
    eye = jnp.eye(total, dtype=bool)
    mask = jnp.broadcast_to(eye, (batch, total, total))
    node_probs = []

    def flat(x: jax.Array) -> jax.Array:  # [B, F, W] -> [B, F * W]: candidate c = frontier node c // W, draw c % W
        return x.reshape(batch, -1)

    def chosen(x: jax.Array, pick: jax.Array | None) -> jax.Array:
        """The kept candidates [B, width] of x [B, F, W]: those `pick` [B, width] names, or a chain's
        one (pick None: a slice, where a gather would check its bounds on the device, a launch)."""
        return flat(x)[:, :1] if pick is None else jnp.take_along_axis(flat(x), pick, axis=1)

    def put(x: jax.Array, nodes: jax.Array, at: int) -> jax.Array:
        """x [B, total, ...] with nodes [B, width, ...] at node `at`: `.at[].set` of a static slice
        would check its bounds on the device (a launch a call)."""
        return jax.lax.dynamic_update_slice_in_dim(x, nodes.astype(x.dtype), at, axis=1)

    for d in range(depth):
        start = 0 if d == 0 else 1 + (d - 1) * width
        frontier = slice(start, 1 + d * width)
        t = frontier.stop
        tokens = jnp.concatenate(levels, axis=1)  # [B, t]
        carry, logits = draft_pass(carry, tokens, parents[:, :t], node_depth[:, :t], mask[:, :t, :t], frontier)
        parent_logq, parent_score = log_q[:, frontier, None], scores[:, frontier]
        if width == 1 and not stochastic:  # a chain's next node: the argmax, no log-probabilities
            ids = jnp.argmax(logits, axis=-1, keepdims=True).astype(jnp.int32)
            child_logq = child_score = parent_logq
        elif stochastic:
            logq = process(logits)
            node_probs.append(jnp.exp(logq))
            if d == 0:  # one draw for all levels (level 0 reads the first of `width` rows)
                noise = jax.random.gumbel(key, (depth, batch, width, logq.shape[-1]), jnp.float32)
            perturbed = parent_logq + logq + noise[d, :, : logq.shape[1]]
            perturbed, ids = jax.lax.top_k(perturbed, width)  # [B, F, W] the first W draws
            child_logq = parent_logq + jnp.take_along_axis(logq, ids, axis=-1)
            child_score = shifted_gumbel(parent_score, perturbed)
        else:
            top, ids = jax.lax.top_k(process(logits), width)
            child_logq = child_score = parent_logq + top
        if width == 1:  # a chain: one candidate per level, no sort
            pick, new_parents = None, jnp.full((batch, 1), start, jnp.int32)
        else:
            pick = jnp.argsort(-flat(child_score), axis=1, stable=True)[:, :width]
            new_parents = start + pick // width
        new = slice(t, t + width)
        levels.append(to_target(chosen(ids, pick)))
        parents = put(parents, new_parents, t)
        log_q = put(log_q, chosen(child_logq, pick), t)
        scores = put(scores, chosen(child_score, pick), t)
        parent_rows = jnp.take_along_axis(mask, new_parents[:, :, None], axis=1)  # [B, W, total]
        mask = put(mask, parent_rows | eye[new][None], t)
    tokens = jnp.concatenate(levels, axis=1)
    draft_probs = None
    if stochastic:  # q at every node that has children; the deepest level's nodes have none
        q = jnp.concatenate(node_probs, axis=1)
        q = jnp.concatenate([q, jnp.zeros((batch, width, q.shape[-1]), q.dtype)], axis=1)
        draft_probs = probs_to_target(q)
    # Nothing to prune: the tree is already packed in level order, unless it is stochastic and wider
    # than q's support (fewer tokens with q > 0 than `width`, e.g. under top-p): then each node's last
    # draws are tokens with q = 0 (score -inf), which could not have been drawn and which verification
    # would accept whenever p > 0, so only its finite nodes are kept. (A deterministic draft of such a
    # token costs a node, never exactness.)
    if num_nodes == depth * width and (width == 1 or not stochastic):
        return carry, DraftTree(
            tokens=tokens,
            parents=parents,
            depth=node_depth,
            num_nodes=jnp.full((batch,), total, jnp.int32),
            draft_probs=draft_probs,
            scores=scores,
        )
    keep = best_nodes(scores, num_nodes)
    return carry, select_nodes(keep, tokens, parents, node_depth, 1 + num_nodes, draft_probs, scores)
