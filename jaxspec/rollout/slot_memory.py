"""Device memory of the slot engine, per device (a device holds one group's pages on a mesh,
`jaxspec.rollout.slot_layout`, with its share of the KV heads)."""

from __future__ import annotations

import jax

from jaxspec.models.config import ModelConfig
from jaxspec.models.memory import device_free_bytes
from jaxspec.models.paged import paged_cache_bytes
from jaxspec.models.sharding import Sharding
from jaxspec.rollout.memory import check_fits
from jaxspec.rollout.slot_layout import Layout, plan_layout

_F32 = 4


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
) -> int:
    """Bytes one device allocates for the slot loop beyond the params (an estimate): its group's
    page pools (the policy's, and the drafter's own of `draft_kv`'s shapes), the group's outputs
    [B / G, N] and the float32 buffers of a decode step over its S / G slots and of a prefill
    chunk (logits [., V], attention scores over a slot's pages, MLP); with `verify`, the logits
    and MLP of a speculative verification of `lookahead` tokens per slot."""
    group = layout.group()
    per_page = page_bytes(cfg, layout.page_size, cache_dtype, sharding)
    if draft_kv is not None:
        per_page += page_bytes(draft_kv, layout.page_size, cache_dtype, sharding)
    span = layout.pages_per_slot * layout.page_size
    step = group.slots * (4 * cfg.vocab_size + 2 * cfg.num_heads * span + 2 * cfg.intermediate_size)
    chunk = group.lanes * group.chunk * (2 * cfg.num_heads * span + 2 * cfg.intermediate_size + cfg.hidden_size)
    checks = group.slots * layout.lookahead * (4 * cfg.vocab_size + 2 * cfg.intermediate_size) if verify else 0
    outputs = 2 * group.rows * layout.max_new + prompt_width * group.rows
    return group.num_pages * per_page + _F32 * (max(step, chunk) + checks + outputs)


def tightest_memory_stats(sharding: Sharding | None) -> dict | None:
    """The `memory_stats()` of the device of the mesh (this process's; without a mesh, the first
    local device) with the least free memory, None where none reports any (`device_free_bytes`)."""
    devices = jax.local_devices()[:1] if sharding is None else sharding.mesh.local_devices
    reported = [stats for stats in (d.memory_stats() for d in devices) if device_free_bytes(stats) is not None]
    return min(reported, key=lambda stats: device_free_bytes(stats)[0], default=None)


def slot_layout(
    cfg: ModelConfig,
    batch,
    max_new: int,
    lookahead: int,
    *,
    slots: int,
    kv_pages: int | None,
    page_size: int,
    cache_dtype,
    sharding: Sharding | None = None,
    draft_kv: ModelConfig | None = None,
    verify: bool = False,
) -> Layout:
    """The slot loop's `Layout` for a `PromptBatch` (`plan_layout`), checked against the free memory
    of the mesh's devices (ValueError naming the sizes when it does not fit)."""
    rows, width = batch.row_prompt.shape[0], batch.tokens.shape[1]
    longest = int(batch.row_lengths.max())
    memory = dict(sharding=sharding, draft_kv=draft_kv, verify=verify)
    stats = tightest_memory_stats(sharding)
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
    )
    check_fits(
        slot_memory_bytes(cfg, layout, width, cache_dtype, **memory),
        stats,
        batch=rows,
        prompt_len=longest,
        max_new_tokens=max_new,
    )
    return layout
