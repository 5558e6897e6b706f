"""The drafters' state on the slot engine, one entry per decode slot.

The staged loop makes a drafter's state once for all rows (`Drafter.init` after the prefill);
on the slot engine rows come and go, so each drafter's state is made empty for S slots
(`empty_state`), written chunk by chunk in the prefill lanes (`prefill_hook`) and started when a
slot's context is complete (`start_hook`), as `init` would leave it for that row:

* EAGLE-3 (`eagle3.HeadState`): the head's KV is a one-layer paged cache on the policy's page
  tables (entry j at position j). A prefill chunk writes entries j of its positions (the fused
  policy features at j with context token j + 1); the start leaves the root's entry pending.
* draft model (`draft_model.Pending`): its KV is a paged cache of its own layers on the policy's
  page tables; a prefill chunk runs the chunk's tokens through it; the start leaves the root
  pending.
* n-gram (`ngram.History`): the start copies the slot's context (prompt, tokens so far, the root)
  into its history row; nothing to prefill.
* group suffix (`drafter.Pooled`: the slot's row of the call, and the call-wide
  `suffix.SuffixPool`): the carry keeps the row (set at the start); the pool is not carried but
  made for every step from the carry's tokens and the prompts (`call_pool`): each row's prompt and
  tokens so far by its index in the call, so a slot reads the rows of its GRPO group that run
  beside it, have finished or wait preempted, as far as they have come.
* hybrid (`Pooled` of `hybrid.HybridRows`): the head's part as EAGLE-3, the suffix row as the
  suffix drafter's; the start resets the running rates of the two sources to 1 (an even split).

The pages a slot holds cover the draft's positions as well as the policy's, so the drafts share
a prompt's prefix pages with it (`jaxspec.rollout.prefix_cache`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.draft import draft_extend, fuse, stack_aux
from jaxspec.models.config import ModelConfig
from jaxspec.models.transformer import extend
from jaxspec.rollout.continuous import empty_cache
from jaxspec.rollout.slot_layout import Layout
from jaxspec.rollout.slot_state import LoopState, Prompts, rows_of
from jaxspec.rollout.slots import context_tokens
from jaxspec.rollout.speculative.draft_model import DraftModelDrafter, Pending
from jaxspec.rollout.speculative.drafter import Pooled
from jaxspec.rollout.speculative.eagle3 import Eagle3Drafter, HeadState
from jaxspec.rollout.speculative.hybrid import HybridDrafter, HybridRows
from jaxspec.rollout.speculative.ngram import History, NgramDrafter
from jaxspec.rollout.speculative.suffix import SuffixDrafter, SuffixPool


def draft_kv_config(drafter) -> ModelConfig | None:
    """The shapes (layers, KV heads, head dim) of the drafter's own page pools; None for the n-gram
    and suffix drafters, which have none."""
    if isinstance(drafter, (NgramDrafter, SuffixDrafter)):
        return None
    if isinstance(drafter, HybridDrafter):
        return drafter.head.dcfg.layer_config
    return drafter.dcfg.layer_config if isinstance(drafter, Eagle3Drafter) else drafter.cfg


def _hybrid_rows(drafter: HybridDrafter, head, suffix_rows: jax.Array) -> HybridRows:
    """A hybrid state's rows as `HybridDrafter.init` leaves them, for rows suffix_rows int32 [S]."""
    slots, size = suffix_rows.shape[0], 1 + drafter.depth * drafter.branch_width
    return HybridRows(
        head=head,
        suffix_rows=suffix_rows,
        rates=jnp.ones((slots, 2), jnp.float32),
        tokens=jnp.zeros((slots, 2, size), jnp.int32),
        parents=jnp.zeros((slots, 2, size), jnp.int32),
        num_nodes=jnp.ones((slots, 2), jnp.int32),
    )


def empty_state(drafter, dparams, layout: Layout, context_len: int, cache_dtype):
    """The drafter's state for one group's slots (`layout.group()`), none started. context_len: the
    longest context a slot holds (the n-gram history's width)."""
    slots = layout.group().slots
    if isinstance(drafter, NgramDrafter):
        return History(tokens=jnp.zeros((slots, context_len), jnp.int32), length=jnp.ones((slots,), jnp.int32))
    if isinstance(drafter, SuffixDrafter):
        return Pooled(rows=jnp.zeros((slots,), jnp.int32), pool=None)
    if isinstance(drafter, HybridDrafter):
        head = empty_state(drafter.source_drafters()[0], dparams.head, layout, context_len, cache_dtype)
        return Pooled(rows=_hybrid_rows(drafter, head, jnp.zeros((slots,), jnp.int32)), pool=None)
    tokens, count = jnp.zeros((slots, drafter.chunk), jnp.int32), jnp.ones((slots,), jnp.int32)
    if isinstance(drafter, DraftModelDrafter):
        return Pending(cache=empty_cache(drafter.cfg, layout, cache_dtype), tokens=tokens, count=count)
    dcfg = drafter.dcfg
    hidden = jnp.zeros((slots, drafter.chunk, 3 * dcfg.hidden_size), dparams["head"]["fc"].dtype)  # `stack_aux`'s
    return HeadState(
        cache=empty_cache(dcfg.layer_config, layout, cache_dtype), tokens=tokens, hidden=hidden, count=count
    )


