"""`jaxspec.rollout.slot_schedule.make_room`: a decoding slot gets the pages of the iteration's
decode steps (`Layout.reach` positions past its length), never past its row's longest sequence,
so a pool of one row's longest sequence serves any number of decode steps per iteration."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models.paged import NO_PAGE, init_paged_cache
from jaxspec.rollout.page_pool import allocate
from jaxspec.rollout.slot_layout import plan_layout
from jaxspec.rollout.slot_schedule import make_room
from jaxspec.rollout.slot_state import Prompts, initial_state

PROMPT, MAX_NEW, PAGE = 5, 12, 4  # the longest sequence: 5 + 12 - 1 + 1 = 17 positions, 5 pages


def decoding_row(decode_steps: int, emitted: int):
    """One slot decoding row 0 (prompt of PROMPT tokens, `emitted` tokens so far) in a pool of
    exactly its longest sequence, holding the pages of its positions so far."""
    layout = plan_layout(1, 1, PROMPT, PROMPT, MAX_NEW, 1, page_size=PAGE, num_pages=5, decode_steps=decode_steps)
    prompts = Prompts(
        tokens=jnp.zeros((1, PROMPT), jnp.int32),
        lengths=jnp.asarray([PROMPT], jnp.int32),
        row_prompt=jnp.asarray([0], jnp.int32),
        row_lengths=jnp.asarray([PROMPT], jnp.int32),
    )
    table = jnp.full((1, layout.pages_per_slot), NO_PAGE, jnp.int32)
    state = initial_state(layout, prompts, init_paged_cache(1, 1, 2, 5, PAGE, table), 0)
    cache_len = PROMPT + emitted - 1
    held = -(-cache_len // PAGE)
    state = state._replace(
        row=jnp.asarray([0], jnp.int32),
        decoding=jnp.asarray([True]),
        cache_len=jnp.asarray([cache_len], jnp.int32),
        lengths=jnp.asarray([emitted], jnp.int32),
        head=jnp.asarray(1, jnp.int32),
        pool=allocate(state.pool, jnp.asarray([held], jnp.int32), layout.pages_per_slot),
    )
    return layout, prompts, state


@pytest.mark.parametrize(
    ("decode_steps", "emitted", "held"),
    [
        (1, 4, 3),  # positions 0..7 written, the step writes 8: 3 pages
        (3, 4, 3),  # 8, 9, 10: 3 pages
        (6, 4, 4),  # 8..13: 4 pages
        (8, 4, 4),  # 8..15
        (8, 9, 5),  # 13..20, but the row's last step writes 16: its 5 pages, no more
        (30, 1, 5),
    ],
)
def test_a_decoding_row_gets_the_iterations_pages_up_to_its_longest_sequence(decode_steps, emitted, held):
    layout, prompts, state = decoding_row(decode_steps, emitted)
    state = make_room(state, layout, prompts)
    assert int(state.pool.held[0]) == held and int(state.pool.num_free) == 5 - held
    assert int(state.counters["preemptions"]) == 0
    pages = np.asarray(state.pool.page_table[0, :held])
    assert sorted(pages.tolist()) == sorted(set(pages.tolist())) and (pages >= 0).all()
