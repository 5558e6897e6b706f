"""Hybrid draft trees: EAGLE-3 branches and group-suffix branches in one tree (`spec.suffix_branches`).

Every step both sources draft their whole trees from the row's root: the EAGLE-3 head
(`Eagle3Drafter`: depth k, `tree_width` children per node) and the suffix drafter (`SuffixDrafter`:
continuations of the row's longest match in its own tokens, its GRPO group and earlier answers),
each of at most min(N, k * tree_width) nodes, N = `num_nodes` the step's budget. The verified tree
(`merge_trees`) keeps, within N draft nodes,
  1. the suffix tree's s best nodes (by match count), s the row's suffix share below; then
  2. the head's nodes in the order of their scores (cumulative draft log-probability) while the
     tree holds at most N nodes. A head node whose token path is a kept suffix node is that node
     (each token sequence appears once), so it costs nothing and its children hang below it.
A row whose suffix tree is empty or smaller than its share gives the rest to the head.

Split. Each row keeps, per source, a running (exponentially decayed, weight `decay` on the past)
count of the tokens that source's whole tree would have had accepted: the longest prefix of the
step's new tokens (accepted drafts, then the next root) that is a path of its tree; under greedy
verification exactly what the source alone would have accepted, capped at what the step emitted.
The suffix share is s = round(N * L_suffix / (L_suffix + L_head)); both start at 1 (an even
split). The split is measured, not fixed: which source pays differs between prompts (a prompt
whose earlier answers repeat, a new one) and over a run, and measuring needs no exploration since
both whole trees are drafted every step anyway. The choice depends only on earlier steps.

Exactness: the merged tree's sibling tokens are distinct and its drafts deterministic, which tree
verification accepts exactly at any temperature. Sampled head drafts (`draft_sampling:
stochastic`) would put deterministic suffix children beside draws from q, which multi-draft
verification with q does not cover; `SpecConfig.errors` refuses that combination.

Head state: `Eagle3Drafter.update` records the committed tokens with the policy's features at them,
whichever source drafted them, and its next `propose` runs the head over that record first; so
after a path the suffix branch drafted, the head's next tree is conditioned on the accepted tokens.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.rollout.speculative.drafter import Pooled, Prefill, Verified, new_tokens
from jaxspec.rollout.speculative.suffix import SuffixDrafter, SuffixSources
from jaxspec.rollout.speculative.tree import DraftTree, select_nodes

if TYPE_CHECKING:
    from jaxspec.rollout.speculative.eagle3 import Eagle3Drafter, HeadState
    from jaxspec.rollout.speculative.spec import Spec

SUFFIX, HEAD = 0, 1  # source indices of `HybridRows.rates` and the drafted trees


class HybridSources(NamedTuple):
    """The hybrid drafter's dparams: head: the EAGLE-3 drafter's ({"head", "embed"}); suffix:
    `SuffixSources` of the call's rows."""

    head: dict
    suffix: SuffixSources


class HybridRows(NamedTuple):
    """The batch-major part of the hybrid state (its pool is the suffix drafter's `SuffixPool`).

    head: the EAGLE-3 drafter's `HeadState`; suffix_rows int32 [B]: the suffix drafter's rows;
    rates float32 [B, 2]: running accepted tokens per step of each source's whole tree (SUFFIX,
    HEAD); tokens, parents int32 [B, 2, T], num_nodes int32 [B, 2]: each source's whole tree of the
    last proposal (T = 1 + k * tree_width of the deepest stage; nodes past num_nodes unused).
    """

    head: HeadState
    suffix_rows: jax.Array
    rates: jax.Array
    tokens: jax.Array
    parents: jax.Array
    num_nodes: jax.Array


