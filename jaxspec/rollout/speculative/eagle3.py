"""Drafting with an EAGLE-3 head over the policy's hidden states (`jaxspec.draft`).

Head entry j (rope position j) pairs the fused policy features of token x_j with token x_{j+1}
and predicts x_{j+2}. With the root x_{L-1} at policy slot cache_len = L - 1, the root's entry
is L - 2 (head length cache_len - 1). After a verification step the entries of the newly
committed tokens must be recomputed from the policy's own features at the accepted nodes; the
root's entry needs them too. Both are one chunk: `update` only records the chunk (the n
entries ending with the new root's), and the first drafting pass of the next `propose` runs it
and reads the root's logits at its last valid entry. Each further tree level runs the head over
the tree built so far: the root with its features, every other node with its parent's head
output (before the final norm); a chain's level runs its newest node alone (the others' entries
are in the head's cache from the levels before: the same entries, one pass of one entry a row).

In an adaptive loop (`jaxspec.rollout.speculative.adaptive`) an autoregressive iteration does not
run the head: `defer` appends the step's one entry to the pending chunk (`backlog` more entries
than a drafting step needs), and the next `propose` runs the whole backlog in one pass, which
costs about one head pass where the autoregressive iterations would each have paid one.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.draft import (
    DraftConfig,
    draft_extend,
    fuse,
    fuse_stacked,
    init_draft_cache,
    stack_aux,
    target_ids,
    to_target_ids,
)
from jaxspec.kernels.attention_partials import MAX_QUERY_ROWS
from jaxspec.models.kv_cache import KVCache
from jaxspec.models.sharding import KV_CACHE_AXES, Sharding, constrain
from jaxspec.rollout.sampling import Sampling, processed_logprobs
from jaxspec.rollout.speculative.drafter import Prefill, Verified, new_tokens
from jaxspec.rollout.speculative.tree import DraftTree, dynamic_tree


class HeadState(NamedTuple):
    """cache: the head's KV (entries before the pending chunk valid). The pending chunk (E =
    longest accepted path + 1 + the drafter's backlog entries, `count` of them valid, the last
    valid one the root's):
    tokens int32 [B, E], hidden [B, E, 3H] the policy features each entry pairs with its token,
    its three layers side by side (`jaxspec.draft.stack_aux`: the head's fc runs when the chunk
    does, once for all the entries an adaptive loop queued), count int32 [B] in [1, E].
    rows: None when hidden holds the state's B rows; else int32 [B], the rows of a larger hidden
    [S, E, 3H] that the state's rows are: a slot engine step on B of its S slots reads and writes
    their features where they lie (`slot_drafters.without_chunk`) rather than moving the chunk."""

    cache: KVCache
    tokens: jax.Array
    hidden: jax.Array
    count: jax.Array
    rows: jax.Array | None = None


def _feature_rows(state: HeadState) -> jax.Array:
    """int32 [B]: the rows of state.hidden that the state's B rows are."""
    return jnp.arange(state.count.shape[0]) if state.rows is None else state.rows


MIN_QUEUE_PIECE = 16  # entries per pass when a backlog runs, at least


