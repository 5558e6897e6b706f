"""The static shape of a slot loop (`jaxspec.rollout.slots`): slots, pages, prefill lanes, and the
groups a mesh splits them into.

On a mesh the call's rows, the slots and the page pool split into G groups over the mesh's batch
axes (data x fsdp: the "batch" sharding rule), G = the product of those axes that divide both the
rows and the slots (a dimension the mesh axes do not divide stays whole, as everywhere in
`jaxspec.models.sharding`). Group g runs rows [g B / G, (g + 1) B / G) through its own S / G slots
over its own P / G pages, on its own devices; the groups step in lockstep in one loop. One device
(no mesh) is one group.
"""

from __future__ import annotations

import dataclasses
import math

from jaxspec.models.sharding import Sharding
from jaxspec.rollout.page_pool import pages_for
from jaxspec.rollout.slot_width import step_widths

DEFAULT_PAGE_SIZE = 16  # token positions per page
PREFILL_CHUNK = 16  # context tokens a prefill lane writes: a row that takes its prompt's cached prefix writes
# fewer than a page (16 positions by default), and 16 new tokens x up to 8 query heads per KV head
# are query rows the attention kernel takes (a wider chunk attends through XLA's gather of the table)
PREFILL_TOKENS = 512  # context tokens all prefill lanes write per step (at least one lane per group)
DECODE_STEPS = 16  # decode steps per loop iteration: the schedule's cost is paid once per this many


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static shape of a slot loop (hashable: a `jax.jit` static argument).

    rows: B rows of the call; slots: S; max_new: N; page_size; pages_per_slot: M, page-table
    entries per slot; num_pages: the pool, P; chunk: context tokens per prefill lane; lanes:
    prefill lanes per prefill step (a slot may take several, `jaxspec.rollout.slots`); lookahead:
    positions past its length one decode step writes (1 for autoregressive decoding, 1 + draft
    nodes for speculative steps); advance: the most positions one decode step moves a row on (1;
    1 + the deepest draft); decode_steps: K, decode steps per loop iteration
    (`jaxspec.rollout.slots`); prefix_pages: the most pages a prompt's rows share
    (`jaxspec.rollout.prefix_cache`); groups: G, the groups the rows, slots, pages and lanes split
    into on a mesh (each a multiple of G); widths: the decode step's widths, widest (S) first
    (`jaxspec.rollout.slot_width`).
    """

    rows: int
    slots: int
    max_new: int
    page_size: int
    pages_per_slot: int
    num_pages: int
    chunk: int
    lanes: int
    lookahead: int
    prefix_pages: int
    groups: int = 1
    widths: tuple[int, ...] = ()
    advance: int = 1
    decode_steps: int = 1

    @property
    def reach(self) -> int:
        """Positions past its length that a row's decode steps of one loop iteration write."""
        return self.lookahead + (self.decode_steps - 1) * self.advance

    def group(self) -> Layout:
        """The layout of one group: B / G rows, S / G slots, P / G pages, lanes / G lanes."""
        g = self.groups
        return dataclasses.replace(
            self,
            rows=self.rows // g,
            slots=self.slots // g,
            num_pages=self.num_pages // g,
            lanes=self.lanes // g,
            groups=1,
        )


def batch_groups(sharding: Sharding | None, size: int) -> int:
    """Groups of the mesh's batch axes that split a dimension of `size` (1 without a mesh)."""
    if sharding is None:
        return 1
    part = sharding.spec(("batch",), (size,))[0]
    axes = () if part is None else (part,) if isinstance(part, str) else part
    return math.prod(sharding.mesh.shape[a] for a in axes)


def plan_layout(
    rows: int,
    slots: int,
    prompt_width: int,
    longest_prompt: int,
    max_new: int,
    lookahead: int,
    *,
    page_size: int = DEFAULT_PAGE_SIZE,
    num_pages: int | None = None,
    sharding: Sharding | None = None,
    advance: int = 1,
    decode_steps: int | None = None,
) -> Layout:
    """The loop's `Layout` for `rows` rows with prompts padded to `prompt_width` (the longest has
    `longest_prompt` tokens); lookahead, advance, decode_steps: as `Layout`'s (decode_steps None:
    `DECODE_STEPS`, read when called). num_pages: the pool (default: every slot's longest
    sequence, which never preempts); on a mesh each of the G groups (module docstring) takes
    num_pages // G. Raises ValueError naming the sizes when slots, page_size or decode_steps is
    not a positive integer, or when a group's pool cannot hold even one row's longest sequence."""
    decode_steps = DECODE_STEPS if decode_steps is None else decode_steps
    for name, value in (("slots", slots), ("page_size", page_size), ("decode_steps", decode_steps)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    slots = min(slots, rows)
    groups = batch_groups(sharding, math.gcd(rows, slots))
    per_slot = pages_for(prompt_width + max_new - 1 + lookahead, page_size)
    num_pages = slots * per_slot if num_pages is None else num_pages
    longest = longest_prompt + max_new - 1 + lookahead  # positions the longest row's last step writes
    if not isinstance(num_pages, int) or num_pages // groups < pages_for(longest, page_size):
        split = f" in each of the {groups} groups of the mesh's batch axes" if groups > 1 else ""
        raise ValueError(
            f"kv_pages={num_pages!r}: the page pool must hold at least one row's longest sequence{split}, "
            f"{pages_for(longest, page_size)} pages of {page_size} positions (prompt {longest_prompt} + "
            f"max_new_tokens {max_new} - 1 + {lookahead} positions a step writes = {longest})"
        )
    chunk = min(PREFILL_CHUNK, prompt_width)
    per_group = slots // groups
    # a slot may take several lanes; no more than every slot's prompt fills (a resumed row's longer
    # context takes more steps)
    lanes = max(1, min(PREFILL_TOKENS // chunk // groups, per_group * -(-prompt_width // chunk)))
    prefix = (prompt_width - 1) // page_size
    return Layout(
        rows,
        slots,
        max_new,
        page_size,
        per_slot,
        num_pages // groups * groups,
        chunk,
        lanes * groups,
        lookahead,
        prefix,
        groups,
        step_widths(slots, groups),
        advance,
        decode_steps,
    )