@dataclasses.dataclass(frozen=True)
class HybridDrafter:
    """head, suffix: the two sources' drafters (their tree shapes are replaced by this one's);
    depth: k; branch_width: children per node in each source (`tree_width`); num_nodes: draft nodes
    of the merged tree N; decay: weight of the past in the running rates (`adaptive_decay`)."""

    head: Eagle3Drafter
    suffix: SuffixDrafter
    depth: int
    branch_width: int
    num_nodes: int
    decay: float

    @property
    def policy_layers(self) -> tuple[int, ...]:
        return self.head.policy_layers

    @property
    def width(self) -> int:
        """Children a merged node may have (never 1: the merged tree is not a chain)."""
        return 2 * self.branch_width

    def source_drafters(self) -> tuple[Eagle3Drafter, SuffixDrafter]:
        """(head, suffix): the two sources' drafters with this drafter's tree shape."""
        shape = dict(
            depth=self.depth,
            width=self.branch_width,
            num_nodes=min(self.num_nodes, self.depth * self.branch_width),
        )
        return dataclasses.replace(self.head, **shape), dataclasses.replace(self.suffix, **shape)

    def init(self, sources: HybridSources, prefill: Prefill) -> Pooled:
        head, suffix = self.source_drafters()
        suffix_state = suffix.init(sources.suffix, prefill)
        batch, size = prefill.row_prompt.shape[0], 1 + self.depth * self.branch_width
        rows = HybridRows(
            head=head.init(sources.head, prefill),
            suffix_rows=suffix_state.rows,
            rates=jnp.ones((batch, 2), jnp.float32),
            tokens=jnp.zeros((batch, 2, size), jnp.int32),
            parents=jnp.zeros((batch, 2, size), jnp.int32),
            num_nodes=jnp.ones((batch, 2), jnp.int32),
        )
        return Pooled(rows=rows, pool=suffix_state.pool)

    def propose(
        self, sources: HybridSources, state: Pooled, root: jax.Array, cache_len: jax.Array, active, key
    ) -> tuple[Pooled, DraftTree]:
        head, suffix = self.source_drafters()
        rows = state.rows
        head_state, head_tree = head.propose(sources.head, rows.head, root, cache_len, active, key)
        _, suffix_tree = suffix.propose(
            sources.suffix, Pooled(rows.suffix_rows, state.pool), root, cache_len, active, key
        )
        tree = merge_trees(suffix_tree, head_tree, suffix_share(rows.rates, self.num_nodes), self.num_nodes)
        size = rows.tokens.shape[2]  # the deepest stage's trees: a shallower stage's are padded

        def both(field: str) -> jax.Array:
            return jnp.stack([_pad(getattr(t, field), size) for t in (suffix_tree, head_tree)], axis=1)

        rows = rows._replace(
            head=head_state,
            tokens=both("tokens"),
            parents=both("parents"),
            num_nodes=jnp.stack([suffix_tree.num_nodes, head_tree.num_nodes], axis=1),
        )
        return Pooled(rows, state.pool), tree

    def update(self, sources: HybridSources, state: Pooled, verified: Verified) -> Pooled:
        head, suffix = self.source_drafters()
        rows = state.rows
        suffix_state = suffix.update(sources.suffix, Pooled(rows.suffix_rows, state.pool), verified)
        batch, _, size = rows.tokens.shape

        def flat(x: jax.Array) -> jax.Array:  # [B, 2, ...] -> [2B, ...]
            return x.reshape(batch * 2, *x.shape[2:])

        matched = accepted_depth(
            flat(rows.tokens),
            flat(rows.parents),
            flat(rows.num_nodes),
            jnp.repeat(new_tokens(verified), 2, axis=0),
            jnp.repeat(verified.num_accepted + 1, 2),
            size - 1,  # no deeper than the trees hold (an autoregressive iteration's drafter has depth 0)
        ).reshape(batch, 2)
        moved = self.decay * rows.rates + (1.0 - self.decay) * matched.astype(jnp.float32)
        rows = rows._replace(
            head=head.update(sources.head, rows.head, verified),
            suffix_rows=suffix_state.rows,
            rates=jnp.where(verified.active[:, None], moved, rows.rates),
        )
        return Pooled(rows, suffix_state.pool)


def hybrid_drafter(head: Eagle3Drafter, spec: Spec) -> HybridDrafter:
    """The hybrid drafter of `spec` (suffix_branches) around its EAGLE-3 drafter `head`."""
    shape = dict(depth=head.depth, width=head.width, num_nodes=head.num_nodes)
    return HybridDrafter(
        head=head,
        suffix=SuffixDrafter(max_match=spec.suffix_max_match, num_candidates=spec.suffix_candidates, **shape),
        depth=spec.num_draft_tokens,
        branch_width=spec.tree_width,
        num_nodes=spec.num_tree_nodes,
        decay=float(spec.adaptive_decay),
    )


def suffix_share(rates: jax.Array, num_nodes: int) -> jax.Array:
    """int32 [B]: the suffix tree's nodes in a merged tree of num_nodes, from the running rates
    float32 [B, 2] (SUFFIX, HEAD): round(num_nodes * suffix / (suffix + head)), half when both are 0."""
    total = rates.sum(axis=1)
    fraction = jnp.where(total > 0, rates[:, SUFFIX] / jnp.where(total > 0, total, 1.0), 0.5)
    return jnp.clip(jnp.floor(num_nodes * fraction + 0.5), 0, num_nodes).astype(jnp.int32)


def token_paths(tokens: jax.Array, parents: jax.Array, max_depth: int) -> jax.Array:
    """int32 [B, N, max_depth]: entry d the token at depth d + 1 on the path from the root to the
    node, -1 past the node's depth (the root's row is all -1). tokens, parents int32 [B, N]
    (parents[n] < n, node 0 the root); nodes no deeper than max_depth."""
    num = tokens.shape[1]
    node = jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), tokens.shape)
    upward = []  # the node's token, its parent's, ..., -1 from the root on
    for _ in range(max_depth):
        upward.append(jnp.where(node > 0, jnp.take_along_axis(tokens, node, axis=1), -1))
        node = jnp.where(node > 0, jnp.take_along_axis(parents, node, axis=1), 0)
    upward = jnp.stack(upward, axis=-1)
    depth = jnp.sum(upward >= 0, axis=-1, dtype=jnp.int32)
    index = depth[..., None] - 1 - jnp.arange(max_depth, dtype=jnp.int32)
    return jnp.where(index >= 0, jnp.take_along_axis(upward, jnp.maximum(index, 0), axis=-1), -1)


