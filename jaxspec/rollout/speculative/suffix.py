"""Group-suffix drafting: propose what followed the longest match of a row's last tokens in the
row itself, in the other rows of its GRPO group and in earlier answers to the same prompt.

Sources. Every row is matched against (1) its own prompt + response (the root last), (2) the
prompt + response so far of each other row of its group (`group_rows`; continuations that start in
the shared prompt are left to (1)) and (3) the group's H earlier responses (`SuffixHistory`, kept
by the trainer per prompt across steps). The siblings' tokens live in a call-wide pool that the
loop keeps out of its stage moves, so a row still reads the siblings that finished before it.

Drafting. The match length at a source position j is the number of tokens ending at j that equal
the row's last tokens (at most `max_match`). The candidates are the positions with the row's
longest match (at least 1 token), the first `num_candidates` of them in source order (own row,
siblings, history; positions ascending). Their continuations (up to `depth` tokens, ending where
their source ends) form a trie in which every node counts the candidates whose continuation
starts with the node's path. Below each node the `width` most frequent children are eligible (ties:
the child first reached by a candidate); the tree keeps the `num_nodes` eligible nodes of largest
count (ties: shallower, then first reached). A chain (width 1) is the most frequent continuation,
token by token. A row without a match drafts nothing that step.

Cost per step and row, T = S * G + H * L source slots (S: the loop's token slots, G: group rows,
L: history length): `max_match` compares over the T slots, two small top-ks for the first
`num_candidates` longest matches (`first_longest`), and O(num_candidates^2 * depth) for the trie;
memory T int32 per row for the gathered sources.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.rollout.speculative.drafter import Pooled, Prefill, Verified, new_tokens
from jaxspec.rollout.speculative.tree import DraftTree, best_nodes, select_nodes


class SuffixHistory(NamedTuple):
    """Earlier responses to the prompts of one call: Q groups (in the order of their first row),
    H responses of up to L tokens each.

    tokens: int32 [Q, H, L] (slots past a response's length unused). lengths: int32 [Q, H]
        (0 = no response in that slot).
    """

    tokens: jax.Array
    lengths: jax.Array


class SuffixSources(NamedTuple):
    """What the suffix drafter reads besides the loop's tokens (its `dparams`), B rows of the call.

    history: `SuffixHistory` [Q, H, L]. row_group: int32 [B] the group of each row (index into
    history). siblings: int32 [B, G - 1] the other rows of each row's group (-1 past the group).
    """

    history: SuffixHistory
    row_group: jax.Array
    siblings: jax.Array


class SuffixPool(NamedTuple):
    """Every row of the call by its original index: tokens int32 [B, S] (prompt, then each committed
    token, the root last), length int32 [B] (root included), prompt_length int32 [B]."""

    tokens: jax.Array
    length: jax.Array
    prompt_length: jax.Array


def group_rows(row_prompt: np.ndarray, group_size: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """Groups of rows carrying the same prompt (host side, from `PromptBatch.row_prompt` int [B]).

    The rows of one prompt, in row order, fall into consecutive groups of `group_size` rows
    (None: one group per prompt). Returns (row_group int32 [B], groups numbered in the order of
    their first row; siblings int32 [B, G - 1], the other rows of the group, -1 padded, G the
    largest group; the number of groups).
    """
    row_prompt = np.asarray(row_prompt)
    seen: dict[int, int] = {}
    keys = []
    for p in row_prompt.tolist():
        occurrence = seen.get(p, 0)
        seen[p] = occurrence + 1
        keys.append((p, occurrence // group_size if group_size else 0))
    number: dict[tuple[int, int], int] = {}
    row_group = np.array([number.setdefault(k, len(number)) for k in keys], np.int32)
    members = [np.flatnonzero(row_group == g) for g in range(len(number))]
    size = max(len(m) for m in members)
    siblings = np.full((len(row_prompt), max(size - 1, 0)), -1, np.int32)
    for m in members:
        for r in m:
            others = m[m != r]
            siblings[r, : len(others)] = others
    return row_group, siblings, len(number)


def suffix_sources(
    history: SuffixHistory | None, row_prompt: np.ndarray, group_size: int | None, vocab_size: int
) -> SuffixSources:
    """The suffix drafter's `SuffixSources` for a call whose rows carry `row_prompt` int [B]
    (`PromptBatch.row_prompt`), grouped by `group_rows`. history: one entry per group, or None
    (no earlier responses). Raises ValueError naming what in `history` does not fit the call."""
    row_group, siblings, num_groups = group_rows(row_prompt, group_size)
    if history is None:
        history = SuffixHistory(np.zeros((num_groups, 0, 1), np.int32), np.zeros((num_groups, 0), np.int32))
    tokens, lengths = np.asarray(history.tokens), np.asarray(history.lengths)
    if tokens.ndim != 3 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"Spec.draft (SuffixHistory).tokens must be integers [groups, H, L], got {tokens.dtype} {tokens.shape}"
        )
    if lengths.shape != tokens.shape[:2] or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(
            f"Spec.draft (SuffixHistory).lengths must be integers of shape {tokens.shape[:2]} (groups, H), "
            f"got {lengths.dtype} {lengths.shape}"
        )
    if tokens.shape[0] != num_groups:
        raise ValueError(
            f"Spec.draft (SuffixHistory) holds {tokens.shape[0]} groups, the call has {num_groups} "
            f"(rows carrying one prompt, {group_size or 'all'} rows per group)"
        )
    if lengths.size and (lengths.min() < 0 or lengths.max() > tokens.shape[2]):
        raise ValueError(f"Spec.draft (SuffixHistory).lengths must lie in [0, {tokens.shape[2]}] (L)")
    used = np.arange(tokens.shape[2])[None, None, :] < lengths[:, :, None]
    bad = used & ((tokens < 0) | (tokens >= vocab_size))
    if bad.any():
        q, h, i = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"Spec.draft (SuffixHistory).tokens[{q}, {h}, {i}] = {int(tokens[q, h, i])} is outside the "
            f"vocabulary [0, {vocab_size})"
        )
    return SuffixSources(
        history=SuffixHistory(jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32)),
        row_group=jnp.asarray(row_group),
        siblings=jnp.asarray(siblings),
    )


@dataclasses.dataclass(frozen=True)
class SuffixDrafter:
    """max_match: longest suffix matched; num_candidates: matches whose continuations form the
    trie. depth, width, num_nodes: the tree's shape (`SpecConfig`). dparams: `SuffixSources`."""

    max_match: int
    num_candidates: int
    depth: int
    width: int
    num_nodes: int
    policy_layers: tuple[int, ...] = ()
    propose_keeps_state = True  # `propose` returns its state as it was (an autoregressive step may skip it)

    def init(self, sources: SuffixSources, prefill: Prefill) -> Pooled:
        prompts = jnp.take(prefill.prompt_tokens, prefill.row_prompt, axis=0)
        batch = prompts.shape[0]
        tokens = jnp.zeros((batch, prefill.max_len), jnp.int32).at[:, : prompts.shape[1]].set(prompts)
        rows = jnp.arange(batch, dtype=jnp.int32)
        tokens = tokens.at[rows, prefill.row_lengths].set(prefill.first_token)
        pool = SuffixPool(tokens=tokens, length=prefill.row_lengths + 1, prompt_length=prefill.row_lengths)
        return Pooled(rows=rows, pool=pool)

    def propose(
        self, sources: SuffixSources, state: Pooled, root: jax.Array, cache_len: jax.Array, active, key
    ) -> tuple[Pooled, DraftTree]:
        flat, start, end, can_end = _gather_sources(sources, state.pool, state.rows)
        length = state.pool.length[state.rows]
        own = state.pool.tokens[state.rows]
        back = length[:, None] - 1 - jnp.arange(self.max_match, dtype=jnp.int32)[None, :]
        context = jnp.where(back >= 0, jnp.take_along_axis(own, jnp.maximum(back, 0), axis=1), -2)
        matched = match_lengths(flat, start, can_end, context)
        tree = self._tree(flat, end, matched, root)
        return state, tree

    def _tree(self, flat: jax.Array, end: jax.Array, matched: jax.Array, root: jax.Array) -> DraftTree:
        batch, slots = flat.shape
        num_cand, depth = min(self.num_candidates, slots), self.depth
        found, position = first_longest(matched, num_cand)
        offsets = position[:, :, None] + 1 + jnp.arange(depth, dtype=jnp.int32)[None, None, :]  # [B, C, D]
        cont = jnp.take_along_axis(flat, jnp.minimum(offsets, slots - 1).reshape(batch, -1), axis=1)
        cont = cont.reshape(batch, num_cand, depth)
        valid = found[:, :, None] & (offsets < jnp.take_along_axis(end, position, axis=1)[:, :, None])
        # same[b, c, c2, d]: candidates c and c2 share their first d + 1 continuation tokens.
        equal = (cont[:, :, None] == cont[:, None, :]) & valid[:, :, None] & valid[:, None, :]
        same = jnp.cumprod(equal.astype(jnp.int32), axis=-1).astype(bool)
        count = same.sum(axis=2, dtype=jnp.int32)  # [B, C, D]: the node's count
        first = jnp.argmax(same, axis=2).astype(jnp.int32)  # the candidate that represents the node
        cands = jnp.arange(num_cand, dtype=jnp.int32)
        is_node = valid & (first == cands[None, :, None])
        same_parent = jnp.concatenate(
            [(valid[:, :, None, :1] & valid[:, None, :, :1]), same[..., :-1]], axis=-1
        )  # [B, C, C2, D]
        c_count, o_count = count[:, :, None], count[:, None, :]
        before = (o_count > c_count) | (
            (o_count == c_count) & (cands[None, None, :, None] < cands[None, :, None, None])
        )
        rank = jnp.sum(is_node[:, None] & same_parent & before, axis=2)
        level_ok = is_node & (rank < self.width)
        eligible, parent_ok = [], jnp.ones((batch, num_cand), bool)
        for d in range(depth):
            if d:
                parent_ok = jnp.take_along_axis(eligible[-1], first[:, :, d - 1], axis=1)
            eligible.append(level_ok[:, :, d] & parent_ok)
        # Candidate node 1 + d * C + c: candidate c's continuation token d (depth-major).
        eligible = jnp.stack(eligible, axis=1)  # [B, D, C]
        scores = jnp.where(eligible, count.transpose(0, 2, 1).astype(jnp.float32), -jnp.inf).reshape(batch, -1)
        ones = jnp.ones((batch, 1), jnp.float32)
        scores = jnp.concatenate([ones, scores], axis=1)
        parent_of = 1 + jnp.arange(depth, dtype=jnp.int32)[None, :, None] * num_cand + first.transpose(0, 2, 1)
        parents = jnp.concatenate([jnp.zeros((batch, 1, num_cand), jnp.int32), parent_of[:, :-1]], axis=1)
        levels = np.concatenate([[0], np.repeat(np.arange(1, depth + 1), num_cand)]).astype(np.int32)
        return select_nodes(
            keep=best_nodes(scores, self.num_nodes),
            tokens=jnp.concatenate([root[:, None], cont.transpose(0, 2, 1).reshape(batch, -1)], axis=1),
            parents=jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), parents.reshape(batch, -1)], axis=1),
            depth=jnp.broadcast_to(jnp.asarray(levels), (batch, levels.size)),
            num_out=1 + self.num_nodes,
            scores=scores,
        )

    def update(self, sources: SuffixSources, state: Pooled, verified: Verified) -> Pooled:
        pool = state.pool
        batch, width = verified.committed.shape
        steps = jnp.arange(width, dtype=jnp.int32)[None, :]
        length = pool.length[state.rows]
        write = verified.active[:, None] & (steps <= verified.num_accepted[:, None])
        slots = jnp.where(write, length[:, None] + steps, pool.tokens.shape[1])
        rows = jnp.where(verified.active, state.rows, pool.tokens.shape[0])
        grown = length + jnp.where(verified.active, verified.num_accepted + 1, 0)
        return state._replace(
            pool=pool._replace(
                tokens=pool.tokens.at[rows[:, None], slots].set(new_tokens(verified), mode="drop"),
                length=pool.length.at[rows].set(grown, mode="drop"),
            )
        )


