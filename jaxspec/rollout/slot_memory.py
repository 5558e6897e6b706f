"""Device memory of the slot engine, and `slots="auto"`: S and the page pool from the free memory.

The rule (`auto_layout`): S is the most decode slots, at most the call's rows, whose pages for
their longest sequences (S x pages_for(prompt bucket + max_new_tokens - 1 + a step's lookahead))
fit in `AUTO_MEMORY_FRACTION` of a device's free memory together with the loop's other buffers
(`slot_memory_bytes`: the step's and a prefill chunk's activations, the outputs); the pool is
exactly those pages, so no row is ever preempted. On a mesh the count is per device: a device
holds one group's pages (`jaxspec.rollout.slot_layout`) with its share of the KV heads, so S
comes in multiples of the batch axes' devices that split the rows. The free memory is the least
any of the mesh's devices reports (`jaxspec.models.memory.device_free_bytes`: bytes_limit -
bytes_in_use, the params already in); a backend that reports none (the CPU) is taken to have
`CPU_FREE_BYTES`. The choice is logged once (logger "jaxspec.rollout") with S, the pages, the
bytes of a page per device and the free bytes, and reused by later calls of the same shapes
while it fits, so that they reuse one compiled program.
"""

from __future__ import annotations

import logging

import jax

from jaxspec.models.config import ModelConfig
from jaxspec.models.memory import device_free_bytes
from jaxspec.models.paged import paged_cache_bytes
from jaxspec.models.sharding import Sharding
from jaxspec.rollout.experts import recorded_experts_bytes
from jaxspec.rollout.memory import check_fits
from jaxspec.rollout.slot_layout import Layout, batch_groups, plan_layout

AUTO = "auto"
AUTO_MEMORY_FRACTION = 0.9  # of the free memory; the rest is left to XLA's temporaries
CPU_FREE_BYTES = 2 * 2**30  # per device, where the backend reports no free memory

_F32 = 4
log = logging.getLogger("jaxspec.rollout")
_chosen: dict = {}  # shapes -> the Layout slots="auto" chose for them


def page_bytes(cfg: ModelConfig, page_size: int, cache_dtype, sharding: Sharding | None = None) -> int:
    """Bytes one device holds of a page of a paged cache of `cfg`'s shapes (every layer's k and v;
    the KV heads split over the mesh's tensor axis where it divides them)."""
    whole = paged_cache_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1, page_size, cache_dtype)
    return whole // kv_head_shards(sharding, cfg.num_kv_heads)


def kv_head_shards(sharding: Sharding | None, num_kv_heads: int) -> int:
    """Devices the KV heads of a page pool split over (the "kv_heads" rule; 1 without a mesh)."""
    if sharding is None:
        return 1
    part = sharding.spec(("kv_heads",), (num_kv_heads,))[0]
    axes = () if part is None else (part,) if isinstance(part, str) else part
    total = 1
    for axis in axes:
        total *= sharding.mesh.shape[axis]
    return total


def slot_memory_bytes(
    cfg: ModelConfig,
    layout: Layout,
    prompt_width: int,
    cache_dtype,
    *,
    sharding: Sharding | None = None,
    draft_kv: ModelConfig | None = None,
    verify: bool = False,
    record_experts: bool = False,
    draft_slot_bytes: int = 0,
) -> int:
    """Bytes one device allocates for the slot loop beyond the params (an estimate): its group's
    page pools (the policy's, and the drafter's own of `draft_kv`'s shapes), the group's outputs
    [B / G, N] and the float32 buffers of a decode step over its S / G slots and of a prefill
    chunk (logits [., V], attention scores over a slot's pages, MLP); with `verify`, the logits
    and MLP of a speculative verification of `lookahead` tokens per slot; with `record_experts`,
    the group's record of the routing (`jaxspec.rollout.experts.SlotExperts`); draft_slot_bytes:
    what a drafter's step takes per slot beyond its pools (the suffix drafter's gathered sources)."""
    group = layout.group()
    per_page = page_bytes(cfg, layout.page_size, cache_dtype, sharding)
    if draft_kv is not None:
        per_page += page_bytes(draft_kv, layout.page_size, cache_dtype, sharding)
    span = layout.pages_per_slot * layout.page_size
    step = group.slots * (4 * cfg.vocab_size + 2 * cfg.num_heads * span + 2 * cfg.intermediate_size)
    chunk = group.lanes * group.chunk * (2 * cfg.num_heads * span + 2 * cfg.intermediate_size + cfg.hidden_size)
    checks = group.slots * layout.lookahead * (4 * cfg.vocab_size + 2 * cfg.intermediate_size) if verify else 0
    outputs = 2 * group.rows * layout.max_new + prompt_width * group.rows
    record = 0
    if record_experts:
        record = recorded_experts_bytes(cfg, group.rows, prompt_width + layout.max_new)
        record += recorded_experts_bytes(cfg, group.rows, prompt_width)  # the distinct prompts', at most B / G
    drafts = group.slots * draft_slot_bytes
    return group.num_pages * per_page + _F32 * (max(step, chunk) + checks + outputs) + record + drafts


def tightest_memory_stats(sharding: Sharding | None) -> dict | None:
    """The `memory_stats()` of the device of the mesh (this process's; without a mesh, the first
    local device) with the least free memory, None where none reports any (`device_free_bytes`)."""
    devices = jax.local_devices()[:1] if sharding is None else sharding.mesh.local_devices
    reported = [stats for stats in (d.memory_stats() for d in devices) if device_free_bytes(stats) is not None]
    return min(reported, key=lambda stats: device_free_bytes(stats)[0], default=None)


