"""`generate(..., slots=S)`: autoregressive rollouts on the slot engine (`jaxspec.rollout.slots`).

One jitted program runs the whole call (prefill chunks, decode steps, admissions and
preemptions), on one device or on a mesh (`jaxspec.rollout.slot_state`); the host reads its
outputs once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.distributed import to_host
from jaxspec.models.config import ModelConfig
from jaxspec.models.paged import NO_PAGE, init_paged_cache
from jaxspec.models.params import Params
from jaxspec.models.sharding import Sharding
from jaxspec.models.transformer import extend
from jaxspec.rollout.compiler_options import rollout_jit
from jaxspec.rollout.experts import SlotExperts
from jaxspec.rollout.output import RolloutOutput
from jaxspec.rollout.prompts import PromptBatch
from jaxspec.rollout.sampling import Sampling, choose_per_row, row_keys
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
from jaxspec.rollout.slot_width import at_width
from jaxspec.rollout.slots import decoding_table, emit, prefill_chunk, record_steps, run_slots


def slot_generate(
    cfg: ModelConfig,
    params: Params,
    batch: PromptBatch,
    key: jax.Array,
    sampling: Sampling,
    *,
    slots: int | str,
    cache_dtype,
    kv_pages: int | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
    sharding: Sharding | None = None,
    record_experts: bool = False,
    decode_steps: int | None = None,
) -> RolloutOutput:
    """`jaxspec.rollout.generate` with `slots` (an integer or "auto"), autoregressive: prompts
    already validated and grouped into `batch`, `sampling.eos_id` resolved to a tuple."""
    layout = slot_layout(
        cfg,
        batch,
        sampling.max_new_tokens,
        1,
        slots=slots,
        kv_pages=kv_pages,
        page_size=page_size,
        cache_dtype=cache_dtype,
        sharding=sharding,
        record_experts=record_experts,
        decode_steps=decode_steps,
    )
    prompts = Prompts.of(batch, layout.groups)
    state = _loop(cfg, sampling, layout, cache_dtype, sharding, record_experts, params, prompts, key)
    return slot_output(layout, state, prompts)


def slot_output(layout: Layout, state: LoopState, prompts: Prompts) -> RolloutOutput:
    """The `RolloutOutput` of a finished slot loop (rows in the call's order), with the recorded
    experts [B, P + N, L_sparse, k] where the loop recorded them; "step_widths" are the decode
    step's widths and "width_steps" the decode steps run at each (`jaxspec.rollout.slot_width`;
    also "stage_rows" / "stage_steps", the staged engine's names); "steps" counts the decode steps
    and "loop_iterations" the loop's iterations (each: the schedule, up to `Layout.decode_steps`
    decode steps, a prefill chunk); stats add "slots",
    "kv_pages" (the pool, every group's), "page_size", "groups" (the mesh's groups of rows, slots
    and pages), "peak_kv_pages" (most pages in use at once), "prefill_chunks", "preemptions" and
    "prefix_pages_shared" (pages rows took from their prompt's prefix cache instead of
    prefilling)."""
    counters = summed(layout, {k: state.counters[k] for k in ("preemptions", "prefix_pages_shared")})
    first = ("iterations", "decode_steps", "prefill_chunks", "peak_pages")
    counters |= first_group(layout, {k: state.counters[k] for k in first})
    width_steps = [int(n) for n in to_host(first_group(layout, state.counters["width_steps"]))]
    counters = {name: int(to_host(v)) for name, v in counters.items()}
    lengths = rows_of(layout, state.lengths)
    stats = {
        "steps": counters["decode_steps"],
        "loop_iterations": counters["iterations"],
        "stage_rows": list(layout.widths),
        "stage_steps": width_steps,
        "acceptance_length": 1.0,
        "acceptance_rate_per_position": np.zeros((0,), np.float32),
        "generated_tokens": int(to_host(lengths).sum()),
        "step_widths": list(layout.widths),
        "width_steps": width_steps,
        "slots": layout.slots,
        "kv_pages": layout.num_pages,
        "page_size": layout.page_size,
        "groups": layout.groups,
        "peak_kv_pages": counters["peak_pages"],
        "prefill_chunks": counters["prefill_chunks"],
        "preemptions": counters["preemptions"],
        "prefix_pages_shared": counters["prefix_pages_shared"],
    }
    experts = None
    if state.experts is not None:
        merge = map_groups(layout, lambda s, p: s.experts.output(p.row_prompt, p.row_lengths))
        experts = rows_of(layout, merge(state, prompts))
    return RolloutOutput(
        tokens=rows_of(layout, state.tokens),
        lengths=lengths,
        logprobs=rows_of(layout, state.logprobs),
        stats=stats,
        experts=experts,
    )


def record_buffer(cfg: ModelConfig, layout: Layout, prompts: Prompts) -> SlotExperts:
    """One group's empty record of the routing of its rows' P + N positions."""
    width = prompts.tokens.shape[1]
    return SlotExperts.create(cfg, layout.group().rows, prompts.tokens.shape[0], width, width + layout.max_new)


def empty_cache(cfg: ModelConfig, layout: Layout, cache_dtype):
    """One group's empty page pools of a model of `cfg`'s shapes (its page table is the pool's,
    set where it is used)."""
    group = layout.group()
    table = jnp.full((group.slots, layout.pages_per_slot), NO_PAGE, jnp.int32)
    return init_paged_cache(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, group.num_pages, layout.page_size, table, cache_dtype
    )


@rollout_jit(static_argnames=("cfg", "sampling", "layout", "cache_dtype", "sharding", "record"))
def _loop(
    cfg: ModelConfig,
    sampling: Sampling,
    layout: Layout,
    cache_dtype,
    sharding: Sharding | None,
    record: bool,
    params: Params,
    prompts: Prompts,
    key,
) -> LoopState:
    """The whole autoregressive rollout of `prompts` on the slot engine; record: the carry
    records the routing (`jaxspec.rollout.experts.SlotExperts`)."""
    group = layout.group()

    def forward(inputs, carry, pools):
        """The decode forward of W slots: (logits [W, V] and the routing, carry, pools)."""
        table, last, length, active = inputs
        view = state_cache(pools)._replace(page_table=table)
        logits, _, view, *experts = extend(
            cfg,
            params,
            view,
            last[:, None],
            length[:, None],
            length,
            active=active,
            sharding=sharding,
            record_experts=record,
        )
        return (logits[:, 0], *experts), carry, (view.k, view.v)

    def decode(state: LoopState, active: jax.Array, count: jax.Array, width: int) -> LoopState:
        """One decode step of every group's decoding slots (active bool [G, S], `count` of them: the
        choice of width was made from it), on `width` slots."""
        table = map_groups(layout, lambda s, p, a: decoding_table(s, a))(state, prompts, active)
        inputs = slots_flat(layout, (table, state.last, state.cache_len, active))
        (logits, *experts), _, (k, v) = at_width(width, inputs[3], forward, inputs, (), (state.cache.k, state.cache.v))
        state = state._replace(cache=state.cache._replace(k=k, v=v))
        if record:
            written = active[..., None]
            state = map_groups(layout, record_steps)(state, prompts, written, slots_grouped(layout, experts[0]))
        return map_groups(layout, sample)(state, prompts, active, slots_grouped(layout, logits))

    def sample(state: LoopState, prompts: Prompts, active: jax.Array, logits: jax.Array) -> LoopState:
        """One group's decoding slots take their next token from logits float32 [S, V]."""
        row = jnp.clip(state.row, 0, group.rows - 1)
        keys = row_keys(key, state.first_row + row, state.lengths[row])
        token, logprob = choose_per_row(keys, logits, sampling)
        state = emit(state, prompts, active, token[:, None], logprob[:, None], active.astype(jnp.int32), sampling)
        return state._replace(cache_len=state.cache_len + active, last=jnp.where(active, token, state.last))

    def prefill(state: LoopState) -> LoopState:
        return prefill_chunk(cfg, params, sampling, layout, prompts, key, state)

    experts = record_buffer(cfg, layout, prompts) if record else None
    cache = empty_cache(cfg, layout, cache_dtype)

    def state_cache(pools):
        return cache._replace(k=pools[0], v=pools[1])

    state = initial_state(layout, prompts, cache, cfg.pad_token_id or 0, None, experts)
    steps = [functools.partial(decode, width=width) for width in layout.widths]
    return run_slots(layout, state, prompts, steps, lambda count, width, _: width, prefill, sharding)