def _gather_sources(sources: SuffixSources, pool: SuffixPool, rows: jax.Array):
    """Each loop row's sources side by side in T slots: its own tokens, its siblings' (S each),
    then its group's history (L each).

    Returns (flat int32 [b, T]; start int32 [T]: the slot where each slot's source begins;
    end int32 [b, T]: where it ends (exclusive); can_end bool [b, T]: slots where a match may
    end (a continuation follows in the source; siblings: it starts in their response)).
    """
    siblings = sources.siblings[rows]  # [b, G - 1]
    has = siblings >= 0
    sib = jnp.maximum(siblings, 0)
    group = sources.row_group[rows]
    history = sources.history.tokens[group]  # [b, H, L]
    streams = [pool.tokens[rows][:, None], pool.tokens[sib], history]
    own_len = pool.length[rows]
    lengths = [own_len[:, None], jnp.where(has, pool.length[sib], 0), sources.history.lengths[group]]
    # Earliest match end: own row and history anywhere, siblings where their response starts.
    firsts = [jnp.zeros_like(own_len)[:, None], jnp.where(has, pool.prompt_length[sib] - 1, 0), 0 * lengths[2]]
    flat, start, end, can_end = [], [], [], []
    offset = 0
    for stream, n, lo in zip(streams, lengths, firsts):
        b, count, width = stream.shape
        if count == 0:
            continue
        base = offset + width * np.arange(count, dtype=np.int32)  # [count]
        pos = np.arange(width, dtype=np.int32)
        flat.append(stream.reshape(b, -1))
        start.append(np.repeat(base, width))
        end.append((base[None, :] + n).repeat(width, axis=1))
        ok = (pos[None, None, :] >= lo[:, :, None]) & (pos[None, None, :] <= n[:, :, None] - 2)
        can_end.append(ok.reshape(b, -1))
        offset += count * width
    return (
        jnp.concatenate(flat, axis=1),
        jnp.asarray(np.concatenate(start)),
        jnp.concatenate(end, axis=1),
        jnp.concatenate(can_end, axis=1),
    )