def auto_layout(
    cfg: ModelConfig,
    rows: int,
    prompt_width: int,
    max_new: int,
    lookahead: int,
    *,
    free: int,
    page_size: int,
    cache_dtype,
    sharding: Sharding | None = None,
    draft_kv: ModelConfig | None = None,
    verify: bool = False,
    record_experts: bool = False,
    draft_slot_bytes: int = 0,
) -> Layout:
    """The `Layout` slots="auto" picks (module docstring) for `rows` rows of prompts padded to
    `prompt_width`, with `free` bytes free per device. Raises ValueError naming the sizes when not
    even one slot fits."""
    budget = int(free * AUTO_MEMORY_FRACTION)

    def plan(slots: int) -> Layout:
        return plan_layout(
            rows, slots, prompt_width, prompt_width, max_new, lookahead, page_size=page_size, sharding=sharding
        )

    def needed(slots: int) -> int:
        memory = dict(
            sharding=sharding,
            draft_kv=draft_kv,
            verify=verify,
            record_experts=record_experts,
            draft_slot_bytes=draft_slot_bytes,
        )
        return slot_memory_bytes(cfg, plan(slots), prompt_width, cache_dtype, **memory)

    step = batch_groups(sharding, rows)  # S in multiples of it splits over every batch device
    low, high = 0, rows // step  # needed(low * step) fits (or low = 0); needed((high + 1) * step) does not
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if needed(mid * step) <= budget else (low, mid - 1)
    if low:
        return plan(low * step)
    fewer = [s for s in range(step - 1, 0, -1) if needed(s) <= budget]
    if not fewer:
        raise ValueError(
            f"slots=auto: one slot of prompt bucket {prompt_width} + max_new_tokens {max_new} needs {needed(1)} "
            f"bytes per device ({plan(1).num_pages} KV pages of {page_size} positions), more than "
            f"{AUTO_MEMORY_FRACTION:.0%} of the {free} bytes free; lower max_new_tokens or the prompt length"
        )
    return plan(fewer[0])


def _stated_auto_layout(cfg, rows, width, max_new, lookahead, free, page_size, cache_dtype, memory) -> Layout:
    """`auto_layout` for these shapes with `free` bytes per device (None: not reported, the CPU
    fallback): the one chosen before while it fits, else a new one, logged."""
    shapes = (cfg, rows, width, max_new, lookahead, page_size, str(cache_dtype), *memory.values())
    available = CPU_FREE_BYTES if free is None else free
    layout = _chosen.get(shapes)
    if layout is not None and slot_memory_bytes(cfg, layout, width, cache_dtype, **memory) <= available:
        return layout
    layout = auto_layout(
        cfg, rows, width, max_new, lookahead, free=available, page_size=page_size, cache_dtype=cache_dtype, **memory
    )
    _chosen[shapes] = layout
    per_page = page_bytes(cfg, page_size, cache_dtype, memory["sharding"])
    if memory["draft_kv"] is not None:
        per_page += page_bytes(memory["draft_kv"], page_size, cache_dtype, memory["sharding"])
    log.info(
        "slots=auto: %d slots over %d rows, %d KV pages of %d positions (%d per device), %d bytes per page per "
        "device, %d bytes free per device%s",
        layout.slots,
        rows,
        layout.num_pages,
        page_size,
        layout.num_pages // layout.groups,
        per_page,
        available,
        "" if free is not None else " (not reported by the backend: the CPU fallback)",
    )
    return layout


def slot_layout(
    cfg: ModelConfig,
    batch,
    max_new: int,
    lookahead: int,
    *,
    slots: int | str,
    kv_pages: int | None,
    page_size: int,
    cache_dtype,
    sharding: Sharding | None = None,
    draft_kv: ModelConfig | None = None,
    verify: bool = False,
    record_experts: bool = False,
    draft_slot_bytes: int = 0,
    advance: int = 1,
    decode_steps: int | None = None,
) -> Layout:
    """The slot loop's `Layout` for a `PromptBatch`: `plan_layout` of an integer `slots`, or the
    `auto_layout` of slots="auto" (stated once, module docstring), checked against the free
    memory of a device (ValueError naming the sizes when it does not fit); record_experts: the
    loop records the routing too; draft_slot_bytes: a drafter's step buffers per slot
    (`slot_memory_bytes`); advance, decode_steps: `plan_layout`'s."""
    if isinstance(slots, str) and slots != AUTO:
        raise ValueError(f"slots must be None, {AUTO!r} or an integer >= 1, got {slots!r}")
    rows, width = batch.row_prompt.shape[0], batch.tokens.shape[1]
    longest = int(batch.row_lengths.max())
    memory = dict(
        sharding=sharding,
        draft_kv=draft_kv,
        verify=verify,
        record_experts=record_experts,
        draft_slot_bytes=draft_slot_bytes,
    )
    stats = tightest_memory_stats(sharding)
    free = None if stats is None else device_free_bytes(stats)[0]
    if slots == AUTO:
        if kv_pages is not None:
            raise ValueError(
                f"kv_pages={kv_pages}: slots='auto' chooses the page pool; pass an integer slots to set it"
            )
        slots = _stated_auto_layout(cfg, rows, width, max_new, lookahead, free, page_size, cache_dtype, memory).slots
    layout = plan_layout(
        rows,
        slots,
        width,
        longest,
        max_new,
        lookahead,
        page_size=page_size,
        num_pages=kv_pages,
        sharding=sharding,
        advance=advance,
        decode_steps=decode_steps,
    )
    check_fits(
        slot_memory_bytes(cfg, layout, width, cache_dtype, **memory),
        stats,
        batch=rows,
        prompt_len=longest,
        max_new_tokens=max_new,
        slots=layout.slots,
        kv_pages=layout.num_pages,
    )
    return layout