def queue_piece(dcfg: DraftConfig) -> int:
    """Entries per pass when a backlog runs: as many as one program of the cache-attention kernel
    takes (entries x query heads per kv head <= MAX_QUERY_ROWS), so that a backlog runs in as few
    passes as it can (each pass launches the head's kernels once), and at least MIN_QUEUE_PIECE."""
    return max(MIN_QUEUE_PIECE, MAX_QUERY_ROWS // (dcfg.num_heads // dcfg.num_kv_heads))


def piece_layout(width: int, piece: int) -> tuple[int, int]:
    """(entries per pass, width padded to whole passes) of a chunk of `width` entries run in
    pieces of at most `piece` entries: a chunk no wider than a piece runs in one pass, unpadded."""
    size = min(piece, width)
    return size, -(-width // size) * size


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter:
    """dcfg: the head's config. dparams passed to the methods: {"head": head params, "embed":
    the policy's token embedding [V, H]}. backlog: entries of autoregressive iterations the state
    can queue (`defer`; 0: none, an autoregressive iteration runs a depth-1 proposal instead).
    piece: entries per pass when the backlog runs (None: `queue_piece(dcfg)`).
    Other fields as `DraftModelDrafter`."""

    dcfg: DraftConfig
    sampling: Sampling
    depth: int
    width: int
    num_nodes: int
    stochastic: bool
    sharding: Sharding | None = None
    backlog: int = 0
    piece: int | None = None

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
        _, _, cache = draft_extend(
            self.dcfg, head, embed, cache, next_tokens, fused, positions, jnp.zeros((num_prompts,), jnp.int32)
        )

        def to_rows(buf: jax.Array) -> jax.Array:  # [U, P, Nk, D] -> [B, max_len, Nk, D]
            rows = jnp.take(buf, prefill.row_prompt, axis=0)
            return self._constrain(jnp.pad(rows, ((0, 0), (0, prefill.max_len - width), (0, 0), (0, 0))))

        last = prefill.policy_hidden[:, prefill.row_prompt, prefill.row_lengths - 1][:, :, None]  # [3, B, 1, H]
        root_hidden = stack_aux(self.dcfg, head, last)[:, 0]
        batch, chunk = root_hidden.shape[0], self.chunk
        return HeadState(
            cache=KVCache(k=tuple(map(to_rows, cache.k)), v=tuple(map(to_rows, cache.v))),
            tokens=jnp.zeros((batch, chunk), jnp.int32).at[:, 0].set(prefill.first_token),
            hidden=jnp.zeros((batch, chunk, root_hidden.shape[-1]), root_hidden.dtype).at[:, 0].set(root_hidden),
            count=jnp.ones((batch,), jnp.int32),
        )

    @property
    def chunk(self) -> int:
        """Entries of the pending chunk `init` makes: the longest accepted run + 1, + backlog.
        `propose` takes any width, so loop stages that draft to different depths share the state
        of the deepest."""
        return min(self.depth, self.num_nodes) + 1 + self.backlog

    @property
    def defers(self) -> bool:
        """Whether an autoregressive iteration calls `defer` (and no `propose`) on this state."""
        return self.backlog > 0

    def propose(
        self, dparams, state: HeadState, root: jax.Array, cache_len: jax.Array, active: jax.Array, key: jax.Array
    ) -> tuple[HeadState, DraftTree]:
        head, embed = dparams["head"], dparams["embed"]
        head_len = cache_len - 1  # the root's entry

        def draft_pass(carry, tokens, parents, depth, mask, frontier):
            cache, previous_out, root_hidden = carry
            if previous_out is None:  # the pending chunk, its last valid entry the root's
                logits, out, root_hidden, cache = self._pending_pass(head, embed, cache, state, head_len, active)
            elif self.width == 1:  # a chain: its newest node alone, the entries before it in the cache
                newest = head_len + tokens.shape[1] - 1
                logits, out, cache = draft_extend(
                    self.dcfg,
                    head,
                    embed,
                    cache,
                    tokens[:, -1:],
                    previous_out,  # [B, 1, H]: the node's parent's output
                    newest[:, None],
                    newest,
                    active=active,
                    sharding=self.sharding,
                )
            else:
                parent_out = jnp.take_along_axis(previous_out, jnp.maximum(parents, 0)[:, :, None], axis=1)
                hidden_in = jnp.where((parents < 0)[:, :, None], root_hidden, parent_out)
                logits, out, cache = draft_extend(
                    self.dcfg,
                    head,
                    embed,
                    cache,
                    tokens,
                    hidden_in,
                    head_len[:, None] + depth,
                    head_len,
                    tree_mask=mask,
                    active=active,
                    sharding=self.sharding,
                )
                logits = logits[:, frontier]
            return (self._constrain_cache(cache), out, root_hidden), logits

        ids = target_ids(head)
        (cache, _, _), tree = dynamic_tree(
            draft_pass,
            (state.cache, None, None),
            root,
            key,
            depth=self.depth,
            width=self.width,
            num_nodes=self.num_nodes,
            stochastic=self.stochastic,
            process=lambda logits: processed_logprobs(logits, self.sampling),
            to_target=lambda draft_ids: to_target_ids(head, draft_ids),
            probs_to_target=lambda q: jnp.zeros((*q.shape[:-1], self.dcfg.vocab_size), q.dtype).at[..., ids].set(q),
        )
        return state._replace(cache=cache), tree

    def _pending_pass(self, head, embed, cache, state: HeadState, head_len, active):
        """Runs the pending chunk into the head's cache: (logits [B, 1, Vd], output [B, 1, H] and
        fused features [B, 1, H] of its last valid entry (the root's), the cache). Its first E
        entries in one pass, unless a row has queued more (`defer`): then pieces of `piece`
        entries, as many as the longest queue."""
        start, last = head_len - (state.count - 1), state.count - 1

        def run(tokens, hidden, offset, last, cache):
            """Entries [offset, offset + T) of the chunk (tokens [B, T], hidden [B, T, 3H])."""
            positions = (start + offset)[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
            fused = fuse_stacked(head, hidden, impl="auto", sharding=self.sharding)
            logits, out, cache = draft_extend(
                self.dcfg,
                head,
                embed,
                cache,
                tokens,
                fused,
                positions,
                start + offset,
                active=active,
                sharding=self.sharding,
                last=last,
            )
            return logits, out, jnp.take_along_axis(fused, last[:, None, None], axis=1), cache

        width = state.tokens.shape[1]
        narrow = width - self.backlog

        def features(offset, size: int) -> jax.Array:
            """hidden [B, size, 3H] of entries [offset, offset + size), zeros past the chunk's E."""
            entries = offset + jnp.arange(size)
            return state.hidden.at[_feature_rows(state)[:, None], entries[None, :]].get(mode="fill", fill_value=0)

        def first_entries():
            hidden = state.hidden[:, :narrow] if state.rows is None else features(0, narrow)
            return run(state.tokens[:, :narrow], hidden, 0, last, cache)

        if not self.defers:
            return first_entries()

        size, padded = piece_layout(width, self.piece or queue_piece(self.dcfg))

        def in_pieces():
            tokens = jnp.pad(state.tokens, ((0, 0), (0, padded - width)))

            def run_piece(i, carry):
                logits, out, root_hidden, cache = carry
                offset = i * size
                new_logits, new_out, new_root_hidden, cache = run(
                    jax.lax.dynamic_slice_in_dim(tokens, offset, size, axis=1),
                    features(offset, size),
                    offset,
                    jnp.clip(last - offset, 0, size - 1),
                    cache,
                )
                mine = (last // size == i)[:, None, None]  # the piece holding the row's last entry
                return (
                    jnp.where(mine, new_logits, logits),
                    jnp.where(mine, new_out, out),
                    jnp.where(mine, new_root_hidden, root_hidden),
                    cache,
                )

            needed = (jnp.max(jnp.where(active, state.count, 1)) + size - 1) // size
            first = run(tokens[:, :size], features(0, size), 0, jnp.minimum(last, size - 1), cache)
            return jax.lax.fori_loop(1, needed, run_piece, first)

        queued = jnp.any(active & (state.count > narrow))
        return jax.lax.cond(queued, in_pieces, first_entries)

    def update(self, dparams, state: HeadState, verified: Verified) -> HeadState:
        stacked = stack_aux(self.dcfg, dparams["head"], verified.hidden)  # [B, E, 3H]: the committed tokens'
        active, width = verified.active, stacked.shape[1]  # the chunk's first E entries (a backlog's are unread)
        # The inactive rows are dropped by index: an update that also read the chunk it writes (a
        # select against it) could not be done in place and would copy the whole [B, E, 3H] chunk.
        rows = jnp.where(active, jnp.arange(active.shape[0]), active.shape[0])
        feature_rows = jnp.where(active, _feature_rows(state), state.hidden.shape[0])
        return state._replace(
            tokens=state.tokens.at[rows, :width].set(new_tokens(verified), mode="drop"),
            hidden=state.hidden.at[feature_rows, :width].set(stacked, mode="drop"),
            count=jnp.where(active, verified.num_accepted + 1, state.count),
        )

    def defer(self, dparams, state: HeadState, verified: Verified) -> HeadState:
        """The state after an autoregressive iteration that ran no `propose`: its one new entry
        (the old root's features with the new root) appended to the pending chunk. The adaptive
        loop drafts at least every `backlog` iterations, so the chunk never overflows."""
        stacked = stack_aux(self.dcfg, dparams["head"], verified.hidden[:, :, :1])[:, 0]  # [B, 3H]
        return self.queue(state, new_tokens(verified)[:, 0], stacked, verified.active)

    @staticmethod
    def queue(state: HeadState, tokens: jax.Array, hidden: jax.Array, append: jax.Array) -> HeadState:
        """state with one entry (tokens int32 [B], stacked features hidden [B, 3H]) appended to the
        pending chunk of the rows where append (bool [B])."""
        rows = jnp.arange(state.count.shape[0])
        slot = jnp.where(append, state.count, state.tokens.shape[1])  # out of range: dropped
        return state._replace(
            tokens=state.tokens.at[rows, slot].set(tokens, mode="drop"),
            hidden=state.hidden.at[_feature_rows(state), slot].set(hidden, mode="drop"),
            count=state.count + append.astype(jnp.int32),
        )

    @staticmethod
    def one_entry(state: HeadState) -> HeadState:
        """An empty pending chunk of one entry per row, shaped as state's (whose features are its
        own rows: `rows` None): `defer` on it leaves the entry it queues at index 0 (count 1), for
        `queue` to append to state's own chunk."""
        return state._replace(tokens=state.tokens[:, :1], hidden=state.hidden[:, :1], count=jnp.zeros_like(state.count))

    def _constrain(self, buf: jax.Array) -> jax.Array:
        return constrain(self.sharding, buf, KV_CACHE_AXES)

    def _constrain_cache(self, cache: KVCache) -> KVCache:
        return jax.tree.map(self._constrain, cache)