MATCH_BLOCK = 128  # slots per block of `first_longest`'s first pass


def first_longest(matched: jax.Array, num: int, block: int = MATCH_BLOCK) -> tuple[jax.Array, jax.Array]:
    """The first `num` slots, in slot order, that hold their row's longest match (>= 1).

    matched: int32 [b, T] (`match_lengths`). Returns (found bool [b, num], position int32 [b, num]):
    the slots in ascending order, found false past the last one (position then any slot < T). The
    same slots as `lax.top_k(matched, num)` keeps where its value equals the maximum, without a
    top-k over T slots (a sort on GPUs for int32): the first `num` hits lie in the first `num`
    blocks of `block` slots that hold one, so top-k runs over T / block block keys and
    num * block slots.
    """
    batch, slots = matched.shape
    blocks = -(-slots // block)
    longest = matched.max(axis=1, keepdims=True)
    hit = (matched == longest) & (longest >= 1)
    hit = jnp.pad(hit, ((0, 0), (0, blocks * block - slots))).reshape(batch, blocks, block)
    order = jnp.arange(blocks, 0, -1, dtype=jnp.int32)  # earlier blocks rank higher
    # Float keys (exact below 2^24) take the GPU's top-k kernel; distinct where they matter.
    _, picked = jax.lax.top_k(jnp.where(hit.any(axis=2), order, 0).astype(jnp.float32), min(num, blocks))
    candidates = hit[jnp.arange(batch)[:, None], picked].reshape(batch, -1)  # [b, nb * block]
    slot = (picked[:, :, None] * block + jnp.arange(block, dtype=jnp.int32)).reshape(batch, -1)
    rank = jnp.arange(candidates.shape[1], 0, -1, dtype=jnp.int32)
    _, first = jax.lax.top_k(jnp.where(candidates, rank, 0).astype(jnp.float32), num)
    found = jnp.take_along_axis(candidates, first, axis=1)
    return found, jnp.minimum(jnp.take_along_axis(slot, first, axis=1), slots - 1)


def match_lengths(flat: jax.Array, start: jax.Array, can_end: jax.Array, context: jax.Array) -> jax.Array:
    """int32 [b, T]: at every slot j where a match may end (can_end), the number of tokens ending at
    j, within j's source (from start [T]), equal to the row's last tokens (context int32 [b, M]:
    column i the i-th last token, -2 before the row's first); -1 elsewhere."""
    slots = flat.shape[1]
    position = jnp.arange(slots, dtype=jnp.int32)
    length = jnp.zeros(flat.shape, jnp.int32)
    alive = can_end
    for i in range(context.shape[1]):
        shifted = jnp.pad(flat, ((0, 0), (i, 0)), constant_values=-1)[:, :slots]  # flat[j - i]
        alive = alive & (position - i >= start)[None, :] & (shifted == context[:, i : i + 1])
        length = length + alive
    return jnp.where(can_end, length, -1)