def accepted_depth(
    tokens: jax.Array, parents: jax.Array, num_nodes: jax.Array, emitted: jax.Array, length: jax.Array, max_depth: int
) -> jax.Array:
    """int32 [B]: the longest prefix of emitted int32 [B, E] (its first length int32 [B] entries)
    that is a root-to-node path of the tree (tokens, parents int32 [B, N], num_nodes int32 [B])."""
    paths = token_paths(tokens, parents, max_depth)  # [B, N, D]
    depth = jnp.sum(paths >= 0, axis=-1, dtype=jnp.int32)
    width = emitted.shape[1]
    target = emitted[:, :max_depth] if width >= max_depth else _pad(emitted, max_depth, value=-2)
    levels = jnp.arange(max_depth, dtype=jnp.int32)
    on_path = jnp.all((paths == target[:, None, :]) | (levels >= depth[..., None]), axis=-1)
    valid = jnp.arange(tokens.shape[1])[None, :] < num_nodes[:, None]
    return jnp.max(jnp.where(on_path & valid & (depth <= length[:, None]), depth, 0), axis=1)


def _priority(tree: DraftTree) -> tuple[jax.Array, jax.Array]:
    """(rank int32 [B, N]: each node's place in the order its source keeps nodes, the root 0;
    valid bool [B, N]: nodes in use). Ties go to the lower index, so parents rank before children."""
    num = tree.tokens.shape[1]
    valid = jnp.arange(num)[None, :] < tree.num_nodes[:, None]
    scores = jnp.where(valid, tree.scores, -jnp.inf).at[:, 0].set(jnp.inf)
    order = jnp.argsort(-scores, axis=1, stable=True)
    places = jnp.broadcast_to(jnp.arange(num, dtype=order.dtype), order.shape)
    rank = jnp.zeros_like(order).at[jnp.arange(order.shape[0])[:, None], order].set(places)
    return rank.astype(jnp.int32), valid


def merge_trees(suffix: DraftTree, head: DraftTree, share: jax.Array, num_nodes: int) -> DraftTree:
    """One deterministic tree of 1 + num_nodes nodes from two of the same root (module docstring):
    the suffix tree's best `share` int32 [B] nodes, then the head tree's nodes by score while at
    most num_nodes are kept, a head node whose token path is a kept suffix node merged into it.
    Both trees carry `scores`; nodes keep their source's order, suffix nodes first."""
    max_depth = max(suffix.tokens.shape[1], head.tokens.shape[1])  # no node is deeper than its tree is large
    suffix_rank, suffix_valid = _priority(suffix)
    head_rank, head_valid = _priority(head)
    keep_suffix = suffix_valid & (suffix_rank <= share[:, None])
    kept_suffix = keep_suffix.sum(axis=1, dtype=jnp.int32) - 1
    suffix_paths = token_paths(suffix.tokens, suffix.parents, max_depth)
    head_paths = token_paths(head.tokens, head.parents, max_depth)
    same = jnp.all(head_paths[:, :, None] == suffix_paths[:, None], axis=-1) & keep_suffix[:, None, :]
    duplicate = jnp.any(same, axis=2) & head_valid  # the roots are each other's duplicates
    duplicate_of = jnp.argmax(same, axis=2).astype(jnp.int32)
    new = head_valid & ~duplicate
    # new_before[b, i]: the new head nodes ranked no later than node i
    new_before = jnp.sum(new[:, None, :] & (head_rank[:, None, :] <= head_rank[:, :, None]), axis=2)
    keep_head = new & (new_before <= num_nodes - kept_suffix[:, None])
    offset = suffix.tokens.shape[1] - 1  # head node i >= 1 is candidate offset + i
    head_parent = head.parents[:, 1:]
    parent_duplicate = jnp.take_along_axis(duplicate, jnp.maximum(head_parent, 0), axis=1)
    parent_of = jnp.where(
        parent_duplicate, jnp.take_along_axis(duplicate_of, jnp.maximum(head_parent, 0), axis=1), offset + head_parent
    )
    return select_nodes(
        keep=jnp.concatenate([keep_suffix, keep_head[:, 1:]], axis=1),
        tokens=jnp.concatenate([suffix.tokens, head.tokens[:, 1:]], axis=1),
        parents=jnp.concatenate([suffix.parents, parent_of], axis=1),
        depth=jnp.concatenate([suffix.depth, head.depth[:, 1:]], axis=1),
        num_out=1 + num_nodes,
    )


def _pad(x: jax.Array, size: int, value=0) -> jax.Array:
    """[B, n] -> [B, size] (n <= size), padded with `value`."""
    return jnp.pad(x, ((0, 0), (0, size - x.shape[1])), constant_values=value)
