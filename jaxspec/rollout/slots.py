"""Continuous batching: every row of a call streams through S decode slots over a paged KV cache.

`generate(..., slots=S)` runs the whole rollout, prefill included, as ONE compiled
`jax.lax.while_loop` with static shapes: zero host round trips per step (the host waits once, for
the outputs). The pending-row queue, the free-page stack and the page tables are device arrays
(`jaxspec.rollout.page_pool`). Each iteration:

1. **room**: every decoding slot gets the pages its next step writes (`lookahead` positions past
   its length). When the free pages do not suffice, the prefix cache lets go of its pages
   and then, if still short, the newest rows are preempted
   (`page_pool.newest_to_evict`): their pages return to the pool and they go back to the front
   of the queue with their tokens so far. The oldest row is never preempted (one row's longest
   sequence always fits: checked before the loop), so every row finishes.
2. **admit**: free slots take the next pending rows, in queue order, while the pool holds the
   pages of their context (prompt + tokens so far) plus one step's pages for every running row;
   an admitted row whose prompt's prefix is cached takes its pages (`prefix_cache.attach`).
3. **decode**: one step of every decoding slot (a token, or a speculative draft-and-verify step).
4. **prefill**: a fixed-size chunk of `chunk` context tokens (the prompt bucket, at most
   `MAX_PREFILL_CHUNK`) of each of `lanes` admitted slots (the oldest first; `PREFILL_TOKENS`
   tokens in all) is written to the cache: prefill runs in chunks interleaved with decoding.
   The chunk that completes a context samples the row's next token from its last logits, and
   the slot decodes from the next iteration on. Prefixes written are cached
   (`prefix_cache.publish`).
5. **release**: slots whose row has finished return their pages to the pool, and the cache
   lets go of the prefixes of prompts whose rows have all finished.

A row resumed after preemption re-prefills its prompt and its tokens so far, then samples its
next token: exactly the distribution its next decode step had. Every draw of row r's token i
uses `fold_in(fold_in(key, r), i)`, whatever the slot, the slot count or preemptions, so in
float32 the same key gives the same tokens for any S (up to float rounding of batched matmuls).

Rows of one prompt (a GRPO group) share the pages of its prefix (`jaxspec.rollout.prefix_cache`):
it is prefilled once while rows of the prompt are live. Not yet: record_experts; laying the
pools out by `KV_CACHE_AXES` on a mesh (XLA propagates the params' sharding). The staged dense
engine (`jaxspec.rollout.engine`, slots=None) stays the default until GPU measurements show this
one faster everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.models.config import ModelConfig
from jaxspec.models.paged import NO_PAGE, PagedKVCache
from jaxspec.models.transformer import Params, extend, logits_from_hidden
from jaxspec.rollout import prefix_cache
from jaxspec.rollout.page_pool import PagePool, allocate, newest_to_evict, pages_for, release
from jaxspec.rollout.prefix_cache import PrefixCache
from jaxspec.rollout.sampling import Sampling, processed_logprobs, sample

DEFAULT_PAGE_SIZE = 16  # token positions per page
MAX_PREFILL_CHUNK = 256  # most context tokens one prefill lane writes per iteration
PREFILL_TOKENS = 512  # context tokens all prefill lanes write per iteration (at least one lane)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static shape of a slot loop (hashable: a `jax.jit` static argument).

    rows: B rows of the call; slots: S; max_new: N; page_size; pages_per_slot: M, page-table
    entries per slot; num_pages: the pool; chunk: context tokens per prefill lane and iteration;
    lanes: prefill lanes per iteration; lookahead: positions past its length one decode step
    writes (1 for autoregressive decoding, 1 + draft nodes for speculative steps); prefix_pages:
    the most pages a prompt's rows share (`jaxspec.rollout.prefix_cache`).
    """

    rows: int
    slots: int
    max_new: int
    page_size: int
    pages_per_slot: int
    num_pages: int
    chunk: int
    lanes: int
    lookahead: int
    prefix_pages: int


