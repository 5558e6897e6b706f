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

The pages a slot holds cover the draft's positions as well as the policy's, so the drafts share
a prompt's prefix pages with it (`jaxspec.rollout.prefix_cache`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.draft import draft_extend, fuse
from jaxspec.models.config import ModelConfig
from jaxspec.models.transformer import extend
from jaxspec.rollout.continuous import empty_cache
from jaxspec.rollout.slot_layout import Layout
from jaxspec.rollout.slots import context_tokens
from jaxspec.rollout.speculative.draft_model import DraftModelDrafter, Pending
from jaxspec.rollout.speculative.eagle3 import Eagle3Drafter, HeadState
from jaxspec.rollout.speculative.ngram import History, NgramDrafter


def draft_kv_config(drafter) -> ModelConfig | None:
    """The shapes (layers, KV heads, head dim) of the drafter's own page pools; None for the n-gram
    drafter, which has none."""
    if isinstance(drafter, NgramDrafter):
        return None
    return drafter.dcfg.layer_config if isinstance(drafter, Eagle3Drafter) else drafter.cfg


def empty_state(drafter, dparams, layout: Layout, context_len: int, cache_dtype):
    """The drafter's state for one group's slots (`layout.group()`), none started. context_len: the
    longest context a slot holds (the n-gram history's width)."""
    slots = layout.group().slots
    if isinstance(drafter, NgramDrafter):
        return History(tokens=jnp.zeros((slots, context_len), jnp.int32), length=jnp.ones((slots,), jnp.int32))
    tokens, count = jnp.zeros((slots, drafter.chunk), jnp.int32), jnp.ones((slots,), jnp.int32)
    if isinstance(drafter, DraftModelDrafter):
        return Pending(cache=empty_cache(drafter.cfg, layout, cache_dtype), tokens=tokens, count=count)
    dcfg = drafter.dcfg
    hidden = jnp.zeros((slots, drafter.chunk, dcfg.hidden_size), dparams["head"]["fc"].dtype)  # `fuse`'s dtype
    return HeadState(
        cache=empty_cache(dcfg.layer_config, layout, cache_dtype), tokens=tokens, hidden=hidden, count=count
    )


def with_table(state, page_table: jax.Array):
    """The state with its paged cache (if any) on `page_table` int32 [S', M]."""
    if isinstance(state, History):
        return state
    return state._replace(cache=state.cache._replace(page_table=page_table))


def without_pools(state):
    """(the state's per-slot part, its page pools): the drafter's state split for a step on some
    of the slots (`jaxspec.rollout.slot_width`): every leaf of the first has the slots first; the
    second is (k, v) of its paged cache, () for the n-gram history."""
    if isinstance(state, History):
        return state, ()
    return state._replace(cache=None), (state.cache.k, state.cache.v)


def with_pools(per_slot, stored, pools, page_table: jax.Array | None = None):
    """`without_pools` undone: the per-slot part with the pools in the stored state's paged cache,
    on `page_table` int32 [S', M] if given (else the stored table)."""
    if isinstance(per_slot, History):
        return per_slot
    cache = stored.cache._replace(k=pools[0], v=pools[1])
    return per_slot._replace(cache=cache if page_table is None else cache._replace(page_table=page_table))


def prefill_hook(drafter, dparams):
    """on_prefill(state, lanes, hidden) -> state for `slots.prefill_chunk` (every group's lanes in a
    row): the draft's KV of the chunk's positions; None for the n-gram drafter."""
    if isinstance(drafter, NgramDrafter):
        return None

    def on_prefill(state, lanes, hidden):
        spec = state.draft
        view = with_table(spec.draft, lanes.table).cache
        if isinstance(drafter, DraftModelDrafter):
            _, _, cache = extend(
                drafter.cfg, dparams, view, lanes.tokens, lanes.positions, lanes.start, active=lanes.valid
            )
        else:  # EAGLE-3: entry j pairs the fused features at j with token j + 1
            head = dparams["head"]
            hidden_in = fuse(drafter.dcfg, head, hidden)
            _, _, cache = draft_extend(
                drafter.dcfg,
                head,
                dparams["embed"],
                view,
                lanes.next_tokens,
                hidden_in,
                lanes.positions,
                lanes.start,
                active=lanes.valid,
            )
        draft = spec.draft._replace(cache=spec.draft.cache._replace(k=cache.k, v=cache.v))
        return state._replace(draft=spec._replace(draft=draft))

    return on_prefill


def start_hook(drafter, dparams, layout: Layout):
    """on_start(state, prompts, started, first, hidden_last) -> state for `slots.prefill_chunk`
    (one group's, of `layout`: a group's layout): the started slots' state as `Drafter.init`
    leaves a row whose root is `first`."""

    def on_start(state, prompts, started, first, hidden_last):
        spec = state.draft
        old = spec.draft

        def pick(new, current):
            return jnp.where(started.reshape(-1, *([1] * (new.ndim - 1))), new, current)

        if isinstance(drafter, NgramDrafter):
            width = old.tokens.shape[1]
            row = jnp.clip(state.row, 0, layout.rows - 1)
            length = state.ctx_len + 1  # the context, then the root (already emitted)
            positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (layout.slots, width))
            history = jnp.where(positions < length[:, None], context_tokens(prompts, state.tokens, row, positions), 0)
            new = History(tokens=pick(history, old.tokens), length=pick(length, old.length))
        else:
            tokens = pick(jnp.zeros_like(old.tokens).at[:, 0].set(first), old.tokens)
            new = old._replace(tokens=tokens, count=pick(jnp.ones_like(old.count), old.count))
            if isinstance(drafter, Eagle3Drafter):
                root_hidden = fuse(drafter.dcfg, dparams["head"], hidden_last[:, :, None])[:, 0]  # [S, H]
                hidden = jnp.zeros_like(old.hidden).at[:, 0].set(root_hidden.astype(old.hidden.dtype))
                new = new._replace(hidden=pick(hidden, old.hidden))
        return state._replace(draft=spec._replace(draft=new))

    return on_start
