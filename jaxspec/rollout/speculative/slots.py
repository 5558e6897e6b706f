"""Speculative rollouts on the slot engine (`jaxspec.rollout.slots`): every drafter, chains and
trees.

Each decode step of the slot loop is one draft-and-verify step of every decoding slot
(`loop.speculative_step`: the same proposal, verification forward, exact acceptance and commit
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

Not yet on slots: occupancy-dependent draft depth (`stage_draft_tokens`: one depth throughout).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

import kernels
from jaxspec.models.config import ModelConfig
from jaxspec.models.paged import NO_PAGE, init_paged_cache
from jaxspec.models.transformer import Params
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
from jaxspec.rollout.speculative.loop import speculative_step
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

_F32 = 4


class SpecSlots(NamedTuple):
    """The drafter's per-slot state (`slot_drafters`) and the acceptance `Counts`."""

    draft: object
    counts: Counts


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
    drafter, dparams = make_drafter(cfg, params, sampling, spec)
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
    max_depth = min(spec.num_draft_tokens, spec.num_tree_nodes)
    state = _loop(cfg, sampling, layout, cache_dtype, drafter, max_depth, width, params, dparams, prompts, key)
    out = slot_output(layout, state, cache_dtype)
    stats = summarize(state.draft.counts, state.lengths, max_depth, (layout.slots,), jnp.asarray([out.stats["steps"]]))
    return out._replace(stats={**stats, **{k: v for k, v in out.stats.items() if k not in stats}})


@functools.partial(
    jax.jit, static_argnames=("cfg", "sampling", "layout", "cache_dtype", "drafter", "max_depth", "prompt_width")
)
def _loop(
    cfg: ModelConfig,
    sampling: Sampling,
    layout: Layout,
    cache_dtype,
    drafter,
    max_depth: int,
    prompt_width: int,
    params: Params,
    dparams,
    prompts: Prompts,
    key,
) -> LoopState:
    """The whole speculative rollout of `prompts` on the slot engine."""
    chain = drafter.width == 1
    verify_key, draft_key = jax.random.split(jax.random.fold_in(key, 1))

    def decode(state: LoopState) -> LoopState:
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
            draft=SpecSlots(draft=keep_table(out.draft, spec_state.draft), counts=counts),
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
    state = initial_state(layout, prompts, cache, cfg.pad_token_id or 0, SpecSlots(draft, Counts.zeros(max_depth)))
    return run_slots(layout, state, prompts, decode, prefill)