def call_pool(layout: Layout, state: LoopState, prompts: Prompts) -> SuffixPool:
    """The call-wide `SuffixPool` of every group's carry (`jaxspec.rollout.slot_state`): row r's
    prompt, then its tokens so far (the last one the root of a decoding row), int32 [B, P + N]."""
    tokens, emitted = rows_of(layout, state.tokens), rows_of(layout, state.lengths)
    every = Prompts(prompts.tokens, prompts.lengths, *(rows_of(layout, x) for x in prompts[2:]))
    num_rows, width = tokens.shape[0], prompts.tokens.shape[1] + tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (num_rows, width))
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    return SuffixPool(
        tokens=context_tokens(every, tokens, rows, positions),
        length=every.row_lengths + emitted,
        prompt_length=every.row_lengths,
    )


def with_call_pool(state, pool: SuffixPool | None):
    """A `Pooled` state with `pool` as its call-wide pool (None: as the carry keeps it); other
    states as they are."""
    return state._replace(pool=pool) if isinstance(state, Pooled) else state


def without_pools(state):
    """(the state's per-slot part, its pools): the drafter's state split for a step on some of the
    slots (`jaxspec.rollout.slot_width`): every leaf of the first has the slots first; the second
    is (k, v) of its paged cache, () for the n-gram history and the suffix rows, and (those, the
    call-wide pool) for a `Pooled` state."""
    if isinstance(state, Pooled):
        rows, pools = without_pools(state.rows.head) if isinstance(state.rows, HybridRows) else (state.rows, ())
        rows = state.rows._replace(head=rows) if isinstance(state.rows, HybridRows) else rows
        return Pooled(rows, None), (pools, state.pool)
    if isinstance(state, History):
        return state, ()
    return state._replace(cache=None), (state.cache.k, state.cache.v)


def with_pools(per_slot, stored, pools, page_table: jax.Array | None = None):
    """`without_pools` undone: the per-slot part with the pools in the stored state's paged cache,
    on `page_table` int32 [S', M] if given (else the stored table)."""
    if isinstance(per_slot, Pooled):
        rows = per_slot.rows
        if isinstance(rows, HybridRows):
            rows = rows._replace(head=with_pools(rows.head, stored.rows.head, pools[0], page_table))
        return Pooled(rows, pools[1])
    if isinstance(per_slot, History):
        return per_slot
    cache = stored.cache._replace(k=pools[0], v=pools[1])
    return per_slot._replace(cache=cache if page_table is None else cache._replace(page_table=page_table))


def _head_part(state):
    """The EAGLE-3 head's part of a drafter's per-slot state (a hybrid's head, or the state itself),
    which `_with_kv_part` puts back."""
    return state.rows.head if isinstance(state, Pooled) and isinstance(state.rows, HybridRows) else state


def without_chunk(per_slot):
    """(per_slot, features): the EAGLE-3 head's pending features [S, E, 3H] (its own or a hybrid's
    head's) taken out of a drafter's per-slot state, which keeps None there; (per_slot, None) for
    the other drafters. A step on W of the S slots (`jaxspec.rollout.slot_width`) then reads and
    writes its slots' entries where they lie (`with_chunk`), where carrying the chunk would gather
    and scatter all of it, most of it a backlog's room that the step does not read."""
    head = _head_part(per_slot)
    if not isinstance(head, HeadState):
        return per_slot, None
    return _with_kv_part(per_slot, head._replace(hidden=None, rows=None)), head.hidden


def with_chunk(per_slot, features: jax.Array | None, slots: jax.Array | None = None):
    """`without_chunk` undone: the per-slot state (of W slots) with the features [S, E, 3H] of all S
    slots, its rows being slots int32 [W] of them (None: W = S, in order)."""
    if features is None:
        return per_slot
    rows = None if slots is None or slots.shape[0] == features.shape[0] else slots
    return _with_kv_part(per_slot, _head_part(per_slot)._replace(hidden=features, rows=rows))


