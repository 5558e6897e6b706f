"""Speculative rollouts on the slot engine (`jaxspec.rollout.slots`): every drafter, chains and
trees, group-suffix drafts and hybrid trees, at fixed or adaptive depth.

Each decode step of the slot loop is one draft-and-verify step of every decoding slot
(`step.speculative_step`: the same proposal, verification forward, exact acceptance and commit
as the staged loop, on the paged cache). The drafter's own state is per slot
(`slot_drafters`): the EAGLE-3 head's and the draft model's KV are paged on the policy's page
tables and prefilled in the prefill lanes; the n-gram history is copied from a slot's context
when it starts. The suffix drafter (and a hybrid tree's suffix branches) reads a call-wide pool of
every row's prompt and tokens so far, made for each step from the carry (`slot_drafters.call_pool`,
read-only in the step): a row's GRPO siblings are the rows of its prompt's group, read as far as
they have come. Rows run at other times than in the staged loop (a sibling may have finished
before a row starts), so suffix proposals may differ from the staged loop's where siblings are
read; the sampled distribution is the same (exact), and greedy rollouts give the same tokens.

Randomness. The acceptance of the step that starts at row r's token i is drawn with
`fold_in(fold_in(key, r), i)` (`kernels.tree_verify` with one key per row), the first token after
a prefill as in the autoregressive engine. A row's steps depend on its own tokens alone, so
without preemption the same key gives the same tokens for any S; a preempted row resumes with a
new step boundary, so its later sampled tokens are a different (equally exact) draw; greedy
rollouts are the same through preemptions. With `Sampling.coupled` the node at depth d of that
step is verified under the key of token i + d, the key the autoregressive engine draws that token
with, so the rollout's tokens are the autoregressive rollout's (through preemptions too).
Stochastic drafts draw their noise per loop iteration, for all slots at once (exact, but not
independent of the slot count or the mesh).

Draft depth by occupancy: `Spec.stage_draft_tokens` entry i is the depth while the decoding
slots are at most S / 2^i and more than S / 2^(i + 1) (`occupancy_sizes`), the staged loop's
stages generalised; each depth is a branch of the step's `lax.switch` (`slots.run_slots`), taken
by every group of a mesh at once (the occupancy counts all of them). The depth then depends on
how many rows run beside a row, so its sampled tokens depend on S (still exact).

Adaptive depth (`spec.adaptive`): each step of a bracket drafting k levels runs the candidate depth
(`adaptive.candidate_depths`, 0 an autoregressive step) that `adaptive.choose` picks from the
running acceptance rates, updated after the step from the acceptance of every group's decoding
slots (the staged loop's rule, per step over the decoding slots); every group takes the same
branch. Depth 0 tests no draft, so the rates stay and the choice stays 0 until the probe is due: a
loop iteration (`Layout.decode_steps` steps) that begins with that choice and at least
`decode_steps` steps before its probe runs them all as autoregressive steps (branches of the
step's switch of their own), with no depth choice per step (counted in fallback_rounds; the choice
would differ within it only if the falling occupancy made drafting pay): a drafting step of an
adaptive loop waits for the host twice, its depth choice being a switch inside its branch. The
statistics count the steps of each depth (depth_steps, fallback_steps) as the staged loop does.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.distributed import to_host
from jaxspec.models.config import ModelConfig
from jaxspec.models.params import Params
from jaxspec.models.sharding import Sharding
from jaxspec.rollout.compiler_options import rollout_jit
from jaxspec.rollout.continuous import empty_cache, record_buffer, slot_output
from jaxspec.rollout.output import RolloutOutput
from jaxspec.rollout.prompts import PromptBatch
from jaxspec.rollout.sampling import Sampling, depth_keys, row_keys
from jaxspec.rollout.slot_layout import DEFAULT_PAGE_SIZE, Layout
from jaxspec.rollout.slot_memory import slot_layout
from jaxspec.rollout.slot_state import (
    LoopState,
    Prompts,
    first_group,
    initial_state,
    map_groups,
    rows_of,
    slots_flat,
    slots_grouped,
    summed,
)
from jaxspec.rollout.slot_width import at_width, width_index
from jaxspec.rollout.slots import decoding_slots, decoding_table, emit, prefill_chunk, record_steps, run_slots
from jaxspec.rollout.speculative.adaptive import AdaptiveDepth, DepthState, candidate_depths, choose, observe
from jaxspec.rollout.speculative.drafter import Pooled, defers_step
from jaxspec.rollout.speculative.generate import (
    adaptive_depth,
    head_queue_bytes,
    make_drafter,
    suffix_sources_bytes,
    with_call_sources,
)
from jaxspec.rollout.speculative.slot_drafters import (
    call_pool,
    draft_kv_config,
    empty_state,
    prefill_hook,
    start_hook,
    with_call_pool,
    with_chunk,
    with_pools,
    without_chunk,
    without_pools,
)
from jaxspec.rollout.speculative.spec import Spec
from jaxspec.rollout.speculative.stats import Counts, count_step, summarize
from jaxspec.rollout.speculative.step import speculative_step


class SpecSlots(NamedTuple):
    """The drafter's per-slot state (`slot_drafters`, a `Pooled` one without its call-wide pool),
    the acceptance `Counts`, the decode steps run in each occupancy bracket int32 [len(drafters)]
    (`occupancy_sizes`) and at each draft depth int32 [D + 1] (0: an adaptive loop's
    autoregressive steps), an adaptive loop's measured acceptance (`adaptive.DepthState`, alike
    in every group) or None, and its loop iterations run as autoregressive steps (int32 scalar)."""

    draft: object
    counts: Counts
    occupancy_steps: jax.Array
    depth_steps: jax.Array
    depths: DepthState | None
    fallback_rounds: jax.Array


def occupancy_sizes(slots: int, num_depths: int) -> tuple[int, ...]:
    """Occupancy brackets of the draft depths: S, S/2, S/4, ... (`Spec.stage_draft_tokens` entry i
    drafts while at most sizes[i] and more than sizes[i + 1] slots decode, as stage i of the staged
    loop does with its batch)."""
    return tuple(slots >> i for i in range(num_depths))


def slot_speculative_generate(
    cfg: ModelConfig,
    params: Params,
    batch: PromptBatch,
    key: jax.Array,
    sampling: Sampling,
    spec: Spec,
    *,
    slots: int | str,
    cache_dtype,
    kv_pages: int | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
    sharding: Sharding | None = None,
    record_experts: bool = False,
    decode_steps: int | None = None,
) -> RolloutOutput:
    """`jaxspec.rollout.generate` with `spec` and `slots` (an integer or "auto"): prompts already
    validated and grouped into `batch`, `sampling.eos_id` resolved to a tuple."""
    drafter, dparams = make_drafter(cfg, params, sampling, spec)
    dparams = with_call_sources(cfg, spec, batch, dparams)
    depths = spec.stage_depths(len(spec.stage_draft_tokens or (spec.num_draft_tokens,)))
    drafters = tuple(dataclasses.replace(drafter, depth=d, num_nodes=spec.tree_nodes(d)) for d in depths)
    width = batch.tokens.shape[1]
    # The verify forward writes 1 + N nodes, a drafter's own tree k * tree_width (a hybrid's merged
    # tree may hold more nodes than its head's).
    lookahead = 1 + max(spec.num_tree_nodes, spec.num_draft_tokens * spec.tree_width)
    max_depth = min(max(depths), spec.tree_nodes(max(depths)))  # the longest run any depth can accept
    layout = slot_layout(
        cfg,
        batch,
        sampling.max_new_tokens,
        lookahead,
        slots=slots,
        kv_pages=kv_pages,
        page_size=page_size,
        cache_dtype=cache_dtype,
        sharding=sharding,
        draft_kv=draft_kv_config(drafter),
        verify=True,
        record_experts=record_experts,
        decode_steps=decode_steps,
        draft_slot_bytes=head_queue_bytes(spec, 1)
        + (suffix_sources_bytes(spec, dparams, 1, width + sampling.max_new_tokens) if spec.drafts_suffixes else 0),
        advance=1 + max_depth,
    )
    prompts = Prompts.of(batch, layout.groups)
    static = (cfg, sampling, layout, cache_dtype, sharding, drafters, max_depth, width, record_experts)
    static += (adaptive_depth(spec),)
    state = _loop(*static, params, dparams, prompts, key)
    out = slot_output(layout, state, prompts)
    sizes = occupancy_sizes(layout.slots, len(depths))
    counts = summed(layout, state.draft.counts)._replace(depth_steps=first_group(layout, state.draft.depth_steps))
    stats = summarize(
        counts, rows_of(layout, state.lengths), max_depth, sizes, first_group(layout, state.draft.occupancy_steps)
    )
    if spec.adaptive:
        stats["fallback_rounds"] = int(to_host(first_group(layout, state.draft.fallback_rounds)))
    loop_stats = {k: v for k, v in out.stats.items() if k not in stats}
    return out._replace(stats={**stats, **loop_stats})


@rollout_jit(
    static_argnames=(
        "cfg",
        "sampling",
        "layout",
        "cache_dtype",
        "sharding",
        "drafters",
        "max_depth",
        "prompt_width",
        "record",
        "adaptive",
    ),
)
def _loop(
    cfg: ModelConfig,
    sampling: Sampling,
    layout: Layout,
    cache_dtype,
    sharding: Sharding | None,
    drafters: tuple,
    max_depth: int,
    prompt_width: int,
    record: bool,
    adaptive: AdaptiveDepth | None,
    params: Params,
    dparams,
    prompts: Prompts,
    key,
) -> LoopState:
    """The whole speculative rollout of `prompts` on the slot engine. drafters: one per draft depth
    (`occupancy_sizes`), alike but for their depth; their state is made by the deepest. record:
    the carry records the routing, the accepted path's at the positions its KV moves to
    (`jaxspec.rollout.experts.SlotExperts`). adaptive: None drafts each bracket's depth at every
    step; settings choose each step's depth among the bracket's candidates (`adaptive`), from the
    acceptance of every group's slots so far."""
    drafter = max(drafters, key=lambda d: d.depth)
    chain = drafter.width == 1
    verify_key, draft_key = jax.random.split(jax.random.fold_in(key, 1))
    sizes = occupancy_sizes(layout.slots, len(drafters))
    group = layout.group()

    def bracket(decoding: jax.Array) -> jax.Array:
        """int32 scalar: the bracket (`occupancy_sizes`) of `decoding` slots, picked as a width is."""
        return width_index(sizes, decoding)

    def step_branch(count: jax.Array, width: jax.Array, in_plain: jax.Array) -> jax.Array:
        """int32 scalar: the step's branch of `steps` (below) for `count` decoding slots (every
        group's) at the width of index `width` in `layout.widths`."""
        return jnp.where(in_plain, len(drafters), bracket(count)) * len(layout.widths) + width

    def plain_round(state: LoopState) -> tuple[LoopState, jax.Array]:
        """(state, bool scalar): whether this loop iteration's decode steps are all autoregressive
        (the choice is depth 0 and the probe is at least `decode_steps` steps away), counted."""
        decoding = map_groups(layout, lambda s, p: decoding_slots(s, group))(state, prompts).sum()
        measured = first_group(layout, state.draft.depths)
        picks = jnp.stack([choose(adaptive, measured, candidate_depths(d.depth), decoding) for d in drafters])
        plain = (picks[bracket(decoding)] == 0) & (measured.before_probe() >= layout.decode_steps)
        return state._replace(draft=state.draft._replace(fallback_rounds=state.draft.fallback_rounds + plain)), plain

    def decode(
        state: LoopState, active: jax.Array, decoding: jax.Array, drafter, width: int, plain: bool = False
    ) -> LoopState:
        """Every group's decode step of its decoding slots (active bool [G, S], `decoding` of them) on
        `width` slots, by the drafter of their occupancy bracket (`step_branch` picks both): at its
        depth, or (adaptive) at the candidate depth `adaptive.choose` picks for them, 0 an
        autoregressive step (plain: that one, without choosing)."""
        steps = state.draft.occupancy_steps.at[..., bracket(decoding)].add(1)
        state = state._replace(draft=state.draft._replace(occupancy_steps=steps))
        if adaptive is None:
            state = decode_with(drafter, state, active, width)
            return state._replace(
                draft=state.draft._replace(depth_steps=state.draft.depth_steps.at[..., drafter.depth].add(1))
            )
        depths = candidate_depths(drafter.depth)
        branches = [
            functools.partial(
                decode_with,
                dataclasses.replace(drafter, depth=d, num_nodes=adaptive.nodes(d)),
                active=active,
                width=width,
                drafts=d > 0,
            )
            for d in depths
        ]
        measured = first_group(layout, state.draft.depths)
        choice = jnp.int32(0) if plain else choose(adaptive, measured, depths, decoding)
        new = branches[0](state) if plain else jax.lax.switch(choice, branches, state)
        observed = observe(
            adaptive, measured, summed(layout, state.draft.counts), summed(layout, new.draft.counts), choice > 0
        )
        depth = jnp.asarray(depths, jnp.int32)[choice]
        return new._replace(
            draft=new.draft._replace(
                depths=jax.tree.map(lambda x, old: jnp.broadcast_to(x, old.shape), observed, state.draft.depths),
                depth_steps=new.draft.depth_steps.at[..., depth].add(1),
            )
        )

    def decode_with(drafter, state: LoopState, active: jax.Array, width: int, drafts: bool = True) -> LoopState:
        """One draft-and-verify step of every group's decoding slots (active bool [G, S]), as one
        batch of `width` slots (`jaxspec.rollout.slot_width`); drafts=False verifies each root
        alone (an autoregressive step)."""

        def view_and_keys(state: LoopState, prompts: Prompts, active: jax.Array):
            table = decoding_table(state, active)
            row = jnp.clip(state.row, 0, group.rows - 1)
            if sampling.coupled:  # the autoregressive engine's keys of the tokens the step may emit
                return active, table, depth_keys(key, state.first_row + row, state.lengths[row], max_depth)
            return active, table, row_keys(verify_key, state.first_row + row, state.lengths[row])

        active, table, keys = slots_flat(layout, map_groups(layout, view_and_keys)(state, prompts, active))
        stored = slots_flat(layout, state.draft.draft)
        if isinstance(stored, Pooled):  # the call-wide pool, read-only: made from the carry
            stored = with_call_pool(stored, call_pool(layout, state, prompts))
        step_key = jax.random.fold_in(draft_key, first_group(layout, state.counters["decode_steps"]))
        # A head that defers leaves its cache alone in an autoregressive step (it queues the step's
        # entry), so its pools stay out of the step's branches, where XLA may copy what passes.
        pools_out = defers_step(drafter, drafts)

        def forward(inputs, carry, pools):
            """The step of W slots: (per-slot outcome, the drafter's per-slot state, pools)."""
            table, last, cache_len, active, keys, slots = inputs

            k, v, draft_pools, features = pools
            out = speculative_step(
                cfg,
                params,
                sampling,
                drafter,
                dparams,
                state.cache._replace(k=k, v=v, page_table=table),
                carry if pools_out else with_pools(with_chunk(carry, features, slots), stored, draft_pools, table),
                last,
                cache_len,
                active,
                step_key,
                keys,
                max_depth=max_depth,
                chain=chain,
                sharding=sharding,
                record=record,
                drafts=drafts,
            )
            outcome = (out.emitted, out.logprobs, out.accepted, out.next_token, out.tree.parents)
            outcome += (out.tree.num_nodes, out.path) + ((out.node_experts,) if record else ())
            carry, draft_pools = (out.draft, ()) if pools_out else without_pools(out.draft)
            carry, features = (carry, None) if pools_out else without_chunk(carry)
            return outcome, carry, (out.cache.k, out.cache.v, draft_pools, features)

        slots = jnp.arange(active.shape[0], dtype=jnp.int32)  # a step on W slots sees the W it runs
        inputs = (table, *slots_flat(layout, (state.last, state.cache_len)), active, keys, slots)
        carry, draft_pools = without_pools(stored)
        # The head's chunk [S, E, 3H] stays out of the width branches too (gathered and scattered
        # whole at a narrow width): an autoregressive step queues its entry into an empty one-entry
        # chunk, appended to the slots' own at full width after it; a drafting step reads and
        # writes its slots' entries in place.
        if pools_out:
            queued, carry, features = carry, drafter.one_entry(carry), None
        else:
            carry, features = without_chunk(carry)
        pools = (state.cache.k, state.cache.v, () if pools_out else draft_pools, features)
        outcome, carry, (k, v, stepped_pools, features) = at_width(width, active, forward, inputs, carry, pools)
        if pools_out:
            carry = drafter.queue(queued, carry.tokens[:, 0], carry.hidden[:, 0], carry.count > 0)
        else:
            carry = with_chunk(carry, features)
        draft_pools = draft_pools if pools_out else stepped_pools
        draft = slots_grouped(layout, with_call_pool(with_pools(carry, stored, draft_pools), None))
        state = state._replace(cache=state.cache._replace(k=k, v=v), draft=state.draft._replace(draft=draft))
        emitted, logprobs, accepted, next_token, parents, num_nodes, path, *node_experts = outcome
        if record:  # the accepted path's experts at the positions its KV now holds
            path_experts = jnp.take_along_axis(node_experts[0], jnp.maximum(path, 0)[:, :, None, None], axis=1)
            written = active[:, None] & (path >= 0)
            state = map_groups(layout, record_steps)(state, prompts, *slots_grouped(layout, (written, path_experts)))
        per_slot = (active, emitted, logprobs, accepted, next_token, parents, num_nodes, path)
        return map_groups(layout, commit)(state, prompts, *slots_grouped(layout, per_slot))

    def commit(state, prompts, active, emitted, logprobs, accepted, next_token, parents, num_nodes, path):
        """One group's slots append their step's tokens and count its acceptance."""
        state = emit(state, prompts, active, emitted, logprobs, accepted + 1, sampling)
        counts = count_step(state.draft.counts, parents, num_nodes, path, accepted, active)
        return state._replace(
            cache_len=state.cache_len + jnp.where(active, accepted + 1, 0),
            last=jnp.where(active, next_token, state.last),
            draft=state.draft._replace(counts=counts),
        )

    on_prefill = prefill_hook(drafter, dparams)
    on_start = start_hook(drafter, dparams, group)

    def prefill(state: LoopState) -> LoopState:
        return prefill_chunk(
            cfg, params, sampling, layout, prompts, key, state, drafter.policy_layers, on_prefill, on_start
        )

    draft = empty_state(drafter, dparams, layout, prompt_width + layout.max_new, cache_dtype)
    spec_state = SpecSlots(
        draft,
        Counts.zeros(max_depth),
        jnp.zeros((len(drafters),), jnp.int32),
        jnp.zeros((drafter.depth + 1,), jnp.int32),
        None if adaptive is None else DepthState.start(max_depth, adaptive),
        jnp.zeros((), jnp.int32),
    )
    experts = record_buffer(cfg, layout, prompts) if record else None
    cache = empty_cache(cfg, layout, cache_dtype)
    state = initial_state(layout, prompts, cache, cfg.pad_token_id or 0, spec_state, experts)
    steps = [functools.partial(decode, drafter=d, width=w) for d in drafters for w in layout.widths]
    if adaptive is not None:  # the autoregressive steps of plain rounds (`step_branch`)
        steps += [functools.partial(decode, drafter=drafters[0], width=w, plain=True) for w in layout.widths]
    plain = None if adaptive is None else plain_round
    return run_slots(layout, state, prompts, steps, step_branch, prefill, sharding, plain)
