"""The prefix cache never keeps the next pending row out of the pool: when the row does not fit,
the prefixes no running row holds are let go (an end-to-end run of this case used to spin
forever: every slot free, the pool's pages held by cached prefixes of prompts with pending rows)."""

import jax.numpy as jnp
import numpy as np

from jaxspec.models.paged import NO_PAGE, init_paged_cache
from jaxspec.rollout.prefix_cache import PrefixCache
from jaxspec.rollout.slot_layout import plan_layout
from jaxspec.rollout.slot_schedule import admit
from jaxspec.rollout.slot_state import Prompts, initial_state


def blocked_state():
    """Rows 0, 1 (prompts 0, 1: 21 and 19 tokens) finished and their one-page prefixes cached;
    rows 2, 3 (the same prompts) pending; a pool of 3 pages of 16 positions, 1 free, both slots
    free. Row 2 needs 2 pages."""
    layout = plan_layout(4, 2, 32, 21, 1, 1, page_size=16, num_pages=3)
    tokens = np.zeros((2, 32), np.int32)
    prompts = Prompts(
        tokens=jnp.asarray(tokens),
        lengths=jnp.asarray([21, 19], jnp.int32),
        row_prompt=jnp.asarray([0, 1, 0, 1], jnp.int32),
        row_lengths=jnp.asarray([21, 19, 21, 19], jnp.int32),
        row_max_new=jnp.full((4,), layout.max_new, jnp.int32),
    )
    table = jnp.full((layout.slots, layout.pages_per_slot), NO_PAGE, jnp.int32)
    state = initial_state(layout, prompts, init_paged_cache(1, 1, 2, 3, 16, table), 0)
    pool = state.pool._replace(
        free=jnp.asarray([2, 0, 0], jnp.int32), num_free=jnp.asarray(1, jnp.int32), refs=jnp.asarray([1, 1, 0])
    )
    state = state._replace(
        pool=pool,
        prefix=PrefixCache(pages=jnp.asarray([[0], [1]], jnp.int32), ready=jnp.asarray([True, True])),
        done=jnp.asarray([True, True, False, False]),
        lengths=jnp.asarray([1, 1, 0, 0], jnp.int32),
        head=jnp.asarray(2, jnp.int32),
    )
    return layout, prompts, state


def test_the_next_row_is_admitted_when_cached_prefixes_block_it():
    layout, prompts, state = blocked_state()
    assert layout.pages_per_slot == 3 and layout.prefix_pages == 1
    state = admit(state, layout, prompts)
    assert int(state.head) == 3 and np.asarray(state.row).tolist() == [2, -1]
    assert not np.asarray(state.prefix.ready).any()  # both prefixes were let go
    held = np.asarray(state.pool.page_table)[0, : int(state.pool.held[0])].tolist()
    assert len(held) == 2 and int(state.pool.num_free) == 1
    assert sorted(held + np.asarray(state.pool.free)[:1].tolist()) == [0, 1, 2]  # every page owned once or free
