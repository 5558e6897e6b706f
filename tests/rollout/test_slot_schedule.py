"""`jaxspec.rollout.slot_schedule`: a decoding slot gets the pages of the iteration's decode steps
(`Layout.reach` positions past its length), never past its row's longest sequence, so a pool of
one row's longest sequence serves any number of decode steps per iteration (`make_room`), a row
with its own limit on emitted tokens (`Prompts.row_max_new`) reaching no further than it; and
admission reserves that reach for the rows before it, capped alike, so a pool of every slot's
longest sequence admits every slot at once however far an iteration reaches, each row with its
own reach where the pool holds it (`admit`)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models.paged import NO_PAGE, init_paged_cache
from jaxspec.rollout.page_pool import allocate
from jaxspec.rollout.slot_layout import plan_layout
from jaxspec.rollout.slot_schedule import admit, make_room
from jaxspec.rollout.slot_state import Prompts, initial_state

PROMPT, MAX_NEW, PAGE = 5, 12, 4  # the longest sequence: 5 + 12 - 1 + 1 = 17 positions, 5 pages


def pending(layout):
    """(prompts, state): layout.rows rows of one PROMPT-token prompt, all pending, every slot free,
    every page of the pool free."""
    prompts = Prompts(
        tokens=jnp.zeros((1, PROMPT), jnp.int32),
        lengths=jnp.asarray([PROMPT], jnp.int32),
        row_prompt=jnp.zeros((layout.rows,), jnp.int32),
        row_lengths=jnp.full((layout.rows,), PROMPT, jnp.int32),
        row_max_new=jnp.full((layout.rows,), layout.max_new, jnp.int32),
    )
    table = jnp.full((layout.slots, layout.pages_per_slot), NO_PAGE, jnp.int32)
    return prompts, initial_state(layout, prompts, init_paged_cache(1, 1, 2, layout.num_pages, PAGE, table), 0)


def decoding_row(decode_steps: int, emitted: int):
    """One slot decoding row 0 (prompt of PROMPT tokens, `emitted` tokens so far) in a pool of
    exactly its longest sequence, holding the pages of its positions so far."""
    layout = plan_layout(1, 1, PROMPT, PROMPT, MAX_NEW, 1, page_size=PAGE, num_pages=5, decode_steps=decode_steps)
    prompts, state = pending(layout)
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


@pytest.mark.parametrize(("limit", "held"), [(MAX_NEW, 4), (8, 4), (6, 3), (5, 3)])
def test_a_row_with_its_own_limit_gets_pages_only_up_to_it(limit, held):
    """Row 0 has emitted 4 tokens (positions 0..7, 2 pages); an iteration of 6 decode steps reaches
    positions 8..13 (4 pages), but a row limited to `limit` tokens writes at most PROMPT + limit
    positions (its last step's write included): 13 for 8 tokens, still 4 pages; 11 for 6 and
    10 for 5 tokens, 3 pages."""
    layout, prompts, state = decoding_row(6, 4)
    prompts = prompts._replace(row_max_new=jnp.full_like(prompts.row_max_new, limit))
    state = make_room(state, layout, prompts)
    assert int(state.pool.held[0]) == held and int(state.pool.num_free) == 5 - held


@pytest.mark.parametrize(
    ("decode_steps", "advance", "held"),
    [
        (1, 1, 3),  # the context's 2 pages (positions 0..4) and the step's write at 5
        (8, 1, 4),  # 5..12
        (8, 4, 5),  # an iteration reaching past the row's longest sequence: its 5 pages, no more
        (30, 8, 5),
    ],
)
def test_a_pool_of_every_slots_longest_sequence_admits_every_slot(decode_steps, advance, held):
    """Four pending rows, four slots, a pool of 4 x 5 pages: all four are admitted at once, also
    when an iteration's reach (speculative steps advance up to 1 + depth positions) is longer than
    any row; each holds its context's pages and an iteration's decode pages past it (so that it
    decodes as soon as its prefill completes), capped at its longest sequence's."""
    layout = plan_layout(
        4, 4, PROMPT, PROMPT, MAX_NEW, 1, page_size=PAGE, num_pages=20, decode_steps=decode_steps, advance=advance
    )
    assert layout.pages_per_slot == 5
    prompts, state = pending(layout)
    state = admit(state, layout, prompts)
    assert np.asarray(state.row).tolist() == [0, 1, 2, 3] and int(state.head) == 4
    assert np.asarray(state.pool.held).tolist() == [held] * 4


@pytest.mark.parametrize(
    ("emitted", "num_pages", "admitted"),
    [
        (4, 5, False),  # 2 pages held, 3 free: row 0's next 2 and row 1's 2 do not fit
        (4, 6, True),
        (12, 7, True),  # 4 held: 1 page left to the row's longest sequence, so 1 kept, not 2
        (12, 6, False),
    ],
)
def test_admission_keeps_the_running_rows_next_pages_free(emitted, num_pages, admitted):
    """Row 0 decodes in slot 0 with `emitted` tokens (its positions' pages held) and an iteration
    reaching 8 positions (2 pages of 4) further; pending row 1 needs 2 pages for its prompt. It is
    admitted only if the pool keeps row 0's next pages, as many as row 0 can still take, free."""
    layout = plan_layout(2, 2, PROMPT, PROMPT, MAX_NEW, 1, page_size=PAGE, num_pages=num_pages, decode_steps=8)
    assert layout.reach == 8
    prompts, state = pending(layout)
    cache_len = PROMPT + emitted - 1
    state = state._replace(
        row=jnp.asarray([0, -1], jnp.int32),
        decoding=jnp.asarray([True, False]),
        cache_len=jnp.asarray([cache_len, 0], jnp.int32),
        lengths=jnp.asarray([emitted, 0], jnp.int32),
        head=jnp.asarray(1, jnp.int32),
        pool=allocate(state.pool, jnp.asarray([-(-cache_len // PAGE), 0], jnp.int32), layout.pages_per_slot),
    )
    state = admit(state, layout, prompts)
    assert np.asarray(state.row).tolist() == ([0, 1] if admitted else [0, -1])
    assert int(state.head) == 1 + admitted
    # row 0's next pages kept free leave row 1 too few for its own iteration: its prompt's alone
    assert int(state.pool.held[1]) == (2 if admitted else 0)


@pytest.mark.parametrize(
    ("num_pages", "rows", "held"),
    [
        (10, [2, 0, -1, 1], [2, 2, 0, 2]),  # 6 free after the running rows' next 4: one row, its prompt's pages
        (14, [2, 0, 3, 1], [4, 2, 2, 2]),  # 10 free: two rows, the first with its iteration's pages too
    ],
)
def test_free_slots_take_the_queue_in_index_order_and_running_slots_are_untouched(num_pages, rows, held):
    """Rows 0 and 1 decode in slots 1 and 3 (5 positions written, 2 pages each, 2 more kept for
    their iteration); rows 2, 3 and 4 are pending, each needing its prompt's 2 pages. Free slots 0
    and 2 take the next rows in queue order, as many as the pool holds, as fresh prefilling rows
    admitted in that order; the running slots keep everything they had."""
    layout = plan_layout(5, 4, PROMPT, PROMPT, MAX_NEW, 1, page_size=PAGE, num_pages=num_pages, decode_steps=8)
    prompts, state = pending(layout)
    state = state._replace(
        row=jnp.asarray([-1, 0, -1, 1], jnp.int32),
        decoding=jnp.asarray([False, True, False, True]),
        ctx_len=jnp.asarray([0, 5, 0, 5], jnp.int32),
        prefilled=jnp.asarray([7, 5, 7, 5], jnp.int32),  # a free slot's stale count is reset on admission
        cache_len=jnp.asarray([0, 5, 0, 5], jnp.int32),
        lengths=jnp.asarray([1, 1, 0, 0, 0], jnp.int32),
        admitted=jnp.asarray([0, 3, 0, 4], jnp.int32),
        next_admit=jnp.asarray(5, jnp.int32),
        head=jnp.asarray(2, jnp.int32),
        pool=allocate(state.pool, jnp.asarray([0, 2, 0, 2], jnp.int32), layout.pages_per_slot),
    )
    state = admit(state, layout, prompts)
    count = sum(r >= 2 for r in rows)
    taken = [s for s in (0, 2) if rows[s] >= 0]
    assert np.asarray(state.row).tolist() == rows and int(state.head) == 2 + count
    assert np.asarray(state.pool.held).tolist() == held
    assert np.asarray(state.decoding).tolist() == [False, True, False, True]
    assert [int(state.admitted[s]) for s in taken] == [5, 6][:count] and int(state.next_admit) == 5 + count
    assert [int(state.admitted[s]) for s in (1, 3)] == [3, 4]
    assert [int(state.ctx_len[s]) for s in taken] == [PROMPT] * count
    assert [int(state.prefilled[s]) for s in taken] == [0] * count
    assert [int(state.prefilled[s]) for s in (1, 3)] == [5, 5]
