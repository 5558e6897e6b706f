"""Continuous batching: every row of a call streams through S decode slots over a paged KV cache.

`generate(..., slots=S)` runs the whole rollout, prefill included, as ONE compiled
`jax.lax.while_loop` with static shapes: no round trip to Python per step (Python waits once, for
the outputs); inside the program a GPU runtime reads one branch index a decode step back to the
host (the step's switch) and two loop predicates an iteration (the loop's, the prefill loop's;
one more per prefill chunk), as the staged loop reads one a step. The pending-row queue, the
free-page stack and the page tables are device arrays (`jaxspec.rollout.page_pool`). Each
iteration (`run_slots`):

1. **room**: every decoding slot gets the pages the iteration's decode steps write
   (`Layout.reach` positions past its length, at most its row's longest sequence). When the
   free pages do not suffice, the prefix cache lets go of its pages and then, if still short,
   the newest rows are preempted (`page_pool.newest_to_evict`): their pages return to the pool
   and they go back to the front of the queue with their tokens so far. The oldest row is never
   preempted (one row's longest sequence always fits: checked before the loop), so every row
   finishes.
2. **admit**: free slots take the next pending rows, in queue order, while the pool holds the
   pages of their context (prompt + tokens so far) plus one iteration's pages for every running
   row and every row admitted before them; a row also takes its own iteration's pages where the
   pool still holds them. An admitted row whose prompt's prefix is cached takes its pages
   (`prefix_cache.attach`).
3. **prefill**: while a slot's context (prompt + tokens so far) is unwritten, a prefill step
   writes `lanes` lanes of `chunk` context tokens (`PREFILL_TOKENS` in all), packed over the
   admitted slots oldest first, a slot taking as many lanes as its unwritten context fills. The
   lane that completes a context samples the row's next token from its last logits, and the slot
   decodes from this iteration's decode steps on (where its admission gave it the iteration's
   pages; else from the next iteration's, `decoding_slots`). Prefill runs in chunks between the
   iterations' decode steps; writing every context before the iteration's decode steps adds no
   work (a decode step and a prefill step are separate forwards either way), starts new rows
   together (at a call's start, after one prefill of them all, as in the staged engine) and
   checks for prefill work once an iteration, not once a step.
4. **decode**, K = `Layout.decode_steps` times: one step of every decoding slot (a token, or a
   speculative draft-and-verify step; a row that finishes within the iteration decodes no more).
   The schedule's bookkeeping (scatters and sorts over slots, pages and rows: many small kernels)
   is paid once per K steps, as vLLM's multi-step scheduling does; a finished row's slot waits at
   most K - 1 steps for its next row.
5. **publish**: prefixes written are cached (`prefix_cache.publish`; a prefill step publishes
   the prefixes it completes too, and rows of their prompts take them at once).
6. **release**: slots whose row has finished return their pages to the pool, and the cache
   lets go of the prefixes of prompts whose rows have all finished.

Steps 1, 2 and 6 are `jaxspec.rollout.slot_schedule`; the shapes are `jaxspec.rollout.slot_layout`
and the carry `jaxspec.rollout.slot_state`. On a mesh the rows, slots and pages split into groups
over the batch axes (data x fsdp), each on its own devices with the pools' KV heads over the
tensor axis, stepping in lockstep (`jaxspec.rollout.slot_state`); every row gets the tokens it
gets on one device.

A row resumed after preemption re-prefills its prompt and its tokens so far, then samples its
next token: exactly the distribution its next decode step had. Every draw of row r's token i
uses `fold_in(fold_in(key, r), i)`, whatever the slot, the slot count, the group or preemptions,
so in float32 the same key gives the same tokens for any S and any mesh (up to float rounding of
batched matmuls).

Rows of one prompt (a GRPO group) share the pages of its prefix (`jaxspec.rollout.prefix_cache`):
it is prefilled once while rows of the prompt are live (within a group, on a mesh).

With record_experts the carry records the routing (`jaxspec.rollout.experts.SlotExperts`): the
prefill chunks write their context positions (a resumed row's again), the decode steps their
tokens' (a speculative step, its accepted path's, at the positions its KV moves to); the prompt
positions a row took from the prefix cache come from the row that prefilled them.

The staged dense engine (`jaxspec.rollout.engine`, slots=None) stays the default until GPU
measurements show this one faster everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.models.blocks import logits_from_hidden
from jaxspec.models.config import ModelConfig
from jaxspec.models.paged import NO_PAGE
from jaxspec.models.params import Params
from jaxspec.models.sharding import Sharding
from jaxspec.models.transformer import extend
from jaxspec.rollout import prefix_cache
from jaxspec.rollout.sampling import Sampling, choose_per_row, row_keys
from jaxspec.rollout.slot_layout import Layout
from jaxspec.rollout.slot_schedule import admit, make_room, release_finished
from jaxspec.rollout.slot_state import LoopState, Prompts, lay_out, map_groups, slots_flat, slots_grouped
from jaxspec.rollout.slot_width import width_index


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
    state: LoopState,
    prompts: Prompts,
    mask: jax.Array,
    new: jax.Array,
    logprobs: jax.Array,
    count: jax.Array,
    sampling: Sampling,
) -> LoopState:
    """Appends the first count[s] of tokens new int32 [S, W] (log p float32 [S, W]) to the row of
    every slot in bool mask [S], stopping at an eos or the row's limit (`Prompts.row_max_new`, at
    most N tokens); marks finished rows done."""
    num_rows, max_new = state.tokens.shape
    width = new.shape[1]
    steps = jnp.arange(width, dtype=jnp.int32)[None, :]
    row = jnp.clip(state.row, 0, num_rows - 1)
    length = state.lengths[row]
    limit = prompts.row_max_new[row]
    eos = jnp.isin(new, jnp.asarray(sampling.eos_id, jnp.int32)) & (steps < count[:, None])
    first_eos = jnp.where(jnp.any(eos, axis=1), jnp.argmax(eos, axis=1), width)
    n = jnp.where(mask, jnp.minimum(jnp.minimum(count, first_eos + 1), limit - length), 0)
    target = jnp.where(mask, row, num_rows)
    columns = jnp.where(steps < n[:, None], length[:, None] + steps, max_new)
    finished = mask & ((first_eos < n) | (length + n >= limit))
    return state._replace(
        tokens=state.tokens.at[target[:, None], columns].set(new, mode="drop"),
        logprobs=state.logprobs.at[target[:, None], columns].set(logprobs, mode="drop"),
        lengths=state.lengths.at[target].set(length + n, mode="drop"),
        done=state.done.at[jnp.where(finished, row, num_rows)].set(True, mode="drop"),
    )


class Lanes(NamedTuple):
    """A prefill chunk's lanes, R of them (per group, or every group's in a row: `slots_flat`):
    slot int32 [R] (the group's slot the lane writes), valid bool [R], row int32 [R] (the slot's
    row, clipped), start int32 [R] (context tokens already written), ctx int32 [R] (the context's
    length), positions int32 [R, C], tokens int32 [R, C] (the context's tokens there, 0 past it),
    next_tokens int32 [R, C] (the token after each position, 0 past the context: the EAGLE-3
    head's pairs), table int32 [R, M] (the slot's page table, `NO_PAGE` where not valid)."""

    slot: jax.Array
    valid: jax.Array
    row: jax.Array
    start: jax.Array
    ctx: jax.Array
    positions: jax.Array
    tokens: jax.Array
    next_tokens: jax.Array
    table: jax.Array


# on_prefill(state, lanes: Lanes of every group (`slots_flat`), hidden [n, R, C, H]) -> state: a
#     drafter's own prefill of the chunk (hidden: the policy's `policy_layers` outputs)
# on_start(state, prompts, started bool [S], first_token int32 [S], hidden_last [n, S, H]) -> state,
#     of one group
PrefillHook = Callable[[LoopState, Lanes, jax.Array], LoopState]
StartHook = Callable[[LoopState, Prompts, jax.Array, jax.Array, jax.Array], LoopState]


def prefilling(state: LoopState, layout: Layout, prompts: Prompts) -> jax.Array:
    """bool [S]: slots whose context is being written (admitted, not decoding, not waiting for an
    older row of their prompt to publish its prefix)."""
    return (state.row >= 0) & ~state.decoding & ~prefix_cache.waiting(state, layout, prompts)


def prefill_lanes(state: LoopState, layout: Layout, prompts: Prompts) -> Lanes:
    """One group's `lanes` lanes of `chunk` context tokens each, packed over its `prefilling` slots
    oldest first: a slot takes as many consecutive lanes as its unwritten context fills (a slot
    past the last lane waits), lane i + 1 of a slot writing the chunk after lane i's. Lanes left
    over are invalid."""
    writing = prefilling(state, layout, prompts)
    big = jnp.iinfo(jnp.int32).max
    order = jnp.argsort(jnp.where(writing, state.admitted, big), stable=True)  # [S] oldest first
    need = jnp.where(writing, -(-(state.ctx_len - state.prefilled) // layout.chunk), 0)[order]  # [S] lanes to fill
    ends = jnp.cumsum(need)  # [S] lanes taken by the slots up to each, in age order
    lane = jnp.arange(layout.lanes, dtype=jnp.int32)
    owner = jnp.clip(jnp.searchsorted(ends, lane, side="right"), 0, order.shape[0] - 1)
    valid = lane < ends[-1]
    slot = order[owner]
    row = jnp.clip(state.row[slot], 0, layout.rows - 1)
    offset = lane - (ends[owner] - need[owner])  # the lane's chunk among its slot's
    start, ctx = state.prefilled[slot] + offset * layout.chunk, state.ctx_len[slot]
    positions = start[:, None] + jnp.arange(layout.chunk, dtype=jnp.int32)[None, :]

    def context(at: jax.Array) -> jax.Array:
        return jnp.where(at < ctx[:, None], context_tokens(prompts, state.tokens, row, at), 0)

    table = jnp.where(valid[:, None], state.pool.page_table[slot], NO_PAGE)
    return Lanes(slot, valid, row, start, ctx, positions, context(positions), context(positions + 1), table)


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
    """Writes every group's `prefill_lanes` (one forward over all of them: a slot's later lane
    attends to its earlier lanes' keys and values, written to the pools before any lane attends);
    a slot whose context this completes samples its row's next token and starts decoding (module
    docstring, step 3). `run_slots` runs it only when a slot of some group
    prefills; a group with none writes nothing (every lane is invalid)."""
    group = layout.group()
    lanes = map_groups(layout, lambda s, p: prefill_lanes(s, group, p))(state, prompts)
    flat = slots_flat(layout, lanes)
    record = state.experts is not None
    _, hidden, view, *experts = extend(
        cfg,
        params,
        state.cache._replace(page_table=flat.table),
        flat.tokens,
        flat.positions,
        flat.start,
        active=flat.valid,
        hidden_layers=(*policy_layers, cfg.num_layers - 1),
        record_experts=record,
    )
    state = state._replace(cache=state.cache._replace(k=view.k, v=view.v))
    if record:
        state = map_groups(layout, record_lanes)(state, prompts, lanes, slots_grouped(layout, experts[0]))
    if on_prefill is not None:
        state = on_prefill(state, flat, hidden[:-1])
    last = jnp.clip(flat.ctx - 1 - flat.start, 0, layout.chunk - 1)[None, :, None, None]
    hidden_last = jnp.take_along_axis(hidden, last, axis=2)[:, :, 0]  # [n + 1, R, H]
    logits = logits_from_hidden(cfg, params, hidden_last[-1][:, None])[:, 0]

    def start(state: LoopState, prompts: Prompts, lanes: Lanes, logits: jax.Array, hidden_last: jax.Array):
        """One group's lanes: sample the next token of the rows whose context is complete, start
        their slots. logits [R, V]; hidden_last [R, n + 1, H]."""
        keys = row_keys(key, state.first_row + lanes.row, state.lengths[lanes.row])
        token, logprob = choose_per_row(keys, logits, sampling)
        finishing = lanes.valid & (lanes.start + layout.chunk >= lanes.ctx)
        slot = jnp.where(finishing, lanes.slot, group.slots)  # a slot's context ends in one lane

        def to_slots(values: jax.Array, fill) -> jax.Array:
            return jnp.full((group.slots, *values.shape[1:]), fill, values.dtype).at[slot].set(values, mode="drop")

        started = to_slots(finishing, False)
        first = to_slots(token, 0)
        state = emit(
            state,
            prompts,
            started,
            first[:, None],
            to_slots(logprob, 0.0)[:, None],
            started.astype(jnp.int32),
            sampling,
        )
        written = jnp.where(lanes.valid, lanes.slot, group.slots)
        state = state._replace(
            prefilled=state.prefilled.at[written].add(layout.chunk, mode="drop"),
            decoding=state.decoding | started,
            cache_len=jnp.where(started, state.ctx_len, state.cache_len),
            last=jnp.where(started, first, state.last),
            counters={**state.counters, "prefill_chunks": state.counters["prefill_chunks"] + 1},
        )
        if on_start is not None:
            state = on_start(state, prompts, started, first, jnp.moveaxis(to_slots(hidden_last[:, :-1], 0), 1, 0))
        return state

    def share(state: LoopState, prompts: Prompts) -> LoopState:
        """The prefixes this step completed are cached, and the rows of their prompts that wait
        take them: they prefill from the next step, not the next iteration."""
        return prefix_cache.attach(prefix_cache.publish(state, group, prompts), group, prompts)

    per_lane = slots_grouped(layout, (logits, jnp.moveaxis(hidden_last, 0, 1)))
    return map_groups(layout, share)(map_groups(layout, start)(state, prompts, lanes, *per_lane), prompts)


def record_lanes(state: LoopState, prompts: Prompts, lanes: Lanes, experts: jax.Array) -> LoopState:
    """One group's record with the routing experts [R, C, L_sparse, k] of its lanes' context
    positions (a resumed row's re-prefill writes the positions it ran before again)."""
    written = lanes.valid[:, None] & (lanes.positions < lanes.ctx[:, None])
    prompt, prompt_len = prompts.row_prompt[lanes.row], prompts.row_lengths[lanes.row]
    return state._replace(experts=state.experts.write(lanes.row, prompt, prompt_len, experts, lanes.start, written))


def record_steps(state: LoopState, prompts: Prompts, active: jax.Array, experts: jax.Array) -> LoopState:
    """One group's record with the routing experts [S, T, L_sparse, k] of the positions its
    decoding slots (bool active [S, T]: those written) ran from their cache_len on."""
    row = jnp.clip(state.row, 0, prompts.row_prompt.shape[0] - 1)
    prompt, prompt_len = prompts.row_prompt[row], prompts.row_lengths[row]
    return state._replace(experts=state.experts.write(row, prompt, prompt_len, experts, state.cache_len, active))


def decoding_slots(state: LoopState, layout: Layout) -> jax.Array:
    """bool [S]: one group's slots (layout: the group's) that decode this step: those whose pages
    hold the positions the step writes (a row started within the iteration without its
    iteration's pages waits for the next, `slot_schedule.admit`; a row that finished earlier in the
    iteration keeps its slot until the iteration's release, and decodes no more)."""
    row = state.row
    held = state.pool.held * layout.page_size >= state.cache_len + layout.lookahead
    return state.decoding & held & (row >= 0) & ~state.done[jnp.clip(row, 0, state.done.shape[0] - 1)]


def decoding_table(state: LoopState, active: jax.Array) -> jax.Array:
    """int32 [S, M]: one group's page table with the entries of the slots outside active bool [S]
    (its `decoding_slots`) cleared, so that nothing is written to their pages."""
    return jnp.where(active[:, None], state.pool.page_table, NO_PAGE)


def run_slots(
    layout: Layout,
    state: LoopState,
    prompts: Prompts,
    decode: Sequence[Callable[[LoopState, jax.Array, jax.Array], LoopState]],
    choose: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    prefill: Callable[[LoopState], LoopState],
    sharding: Sharding | None = None,
    plain_round: Callable[[LoopState], tuple[LoopState, jax.Array]] | None = None,
) -> LoopState:
    """The compiled loop: room, admit, prefill, `layout.decode_steps` decode steps, publish,
    release, until every row is done.

    state, prompts: every group's (`jaxspec.rollout.slot_state`). decode: the decode step's
    branches (a step width, a draft depth: the device picks one per step), each taking the state,
    the step's decoding slots, active bool [G, S] (every group's `decoding_slots`), and their count
    (int32 scalar); choose(count, width, in_plain) -> int32 scalar: the step's branch, given that
    count and the index of its width in `layout.widths` (`width_index`; in_plain: below). decode
    and prefill take and return every group's state (their bookkeeping maps one group's with
    `map_groups`, their forwards take every group's slots at once); a step runs its branch when a
    slot of any group decodes, and the prefill chunks (`prefill_chunk`) run while a slot of any
    group prefills, so that every group takes the same branches. sharding: the mesh the carry is
    laid out on (`lay_out`). plain_round: None, or plain_round(state) -> (state, bool scalar
    in_plain), once per iteration after the prefill (the adaptive speculative loop's rounds of
    autoregressive steps: no choice to make per step).

    A step takes one branch of one `jax.lax.switch` (nothing, or the chosen decode branch): each
    `cond` or `switch` waits for its predicate on the host, and at small batches those waits are a
    step's largest cost after its kernels."""
    group = layout.group()
    decoding = map_groups(layout, lambda s, p: decoding_slots(s, group))
    writing = map_groups(layout, lambda s, p: prefilling(s, group, p))

    def schedule(state: LoopState, prompts: Prompts) -> LoopState:
        state = admit(make_room(state, group, prompts), group, prompts)
        return prefix_cache.attach(state, group, prompts)

    def finish(state: LoopState, prompts: Prompts) -> LoopState:
        state = release_finished(prefix_cache.publish(state, group, prompts), group)
        return prefix_cache.drop_finished(state, prompts)

    def step(_, carry: tuple[LoopState, jax.Array]) -> tuple[LoopState, jax.Array]:
        """One decode step of the decoding slots (a row that finished earlier in the iteration
        decodes no more)."""
        state, in_plain = carry
        active = decoding(state, prompts)
        count = jnp.sum(active, dtype=jnp.int32)  # the step's one reduction; the rest is scalar
        stepping, width = count > 0, width_index(layout.widths, count)
        counters = state.counters
        at_width = jnp.arange(len(layout.widths)) == width  # an elementwise add, not a scatter
        counters = {
            **counters,
            "decode_steps": counters["decode_steps"] + stepping,
            "width_steps": counters["width_steps"] + (at_width & stepping).astype(jnp.int32),
        }
        branch = jnp.where(stepping, 1 + choose(count, width, in_plain), 0)
        idle = lambda s, _active, _count: s  # noqa: E731
        state = jax.lax.switch(branch, [idle, *decode], state._replace(counters=counters), active, count)
        return lay_out(sharding, layout, state), in_plain

    def prefill_all(state: LoopState) -> LoopState:
        """Prefill chunks until no slot's context is left to write."""
        body = lambda s: lay_out(sharding, layout, prefill(s))  # noqa: E731
        return jax.lax.while_loop(lambda s: jnp.any(writing(s, prompts)), body, state)

    def body(state: LoopState) -> LoopState:
        state = prefill_all(map_groups(layout, schedule)(state, prompts))
        state, in_plain = (state, jnp.zeros((), bool)) if plain_round is None else plain_round(state)
        state, _ = jax.lax.fori_loop(0, layout.decode_steps, step, (state, in_plain))
        in_use = layout.num_pages - jnp.sum(state.pool.num_free)  # the most: only `finish` frees pages
        state = map_groups(layout, finish)(state, prompts)
        counters = state.counters
        counters = {
            **counters,
            "iterations": counters["iterations"] + 1,
            "peak_pages": jnp.maximum(counters["peak_pages"], in_use),
        }
        return lay_out(sharding, layout, state._replace(counters=counters))

    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, lay_out(sharding, layout, state))
