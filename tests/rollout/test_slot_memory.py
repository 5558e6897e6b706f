"""slots="auto": S and the page pool from the free memory (`jaxspec.rollout.slot_memory`).

A model whose per-device bytes are worked out by hand: 2 layers, 2 KV heads of 8 (float32), pages
of 16 positions: 4096 bytes a page; prompts of 16 tokens + 48 new: 4 pages a slot. A slot's step
buffers are dominated by its prefill lane (16 positions x (2 x 4 heads x 64 + 2 x 96 + 48) floats
= 48128 bytes); the outputs take 448 bytes a row. On one device S slots need
S x (4 x 4096 + 48128) + 64 x 448 bytes; on a data x tensor = 2 x 2 mesh a device holds one of
the 2 groups (S / 2 slots, 32 rows) with 1 of the 2 KV heads: S / 2 x (4 x 2048 + 48128) + 32 x 448.
"""

import jax
import pytest

from jaxspec.models import ModelConfig, Sharding, make_mesh
from jaxspec.rollout.slot_layout import plan_layout
from jaxspec.rollout.slot_memory import AUTO_MEMORY_FRACTION, auto_layout, slot_memory_bytes

CFG = ModelConfig(
    family="llama",
    vocab_size=64,
    hidden_size=48,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)
ROWS, WIDTH, NEW = 64, 16, 48
SHAPES = dict(page_size=16, cache_dtype="float32")


def mesh_2x2() -> Sharding:
    return Sharding(make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4]))


@pytest.mark.parametrize(
    ("mesh", "free", "slots"),
    [
        (False, 10**6, 13),  # 0.9e6 bytes: 13 x 64512 + 28672 = 867328 fit, 14 slots do not
        (False, 10**9, ROWS),  # bounded by the rows
        (True, 10**6, 30),  # 15 x 56320 + 14336 = 859136 fit a device, 16 per group do not
        (True, 10**9, ROWS),
    ],
    ids=["one-device", "one-device-every-row", "mesh", "mesh-every-row"],
)
def test_auto_picks_the_most_slots_whose_longest_sequences_fit(mesh, free, slots):
    sharding = mesh_2x2() if mesh else None
    layout = auto_layout(CFG, ROWS, WIDTH, NEW, 1, free=free, sharding=sharding, **SHAPES)
    assert (layout.slots, layout.num_pages, layout.groups) == (slots, 4 * slots, 2 if mesh else 1)


@pytest.mark.parametrize("mesh", [False, True], ids=["one-device", "mesh"])
def test_auto_is_the_largest_fitting_slot_count_at_any_free_memory(mesh):
    """Over free memory from one slot's to every row's: S fits the budget and S + one step (the
    batch devices: S splits over all of them) would not; the pool holds every slot's longest
    sequence (nothing is preempted)."""
    sharding = mesh_2x2() if mesh else None
    step = 2 if mesh else 1
    for free in [int(1.2e5 * 1.37**i) for i in range(20)]:
        layout = auto_layout(CFG, ROWS, WIDTH, NEW, 1, free=free, sharding=sharding, **SHAPES)
        budget = free * AUTO_MEMORY_FRACTION
        assert slot_memory_bytes(CFG, layout, WIDTH, "float32", sharding=sharding) <= budget
        assert layout.slots % step == 0 and layout.num_pages == layout.slots * layout.pages_per_slot
        if layout.slots < ROWS:
            more = plan_layout(ROWS, layout.slots + step, WIDTH, WIDTH, NEW, 1, page_size=16, sharding=sharding)
            assert slot_memory_bytes(CFG, more, WIDTH, "float32", sharding=sharding) > budget


def test_too_little_memory_for_one_slot_is_refused_with_its_sizes():
    with pytest.raises(ValueError, match=r"slots=auto: one slot .* needs 93184 bytes per device \(4 KV pages of 16"):
        auto_layout(CFG, ROWS, WIDTH, NEW, 1, free=10**5, **SHAPES)
