"""Speculative rollouts on the slot engine (`jaxspec.rollout.slots`): EAGLE-3 chains and trees.

Each decode step of the slot loop is one draft-and-verify step of every decoding slot
(`loop.speculative_step`, the same proposal, verification forward, exact acceptance and commit
as the staged loop, on the paged cache). The EAGLE-3 head's own KV cache is a one-layer paged
cache that shares the policy's page tables (head entry j at position j, so the pages a slot
holds cover both, and rows that share a prompt's prefix pages share the head's entries there),
and its pending chunk (`eagle3.HeadState`) is per slot. The prefill lanes
also run the head over each chunk (entry j pairs the policy's fused features at position j with
context token j + 1); the chunk that completes a context leaves the root's entry pending, as
`Eagle3Drafter.init` does after a prefill.

Randomness. The acceptance of the step that starts at row r's token i is drawn with
`fold_in(fold_in(key, r), i)` (one `kernels.tree_verify` per row, vmapped), the first token after
a prefill as in the autoregressive engine. A row's steps depend on its own tokens alone, so
without preemption the same key gives the same tokens for any S; a preempted row resumes with a
new step boundary, so its later sampled tokens are a different (equally exact) draw; greedy
rollouts are the same through preemptions. Stochastic drafts draw their noise per loop
iteration (exact, but not independent of the slot count).

Not yet on slots: the draft-model and n-gram drafters, occupancy-dependent draft depth
(`stage_draft_tokens`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

import kernels
from jaxspec.draft import draft_extend, fuse
from jaxspec.models.config import ModelConfig
from jaxspec.models.paged import NO_PAGE, init_paged_cache, paged_cache_bytes
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
    context_tokens,
    decoding_view,
    emit,
    initial_state,
    plan_layout,
    prefill_chunk,
    row_keys,
    run_slots,
)
from jaxspec.rollout.speculative.eagle3 import Eagle3Drafter, HeadState
from jaxspec.rollout.speculative.generate import make_drafter
from jaxspec.rollout.speculative.loop import speculative_step
from jaxspec.rollout.speculative.spec import Spec
from jaxspec.rollout.speculative.stats import Counts, count_step, summarize

_F32 = 4


class SpecSlots(NamedTuple):
    """The drafter's per-slot state (`eagle3.HeadState` over S slots, its cache paged) and the
    acceptance `Counts`."""

    head: HeadState
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
    if not isinstance(drafter, Eagle3Drafter):
        raise ValueError(f"spec.method={spec.method!r}: not available with slots yet (only 'eagle3')")
    num_rows, width = batch.row_prompt.shape[0], batch.tokens.shape[1]
    longest = int(batch.row_lengths.max())
    lookahead = 1 + spec.num_draft_tokens * spec.tree_width  # the verify forward's and the head's tree writes
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
    dcfg = drafter.dcfg
    head_pool = paged_cache_bytes(1, dcfg.num_kv_heads, dcfg.head_dim, layout.num_pages, layout.page_size, cache_dtype)
    verify = _F32 * layout.slots * lookahead * (4 * cfg.vocab_size + 2 * cfg.intermediate_size)
    check_fits(
        slot_memory_bytes(cfg, layout, width, cache_dtype) + head_pool + verify,
        jax.local_devices()[0].memory_stats(),
        batch=num_rows,
        prompt_len=longest,
        max_new_tokens=sampling.max_new_tokens,
    )
    prompts = Prompts.of(batch)
    max_depth = min(spec.num_draft_tokens, spec.num_tree_nodes)
    state = _loop(cfg, sampling, layout, cache_dtype, drafter, max_depth, params, dparams, prompts, key)
    out = slot_output(layout, state, cache_dtype)
    stats = summarize(state.draft.counts, state.lengths, max_depth, (layout.slots,), jnp.asarray([out.stats["steps"]]))
    return out._replace(stats={**stats, **{k: v for k, v in out.stats.items() if k not in stats}})


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "layout", "cache_dtype", "drafter", "max_depth"))
def _loop(
    cfg: ModelConfig,
    sampling: Sampling,
    layout: Layout,
    cache_dtype,
    drafter: Eagle3Drafter,
    max_depth: int,
    params: Params,
    dparams,
    prompts: Prompts,
    key,
) -> LoopState:
    """The whole speculative rollout of `prompts` on the slot engine."""
    dcfg, head, embed = drafter.dcfg, dparams["head"], dparams["embed"]
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
            spec_state.head._replace(cache=spec_state.head.cache._replace(page_table=view.page_table)),
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
            cache=_pools(state.cache, out.cache),
            cache_len=state.cache_len + jnp.where(active, out.accepted + 1, 0),
            last=jnp.where(active, out.next_token, state.last),
            draft=SpecSlots(
                head=out.draft._replace(cache=_pools(spec_state.head.cache, out.draft.cache)), counts=counts
            ),
        )

    def on_prefill(state: LoopState, lanes, valid, positions, hidden) -> LoopState:
        """The head's entries of the chunk: entry j pairs the fused features at j with token j + 1."""
        head_state = state.draft.head
        row = jnp.clip(state.row[lanes], 0, layout.rows - 1)
        ctx = state.ctx_len[lanes][:, None]
        next_tokens = jnp.where(positions + 1 < ctx, context_tokens(prompts, state.tokens, row, positions + 1), 0)
        table = jnp.where(valid[:, None], state.pool.page_table[lanes], NO_PAGE)
        _, _, cache = draft_extend(
            dcfg,
            head,
            embed,
            head_state.cache._replace(page_table=table),
            next_tokens,
            fuse(dcfg, head, hidden),
            positions,
            positions[:, 0],
            active=valid,
        )
        head_state = head_state._replace(cache=_pools(head_state.cache, cache))
        return state._replace(draft=state.draft._replace(head=head_state))

    def on_start(state: LoopState, started, first, hidden_last) -> LoopState:
        """A slot that finished its prefill drafts from its root's pending entry, as after `init`."""
        head_state = state.draft.head
        root_hidden = fuse(dcfg, head, hidden_last[:, :, None])[:, 0]  # [S, H]
        fresh = HeadState(
            cache=head_state.cache,
            tokens=jnp.zeros_like(head_state.tokens).at[:, 0].set(first),
            hidden=jnp.zeros_like(head_state.hidden).at[:, 0].set(root_hidden.astype(head_state.hidden.dtype)),
            count=jnp.ones_like(head_state.count),
        )
        pick = lambda new, old: jnp.where(started.reshape(-1, *([1] * (new.ndim - 1))), new, old)  # noqa: E731
        head_state = head_state._replace(
            tokens=pick(fresh.tokens, head_state.tokens),
            hidden=pick(fresh.hidden, head_state.hidden),
            count=pick(fresh.count, head_state.count),
        )
        return state._replace(draft=state.draft._replace(head=head_state))

    def prefill(state: LoopState) -> LoopState:
        return prefill_chunk(
            cfg, params, sampling, layout, prompts, key, state, drafter.policy_layers, on_prefill, on_start
        )

    table = jnp.full((layout.slots, layout.pages_per_slot), NO_PAGE, jnp.int32)  # set where used
    cache = init_paged_cache(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, layout.num_pages, layout.page_size, table, cache_dtype
    )
    head_cache = init_paged_cache(
        1, dcfg.num_kv_heads, dcfg.head_dim, layout.num_pages, layout.page_size, table, cache_dtype
    )
    head_state = HeadState(
        cache=head_cache,
        tokens=jnp.zeros((layout.slots, drafter.chunk), jnp.int32),
        hidden=jnp.zeros((layout.slots, drafter.chunk, dcfg.hidden_size), head["fc"].dtype),  # `fuse`'s dtype
        count=jnp.ones((layout.slots,), jnp.int32),
    )
    state = initial_state(layout, prompts, cache, cfg.pad_token_id or 0, SpecSlots(head_state, Counts.zeros(max_depth)))
    return run_slots(layout, state, prompts, decode, prefill)


def _pools(cache, view):
    """`cache` with the pools of `view` (a copy of it with other page tables, written through)."""
    return cache._replace(k=view.k, v=view.v)
