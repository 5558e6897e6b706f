"""`generate(..., slots=S)`: autoregressive rollouts on the slot engine (`jaxspec.rollout.slots`).

One jitted program runs the whole call (prefill chunks, decode steps, admissions and
preemptions); the host reads its outputs once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.distributed import to_host
from jaxspec.models.config import ModelConfig
from jaxspec.models.paged import NO_PAGE, init_paged_cache, paged_cache_bytes
from jaxspec.models.params import Params
from jaxspec.models.transformer import extend
from jaxspec.rollout.memory import check_fits
from jaxspec.rollout.output import RolloutOutput
from jaxspec.rollout.prompts import PromptBatch
from jaxspec.rollout.sampling import Sampling
from jaxspec.rollout.slots import (
    DEFAULT_PAGE_SIZE,
    Layout,
    LoopState,
    Prompts,
    choose_per_row,
    decoding_view,
    emit,
    initial_state,
    plan_layout,
    prefill_chunk,
    row_keys,
    run_slots,
)

_F32 = 4


def slot_memory_bytes(cfg: ModelConfig, layout: Layout, prompt_width: int, cache_dtype) -> int:
    """Device bytes the slot loop allocates beyond the params (an estimate): the page pools, the
    outputs [B, N] and the float32 buffers of a decode step over S slots and of a prefill chunk
    (logits [., V], attention scores over a slot's pages, MLP)."""
    pools = paged_cache_bytes(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, layout.num_pages, layout.page_size, cache_dtype
    )
    span = layout.pages_per_slot * layout.page_size
    step = layout.slots * (4 * cfg.vocab_size + 2 * cfg.num_heads * span + 2 * cfg.intermediate_size)
    chunk = layout.lanes * layout.chunk * (2 * cfg.num_heads * span + 2 * cfg.intermediate_size + cfg.hidden_size)
    return pools + _F32 * (max(step, chunk) + 2 * layout.rows * layout.max_new + prompt_width * layout.rows)


def slot_generate(
    cfg: ModelConfig,
    params: Params,
    batch: PromptBatch,
    key: jax.Array,
    sampling: Sampling,
    *,
    slots: int,
    cache_dtype,
    kv_pages: int | None = None,
    page_size: int = DEFAULT_PAGE_SIZE,
) -> RolloutOutput:
    """`jaxspec.rollout.generate` with `slots`, autoregressive: prompts already validated and
    grouped into `batch`, `sampling.eos_id` resolved to a tuple."""
    num_rows, width = batch.row_prompt.shape[0], batch.tokens.shape[1]
    layout = plan_layout(
        num_rows,
        slots,
        width,
        int(batch.row_lengths.max()),
        sampling.max_new_tokens,
        1,
        page_size=page_size,
        num_pages=kv_pages,
    )
    check_fits(
        slot_memory_bytes(cfg, layout, width, cache_dtype),
        jax.local_devices()[0].memory_stats(),
        batch=num_rows,
        prompt_len=int(batch.row_lengths.max()),
        max_new_tokens=sampling.max_new_tokens,
    )
    prompts = Prompts.of(batch)
    state = _loop(cfg, sampling, layout, cache_dtype, params, prompts, key)
    return slot_output(layout, state)


def slot_output(layout: Layout, state: LoopState) -> RolloutOutput:
    """The `RolloutOutput` of a finished slot loop; stats add "slots", "kv_pages" (the pool),
    "page_size", "peak_kv_pages" (most pages in use at once), "prefill_chunks", "preemptions" and
    "prefix_pages_shared" (pages rows took from their prompt's prefix cache instead of prefilling)."""
    counters = {name: int(to_host(v)) for name, v in state.counters.items()}
    lengths = state.lengths
    stats = {
        "steps": counters["steps"],
        "stage_rows": [layout.slots],
        "stage_steps": [counters["steps"]],
        "acceptance_length": 1.0,
        "acceptance_rate_per_position": np.zeros((0,), np.float32),
        "generated_tokens": int(to_host(lengths).sum()),
        "slots": layout.slots,
        "kv_pages": layout.num_pages,
        "page_size": layout.page_size,
        "peak_kv_pages": counters["peak_pages"],
        "prefill_chunks": counters["prefill_chunks"],
        "preemptions": counters["preemptions"],
        "prefix_pages_shared": counters["prefix_pages_shared"],
    }
    return RolloutOutput(tokens=state.tokens, lengths=lengths, logprobs=state.logprobs, stats=stats)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "layout", "cache_dtype"))
def _loop(
    cfg: ModelConfig, sampling: Sampling, layout: Layout, cache_dtype, params: Params, prompts: Prompts, key
) -> LoopState:
    """The whole autoregressive rollout of `prompts` on the slot engine."""

    def decode(state: LoopState) -> LoopState:
        active, view = decoding_view(state)
        logits, _, view = extend(
            cfg, params, view, state.last[:, None], state.cache_len[:, None], state.cache_len, active=active
        )
        row = jnp.clip(state.row, 0, layout.rows - 1)
        token, logprob = choose_per_row(row_keys(key, row, state.lengths[row]), logits[:, 0], sampling)
        state = emit(state, active, token[:, None], logprob[:, None], active.astype(jnp.int32), sampling)
        return state._replace(
            cache=state.cache._replace(k=view.k, v=view.v),
            cache_len=state.cache_len + active,
            last=jnp.where(active, token, state.last),
        )

    def prefill(state: LoopState) -> LoopState:
        return prefill_chunk(cfg, params, sampling, layout, prompts, key, state)

    cache = init_paged_cache(
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
        layout.num_pages,
        layout.page_size,
        jnp.full((layout.slots, layout.pages_per_slot), NO_PAGE, jnp.int32),  # the pool's is set where used
        cache_dtype,
    )
    state = initial_state(layout, prompts, cache, cfg.pad_token_id or 0)
    return run_slots(layout, state, prompts, decode, prefill)