def plan_layout(
    rows: int,
    slots: int,
    prompt_width: int,
    longest_prompt: int,
    max_new: int,
    lookahead: int,
    *,
    page_size: int = DEFAULT_PAGE_SIZE,
    num_pages: int | None = None,
) -> Layout:
    """The loop's `Layout` for `rows` rows with prompts padded to `prompt_width` (the longest has
    `longest_prompt` tokens). num_pages: the pool (default: every slot's longest sequence, which
    never preempts). Raises ValueError naming the sizes when slots or page_size is not a positive
    integer, or when the pool cannot hold even one row's longest sequence."""
    for name, value in (("slots", slots), ("page_size", page_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    slots = min(slots, rows)
    per_slot = pages_for(prompt_width + max_new - 1 + lookahead, page_size)
    num_pages = slots * per_slot if num_pages is None else num_pages
    longest = longest_prompt + max_new - 1 + lookahead  # positions the longest row's last step writes
    if not isinstance(num_pages, int) or num_pages < pages_for(longest, page_size):
        raise ValueError(
            f"kv_pages={num_pages!r}: the page pool must hold at least one row's longest sequence, "
            f"{pages_for(longest, page_size)} pages of {page_size} positions (prompt {longest_prompt} + "
            f"max_new_tokens {max_new} - 1 + {lookahead} positions a step writes = {longest})"
        )
    chunk = min(MAX_PREFILL_CHUNK, prompt_width)
    lanes = min(slots, max(1, PREFILL_TOKENS // chunk))
    prefix = (prompt_width - 1) // page_size
    return Layout(rows, slots, max_new, page_size, per_slot, num_pages, chunk, lanes, lookahead, prefix)


class LoopState(NamedTuple):
    """The slot loop's carry. Per row (B): tokens int32 [B, N], logprobs float32 [B, N], lengths
    int32 [B] (tokens emitted), done bool [B]; the queue int32 [B] of rows, pending from `head`.
    Per slot (S): row int32 (-1 = free), decoding bool (else prefilling), ctx_len (context tokens
    its prefill writes), prefilled (context tokens written so far), cache_len (decoding: positions
    in the cache = prompt + emitted - 1), last (decoding: the last emitted token, not yet in the
    cache), admitted (admission order). pool: the `PagePool`, whose page table is the one in
    effect (the cache's is set where it is used). prefix: the `PrefixCache`. counters: int32
    scalars "steps", "prefill_chunks", "preemptions", "peak_pages", "prefix_pages_shared". draft:
    the drafter's per-slot state, or None."""

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    done: jax.Array
    queue: jax.Array
    head: jax.Array
    row: jax.Array
    decoding: jax.Array
    ctx_len: jax.Array
    prefilled: jax.Array
    cache_len: jax.Array
    last: jax.Array
    admitted: jax.Array
    next_admit: jax.Array
    pool: PagePool
    cache: PagedKVCache
    prefix: PrefixCache
    counters: dict
    draft: object


class Prompts(NamedTuple):
    """The call's prompts on device: tokens int32 [U, P] distinct prompts, lengths int32 [U],
    row_prompt int32 [B], row_lengths int32 [B] (`jaxspec.rollout.prompts.PromptBatch`)."""

    tokens: jax.Array
    lengths: jax.Array
    row_prompt: jax.Array
    row_lengths: jax.Array

    @classmethod
    def of(cls, batch) -> Prompts:
        """The device arrays of a `PromptBatch`."""
        return cls(*(jnp.asarray(x) for x in (batch.tokens, batch.lengths, batch.row_prompt, batch.row_lengths)))


def row_keys(key: jax.Array, rows: jax.Array, index: jax.Array) -> jax.Array:
    """Keys [S] of the draws for token `index` int32 [S] of rows int32 [S]: they depend on the
    call's key, the row and the token's index only."""
    return jax.vmap(lambda r, i: jax.random.fold_in(jax.random.fold_in(key, r), i))(rows, index)


def choose_per_row(keys: jax.Array, logits: jax.Array, sampling: Sampling) -> tuple[jax.Array, jax.Array]:
    """`choose_tokens` with one key per row: keys [S], logits float32 [S, V] -> (int32 [S], float32
    log p [S])."""
    logprobs = processed_logprobs(logits, sampling)
    if sampling.greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        tokens = jax.vmap(sample)(keys, logprobs)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


def context_tokens(prompts: Prompts, tokens: jax.Array, rows: jax.Array, positions: jax.Array) -> jax.Array:
    """int32 [R, C]: token at `positions` [R, C] of each row's context (its prompt, then its emitted
    tokens `tokens` [B, N]); 0 past what it has."""
    plen = prompts.row_lengths[rows][:, None]
    prompt = jnp.take_along_axis(
        prompts.tokens[prompts.row_prompt[rows]], jnp.clip(positions, 0, prompts.tokens.shape[1] - 1), axis=1
    )
    emitted = jnp.take_along_axis(tokens[rows], jnp.clip(positions - plen, 0, tokens.shape[1] - 1), axis=1)
    return jnp.where(positions < plen, prompt, emitted)


def emit(
    state: LoopState, mask: jax.Array, new: jax.Array, logprobs: jax.Array, count: jax.Array, sampling: Sampling
) -> LoopState:
    """Appends the first count[s] of tokens new int32 [S, W] (log p float32 [S, W]) to the row of
    every slot in bool mask [S], stopping at an eos or N tokens; marks finished rows done."""
    num_rows, max_new = state.tokens.shape
    width = new.shape[1]
    steps = jnp.arange(width, dtype=jnp.int32)[None, :]
    row = jnp.clip(state.row, 0, num_rows - 1)
    length = state.lengths[row]
    eos = jnp.isin(new, jnp.asarray(sampling.eos_id, jnp.int32)) & (steps < count[:, None])
    first_eos = jnp.where(jnp.any(eos, axis=1), jnp.argmax(eos, axis=1), width)
    n = jnp.where(mask, jnp.minimum(jnp.minimum(count, first_eos + 1), max_new - length), 0)
    target = jnp.where(mask, row, num_rows)
    columns = jnp.where(steps < n[:, None], length[:, None] + steps, max_new)
    finished = mask & ((first_eos < n) | (length + n >= max_new))
    return state._replace(
        tokens=state.tokens.at[target[:, None], columns].set(new, mode="drop"),
        logprobs=state.logprobs.at[target[:, None], columns].set(logprobs, mode="drop"),
        lengths=state.lengths.at[target].set(length + n, mode="drop"),
        done=state.done.at[jnp.where(finished, row, num_rows)].set(True, mode="drop"),
    )


def make_room(state: LoopState, layout: Layout) -> LoopState:
    """Gives every decoding slot the pages of its next step, preempting the newest rows first
    when the pool runs short (module docstring, step 1)."""
    size = layout.page_size
    occupied = state.row >= 0
    need = jnp.where(
        state.decoding, jnp.maximum(0, pages_for(state.cache_len + layout.lookahead, size) - state.pool.held), 0
    )
    # under pressure the prefix cache lets go first: its pages stay only where rows hold them
    state = prefix_cache.drop(state, jnp.broadcast_to(need.sum() > state.pool.num_free, state.prefix.ready.shape))
    pool = state.pool
    evict = newest_to_evict(state.admitted, occupied, pool, need)
    order = jnp.argsort(jnp.where(evict, -state.admitted, jnp.iinfo(jnp.int32).max), stable=True)  # newest first
    count = evict.sum(dtype=jnp.int32)
    i = jnp.arange(layout.slots, dtype=jnp.int32)
    front = jnp.where(i < count, state.head - 1 - i, layout.rows)  # the oldest evicted row ends up first
    state = state._replace(
        queue=state.queue.at[front].set(state.row[order], mode="drop"),
        head=state.head - count,
        row=jnp.where(evict, -1, state.row),
        decoding=state.decoding & ~evict,
        counters={**state.counters, "preemptions": state.counters["preemptions"] + count},
    )
    pool = allocate(release(pool, evict), jnp.where(evict, 0, need), pages_for(layout.lookahead, size))
    return state._replace(pool=pool)


def admit(state: LoopState, layout: Layout, prompts: Prompts) -> LoopState:
    """Free slots take the next pending rows while the pool holds their context's pages plus one
    step's pages for every running row (module docstring, step 2). When the next row does not
    fit, the prefix cache first lets go of the prefixes no running row holds."""
    j = jnp.arange(layout.slots, dtype=jnp.int32)
    free = state.row < 0
    position = state.head + j
    candidate = state.queue[jnp.clip(position, 0, layout.rows - 1)]
    ctx = prompts.row_lengths[candidate] + state.lengths[candidate]
    pages = pages_for(ctx, layout.page_size)
    running = jnp.sum(~free, dtype=jnp.int32)
    headroom = pages_for(layout.lookahead, layout.page_size) * (running + j)
    short = (state.head < layout.rows) & jnp.any(free) & (pages[0] + headroom[0] > state.pool.num_free)
    state = prefix_cache.drop(state, short & prefix_cache.orphans(state, layout, prompts))
    pool = state.pool
    ok = (position < layout.rows) & (j < free.sum()) & (jnp.cumsum(pages) + headroom <= pool.num_free)
    count = jnp.sum(jnp.cumprod(ok), dtype=jnp.int32)  # a prefix of the queue
    free_slots = jnp.argsort(~free, stable=True)  # free slots first, in index order
    target = jnp.where(j < count, free_slots[j], layout.slots)

    def put(field: jax.Array, values) -> jax.Array:
        return field.at[target].set(values, mode="drop")

    need = put(jnp.zeros((layout.slots,), jnp.int32), pages)
    return state._replace(
        head=state.head + count,
        row=put(state.row, candidate),
        decoding=put(state.decoding, False),
        ctx_len=put(state.ctx_len, ctx),
        prefilled=put(state.prefilled, 0),
        admitted=put(state.admitted, state.next_admit + j),
        next_admit=state.next_admit + count,
        pool=allocate(pool, need, layout.pages_per_slot),
    )


# on_prefill(state, lanes int32 [R], valid bool [R], positions int32 [R, C], hidden [n, R, C, H])
#     -> state: a drafter's own prefill of the chunk (hidden: the policy's `policy_layers` outputs)
# on_start(state, started bool [S], first_token int32 [S], hidden_last [n, S, H]) -> state
PrefillHook = Callable[[LoopState, jax.Array, jax.Array, jax.Array, jax.Array], LoopState]
StartHook = Callable[[LoopState, jax.Array, jax.Array, jax.Array], LoopState]


def prefill_chunk(
    cfg: ModelConfig,
    params: Params,
    sampling: Sampling,
    layout: Layout,
    prompts: Prompts,
    key: jax.Array,
    state: LoopState,
    policy_layers: tuple[int, ...] = (),
    on_prefill: PrefillHook | None = None,
    on_start: StartHook | None = None,
) -> LoopState:
    """Writes the next `chunk` context tokens of the oldest prefilling slots (`lanes` of them); a
    slot whose context this completes samples its row's next token and starts decoding (module
    docstring, step 4). A no-op (skipped by `lax.cond`) when no slot is prefilling."""
    prefilling = (state.row >= 0) & ~state.decoding & ~prefix_cache.waiting(state, layout, prompts)

    def run(state: LoopState) -> LoopState:
        big = jnp.iinfo(jnp.int32).max
        lanes = jnp.argsort(jnp.where(prefilling, state.admitted, big), stable=True)[: layout.lanes]
        valid = prefilling[lanes]
        row = jnp.clip(state.row[lanes], 0, layout.rows - 1)
        start, ctx = state.prefilled[lanes], state.ctx_len[lanes]
        positions = start[:, None] + jnp.arange(layout.chunk, dtype=jnp.int32)[None, :]
        tokens = jnp.where(positions < ctx[:, None], context_tokens(prompts, state.tokens, row, positions), 0)
        table = jnp.where(valid[:, None], state.pool.page_table[lanes], NO_PAGE)
        _, hidden, view = extend(
            cfg,
            params,
            state.cache._replace(page_table=table),
            tokens,
            positions,
            start,
            active=valid,
            hidden_layers=(*policy_layers, cfg.num_layers - 1),
        )
        state = state._replace(cache=state.cache._replace(k=view.k, v=view.v))
        if on_prefill is not None:
            state = on_prefill(state, lanes, valid, positions, hidden[:-1])
        last = jnp.clip(ctx - 1 - start, 0, layout.chunk - 1)[None, :, None, None]
        hidden_last = jnp.take_along_axis(hidden, last, axis=2)[:, :, 0]  # [n + 1, R, H]
        logits = logits_from_hidden(cfg, params, hidden_last[-1][:, None])[:, 0]
        token, logprob = choose_per_row(row_keys(key, row, state.lengths[row]), logits, sampling)
        finishing = valid & (start + layout.chunk >= ctx)
        slot = jnp.where(finishing, lanes, layout.slots)  # lanes are distinct where valid

        def to_slots(values: jax.Array, fill) -> jax.Array:
            return jnp.full((layout.slots, *values.shape[1:]), fill, values.dtype).at[slot].set(values, mode="drop")

        started = to_slots(finishing, False)
        first = to_slots(token, 0)
        state = emit(
            state, started, first[:, None], to_slots(logprob, 0.0)[:, None], started.astype(jnp.int32), sampling
        )
        state = state._replace(
            prefilled=state.prefilled.at[jnp.where(valid, lanes, layout.slots)].add(layout.chunk, mode="drop"),
            decoding=state.decoding | started,
            cache_len=jnp.where(started, state.ctx_len, state.cache_len),
            last=jnp.where(started, first, state.last),
            counters={**state.counters, "prefill_chunks": state.counters["prefill_chunks"] + 1},
        )
        if on_start is not None:
            hidden_slots = jax.vmap(lambda h: to_slots(h, 0))(hidden_last[:-1])
            state = on_start(state, started, first, hidden_slots)
        return state

    return jax.lax.cond(jnp.any(prefilling), run, lambda s: s, state)


def release_finished(state: LoopState, layout: Layout) -> LoopState:
    """Slots whose row is done return their pages to the pool (module docstring, step 5)."""
    finished = (state.row >= 0) & state.done[jnp.clip(state.row, 0, layout.rows - 1)]
    return state._replace(
        pool=release(state.pool, finished),
        row=jnp.where(finished, -1, state.row),
        decoding=state.decoding & ~finished,
    )


def decoding_view(state: LoopState) -> tuple[jax.Array, PagedKVCache]:
    """(bool [S] slots decoding this step, the cache with the others' page tables cleared so that
    nothing is written to their pages)."""
    active = state.decoding & (state.row >= 0)
    return active, state.cache._replace(page_table=jnp.where(active[:, None], state.pool.page_table, NO_PAGE))


def run_slots(
    layout: Layout,
    state: LoopState,
    prompts: Prompts,
    decode: Callable[[LoopState], LoopState],
    prefill: Callable[[LoopState], LoopState],
) -> LoopState:
    """The compiled loop: room, admit, decode, prefill, release, until every row is done."""

    def body(state: LoopState) -> LoopState:
        state = admit(make_room(state, layout), layout, prompts)
        state = prefix_cache.attach(state, layout, prompts)
        state = jax.lax.cond(jnp.any(state.decoding & (state.row >= 0)), decode, lambda s: s, state)
        state = prefix_cache.publish(prefill(state), layout, prompts)
        state = prefix_cache.drop_finished(release_finished(state, layout), prompts)
        in_use = layout.num_pages - state.pool.num_free
        counters = state.counters
        return state._replace(
            counters={
                **counters,
                "steps": counters["steps"] + 1,
                "peak_pages": jnp.maximum(counters["peak_pages"], in_use),
            }
        )

    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)


def initial_state(layout: Layout, prompts: Prompts, cache: PagedKVCache, pad_id: int, draft=None) -> LoopState:
    """Every row pending (queue 0..B-1), every slot free, every page in the pool."""
    b, s = layout.rows, layout.slots
    zeros = jnp.zeros((s,), jnp.int32)
    return LoopState(
        tokens=jnp.full((b, layout.max_new), pad_id, jnp.int32),
        logprobs=jnp.zeros((b, layout.max_new), jnp.float32),
        lengths=jnp.zeros((b,), jnp.int32),
        done=jnp.zeros((b,), bool),
        queue=jnp.arange(b, dtype=jnp.int32),
        head=jnp.zeros((), jnp.int32),
        row=jnp.full((s,), -1, jnp.int32),
        decoding=jnp.zeros((s,), bool),
        ctx_len=zeros,
        prefilled=zeros,
        cache_len=zeros,
        last=zeros,
        admitted=zeros,
        next_admit=jnp.zeros((), jnp.int32),
        pool=PagePool.create(layout.num_pages, s, layout.pages_per_slot),
        cache=cache,
        prefix=PrefixCache.create(prompts.tokens.shape[0], layout.prefix_pages),
        counters={
            name: jnp.zeros((), jnp.int32)
            for name in ("steps", "prefill_chunks", "preemptions", "peak_pages", "prefix_pages_shared")
        },
        draft=draft,
    )