def _kv_part(drafter, dparams, state):
    """(drafter, dparams, state) of the part of a drafter with a paged cache: a hybrid's head."""
    if isinstance(drafter, HybridDrafter):
        return drafter.source_drafters()[0], dparams.head, state.rows.head
    return drafter, dparams, state


def _with_kv_part(state, part):
    """`_kv_part`'s state put back."""
    return state._replace(rows=state.rows._replace(head=part)) if isinstance(state, Pooled) else part


def prefill_hook(drafter, dparams):
    """on_prefill(state, lanes, hidden) -> state for `slots.prefill_chunk` (every group's lanes in a
    row): the draft's KV of the chunk's positions; None for the n-gram and suffix drafters."""
    if isinstance(drafter, (NgramDrafter, SuffixDrafter)):
        return None

    def on_prefill(state, lanes, hidden):
        spec = state.draft
        kv_drafter, kv_params, part = _kv_part(drafter, dparams, spec.draft)
        view = part.cache._replace(page_table=lanes.table)
        if isinstance(kv_drafter, DraftModelDrafter):
            _, _, cache = extend(
                kv_drafter.cfg, kv_params, view, lanes.tokens, lanes.positions, lanes.start, active=lanes.valid
            )
        else:  # EAGLE-3: entry j pairs the fused features at j with token j + 1
            head = kv_params["head"]
            hidden_in = fuse(kv_drafter.dcfg, head, hidden)
            _, _, cache = draft_extend(
                kv_drafter.dcfg,
                head,
                kv_params["embed"],
                view,
                lanes.next_tokens,
                hidden_in,
                lanes.positions,
                lanes.start,
                active=lanes.valid,
            )
        part = part._replace(cache=part.cache._replace(k=cache.k, v=cache.v))
        return state._replace(draft=spec._replace(draft=_with_kv_part(spec.draft, part)))

    return on_prefill


def start_hook(drafter, dparams, layout: Layout):
    """on_start(state, prompts, started, first, hidden_last) -> state for `slots.prefill_chunk`
    (one group's, of `layout`: a group's layout): the started slots' state as `Drafter.init`
    leaves a row whose root is `first`."""

    def on_start(state, prompts, started, first, hidden_last):
        spec = state.draft
        row = jnp.clip(state.row, 0, layout.rows - 1)

        def pick(new, current):
            return jnp.where(started.reshape(-1, *([1] * (new.ndim - 1))), new, current)

        def start(drafter, dparams, old):
            if isinstance(drafter, NgramDrafter):
                width = old.tokens.shape[1]
                length = state.ctx_len + 1  # the context, then the root (already emitted)
                positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (layout.slots, width))
                history = jnp.where(
                    positions < length[:, None], context_tokens(prompts, state.tokens, row, positions), 0
                )
                return History(tokens=pick(history, old.tokens), length=pick(length, old.length))
            if isinstance(drafter, SuffixDrafter):  # the slot's row by its index in the call
                return old._replace(rows=pick(state.first_row + row, old.rows))
            if isinstance(drafter, HybridDrafter):
                head = start(drafter.source_drafters()[0], dparams.head, old.rows.head)
                fresh = _hybrid_rows(drafter, head, state.first_row + row)
                per_slot = {f: pick(getattr(fresh, f), getattr(old.rows, f)) for f in HybridRows._fields[1:]}
                return old._replace(rows=HybridRows(head=head, **per_slot))
            tokens = pick(jnp.zeros_like(old.tokens).at[:, 0].set(first), old.tokens)
            new = old._replace(tokens=tokens, count=pick(jnp.ones_like(old.count), old.count))
            if isinstance(drafter, Eagle3Drafter):
                root_hidden = stack_aux(drafter.dcfg, dparams["head"], hidden_last[:, :, None])[:, 0]  # [S, 3H]
                # Only the started slots' entry 0 of the features is written: no result depends on an
                # entry at or past the count (once a chunk has run, its later entries hold earlier steps'
                # anyway). The rows not started are dropped by index rather than kept by a select: an
                # update that also reads the [S, E, 3H] chunk cannot be made in place, and would
                # rewrite the whole chunk at every start.
                slot = jnp.where(started, jnp.arange(layout.slots), layout.slots)
                new = new._replace(hidden=old.hidden.at[slot, 0].set(root_hidden, mode="drop"))
            return new

        return state._replace(draft=spec._replace(draft=start(drafter, dparams, spec.draft)))

    return on_start
