"""Speculative rollouts on the slot engine (`jaxspec.rollout.slots`): every drafter, chains and
trees.

Each decode step of the slot loop is one draft-and-verify step of every decoding slot
(`step.speculative_step`: the same proposal, verification forward, exact acceptance and commit
as the staged loop, on the paged cache). The drafter's own state is per slot
(`slot_drafters`): the EAGLE-3 head's and the draft model's KV are paged on the policy's page
tables and prefilled in the prefill lanes; the n-gram history is copied from a slot's context
when it starts.

Randomness. The acceptance of the step that starts at row r's token i is drawn with
`fold_in(fold_in(key, r), i)` (one `kernels.tree_verify` per row, vmapped), the first token after
a prefill as in the autoregressive engine. A row's steps depend on its own tokens alone, so
without preemption the same key gives the same tokens for any S; a preempted row resumes with a
new step boundary, so its later sampled tokens are a different (equally exact) draw; greedy
rollouts are the same through preemptions. Stochastic drafts draw their noise per loop
iteration (exact, but not independent of the slot count).

Draft depth by occupancy: `Spec.stage_draft_tokens` entry i is the depth while the decoding
slots are at most S / 2^i and more than S / 2^(i + 1) (`occupancy_sizes`), the staged loop's
stages generalised; each depth is one branch of a `lax.switch`. The depth then depends on how
many rows run beside a row, so its sampled tokens depend on S (still exact).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec import kernels
from jaxspec.models.config import ModelConfig
from jaxspec.models.paged import NO_PAGE, init_paged_cache
from jaxspec.models.params import Params
from jaxspec.rollout.continuous import slot_memory_bytes, slot_output
from jaxspec.rollout.memory import check_fits
from jaxspec.rollout.output import RolloutOutput
from jaxspec.rollout.prompts import PromptBatch
from jaxspec.rollout.sampling import Sampling
from jaxspec.rollout.slots import (
    DEFAULT_PAGE_SIZE,
    Layout,
    LoopState,
    Prompts,
    decoding_view,
    emit,
    initial_state,
    plan_layout,
    prefill_chunk,
    row_keys,
    run_slots,
)
from jaxspec.rollout.speculative.generate import make_drafter
from jaxspec.rollout.speculative.slot_drafters import (
    draft_pool_bytes,
    empty_state,
    keep_table,
    prefill_hook,
    start_hook,
    with_table,
)
from jaxspec.rollout.speculative.spec import Spec
from jaxspec.rollout.speculative.stats import Counts, count_step, summarize
from jaxspec.rollout.speculative.step import speculative_step

_F32 = 4


class SpecSlots(NamedTuple):
    """The drafter's per-slot state (`slot_drafters`), the acceptance `Counts` and the decode
    steps run at each draft depth, int32 [len(depths)]."""

    draft: object
    counts: Counts
    depth_steps: jax.Array


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
    slots: int,
    cache_dtype,
    kv_pages: int | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
) -> RolloutOutput:
    """`jaxspec.rollout.generate` with `spec` and `slots`: prompts already validated and grouped
    into `batch`, `sampling.eos_id` resolved to a tuple."""
    if spec.slot_engine_lacks:
        raise ValueError(
            f"slots: {', '.join(spec.slot_engine_lacks)} is not available on the slot engine yet "
            "(it drafts with an EAGLE-3 head, a draft model or n-grams); use slots=None"
        )
    drafter, dparams = make_drafter(cfg, params, sampling, spec)
    depths = spec.stage_depths(len(spec.stage_draft_tokens or (spec.num_draft_tokens,)))
    drafters = tuple(dataclasses.replace(drafter, depth=d, num_nodes=spec.tree_nodes(d)) for d in depths)
    num_rows, width = batch.row_prompt.shape[0], batch.tokens.shape[1]
    longest = int(batch.row_lengths.max())
    lookahead = 1 + spec.num_draft_tokens * spec.tree_width  # the verify forward's and the drafts' tree writes
    layout = plan_layout(
        num_rows,
        slots,
        width,
        longest,
        sampling.max_new_tokens,
        lookahead,
        page_size=page_size,
        num_pages=kv_pages,
    )
    verify = _F32 * layout.slots * lookahead * (4 * cfg.vocab_size + 2 * cfg.intermediate_size)
    check_fits(
        slot_memory_bytes(cfg, layout, width, cache_dtype) + draft_pool_bytes(drafter, layout, cache_dtype) + verify,
        jax.local_devices()[0].memory_stats(),
        batch=num_rows,
        prompt_len=longest,
        max_new_tokens=sampling.max_new_tokens,
    )
    prompts = Prompts.of(batch)
    max_depth = min(max(depths), spec.tree_nodes(max(depths)))  # the longest run any depth can accept
    state = _loop(cfg, sampling, layout, cache_dtype, drafters, max_depth, width, params, dparams, prompts, key)
    out = slot_output(layout, state)
    sizes = occupancy_sizes(layout.slots, len(depths))
    stats = summarize(state.draft.counts, state.lengths, max_depth, sizes, state.draft.depth_steps)
    loop_stats = {k: v for k, v in out.stats.items() if k not in stats}
    return out._replace(stats={**stats, **loop_stats, "loop_iterations": out.stats["steps"]})


@functools.partial(
    jax.jit, static_argnames=("cfg", "sampling", "layout", "cache_dtype", "drafters", "max_depth", "prompt_width")
)
def _loop(
    cfg: ModelConfig,
    sampling: Sampling,
    layout: Layout,
    cache_dtype,
    drafters: tuple,
    max_depth: int,
    prompt_width: int,
    params: Params,
    dparams,
    prompts: Prompts,
    key,
) -> LoopState:
    """The whole speculative rollout of `prompts` on the slot engine. drafters: one per draft depth
    (`occupancy_sizes`), alike but for their depth; their state is made by the deepest."""
    drafter = max(drafters, key=lambda d: d.depth)
    chain = drafter.width == 1
    verify_key, draft_key = jax.random.split(jax.random.fold_in(key, 1))
    sizes = jnp.asarray(occupancy_sizes(layout.slots, len(drafters))[1:], jnp.int32)

    def decode(state: LoopState) -> LoopState:
        active = state.decoding & (state.row >= 0)
        index = jnp.sum(active.sum() <= sizes)  # the occupancy bracket
        steps = state.draft.depth_steps.at[index].add(1)
        branches = [functools.partial(decode_with, d) for d in drafters]
        state = branches[0](state) if len(branches) == 1 else jax.lax.switch(index, branches, state)
        return state._replace(draft=state.draft._replace(depth_steps=steps))

    def decode_with(drafter, state: LoopState) -> LoopState:
        active, view = decoding_view(state)
        spec_state = state.draft
        row = jnp.clip(state.row, 0, layout.rows - 1)
        keys = row_keys(verify_key, row, state.lengths[row])

        def verify(verify_logits, tree, temperature):
            def one(logits, parents, tokens, num_nodes, key, probs):
                result = kernels.tree_verify(
                    logits[None],
                    parents[None],
                    tokens[None],
                    num_nodes[None],
                    key,
                    temperature=temperature,
                    draft_probs=None if probs is None else probs[None],
                )
                return jax.tree.map(lambda x: x[0], result)

            return jax.vmap(one)(verify_logits, tree.parents, tree.tokens, tree.num_nodes, keys, tree.draft_probs)

        out = speculative_step(
            cfg,
            params,
            sampling,
            drafter,
            dparams,
            view,
            with_table(spec_state.draft, view.page_table),
            state.last,
            state.cache_len,
            active,
            jax.random.fold_in(draft_key, state.counters["steps"]),
            verify,
            max_depth=max_depth,
            chain=chain,
        )
        state = emit(state, active, out.emitted, out.logprobs, out.accepted + 1, sampling)
        counts = count_step(spec_state.counts, out.tree.parents, out.tree.num_nodes, out.path, out.accepted, active)
        return state._replace(
            cache=state.cache._replace(k=out.cache.k, v=out.cache.v),
            cache_len=state.cache_len + jnp.where(active, out.accepted + 1, 0),
            last=jnp.where(active, out.next_token, state.last),
            draft=spec_state._replace(draft=keep_table(out.draft, spec_state.draft), counts=counts),
        )

    on_prefill = prefill_hook(drafter, dparams, layout, prompts)
    on_start = start_hook(drafter, dparams, layout, prompts)

    def prefill(state: LoopState) -> LoopState:
        return prefill_chunk(
            cfg, params, sampling, layout, prompts, key, state, drafter.policy_layers, on_prefill, on_start
        )

    table = jnp.full((layout.slots, layout.pages_per_slot), NO_PAGE, jnp.int32)  # the pool's is set where used
    cache = init_paged_cache(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, layout.num_pages, layout.page_size, table, cache_dtype
    )
    draft = empty_state(drafter, dparams, layout, prompt_width + layout.max_new, cache_dtype)
    spec_state = SpecSlots(draft, Counts.zeros(max_depth), jnp.zeros((len(drafters),), jnp.int32))
    state = initial_state(layout, prompts, cache, cfg.pad_token_id or 0, spec_state)
    return run_slots(layout, state, prompts, decode, prefill)
