"""Decode steps as wide as the slots that decode: the slot loop's answer to the staged loop's stages.

A decode step of S slots costs a forward over S rows whether 200 of them or 3 decode; in a heavy
tail most steps have few. The staged dense engine (`jaxspec.rollout.stages`) shrinks its batch by
copying the caches of the rows still running (at most three times, never below 32 rows); here the
KV lives in page pools that every slot reaches through its page table, so running a step on fewer
slots moves only their per-slot data: the step gathers the W slots that decode (live first, in
slot order) out of S, runs its forward on those W rows, and scatters their outputs back. W is the
narrowest of the loop's `step_widths` (S, S/2, S/4, ...) that holds every decoding slot, chosen on
the device each step (`width_index`; the slot loop's one `jax.lax.switch` a step has a branch per
width, `jaxspec.rollout.slots.run_slots`). A row's draws depend on its index and token position
only (`jaxspec.rollout.sampling.row_keys`), not on where its slot sits in the step's batch, so the
width changes no token (up to the float rounding of batched matmuls).

On a mesh (G > 1 groups) the slots of a group live on its own devices and a gather across groups
would move them, so there the step keeps its full width.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

MIN_WIDTH = 8  # the narrowest step (rows)
MAX_WIDTHS = 5  # compiled widths at most: S, S/2, S/4, S/8, S/16


def step_widths(slots: int, groups: int = 1) -> tuple[int, ...]:
    """The step widths of a loop of `slots` slots in `groups` groups, widest first: S, then halvings
    (rounded up) while at least MIN_WIDTH, at most MAX_WIDTHS of them; (S,) on a mesh."""
    widths = [slots]
    while groups == 1 and len(widths) < MAX_WIDTHS and MIN_WIDTH <= -(-widths[-1] // 2) < widths[-1]:
        widths.append(-(-widths[-1] // 2))
    return tuple(widths)


def width_index(widths: tuple[int, ...], count: jax.Array) -> jax.Array:
    """int32 scalar i: widths[i] is the narrowest of `widths` (widest first) that holds `count`
    (int32 scalar) slots; 0, the full width, when none is narrower. Scalar comparisons only: no
    reduction after the step's one count of its decoding slots."""
    index = jnp.int32(0)
    for width in widths[1:]:
        index = index + (count <= width).astype(jnp.int32)
    return index


def decoding_first(active: jax.Array) -> jax.Array:
    """int32 [S]: the slots of active bool [S] first, then the others, each in slot order."""
    return jnp.argsort(~active, stable=True)


# step(inputs, carry, shared) -> (outputs, carry, shared): one decode step of W slots. inputs and
# carry are pytrees of per-slot arrays [W, ...]; outputs are per-slot arrays [W, ...]; carry comes
# back updated (per-slot state that slots outside the step keep); shared (e.g. the page pools) is
# whole.
Step = Callable[[object, object, object], tuple[object, object, object]]


def at_width(width: int, active: jax.Array, step: Step, inputs, carry, shared) -> tuple[object, object, object]:
    """(outputs [S, ...], carry [S, ...], shared) of `step` run on `width` (static) of the S slots of
    active bool [S], a width that holds every active slot (`width_index` picks it): the step sees the
    active slots first, then others, each in slot order; outputs of the slots it did not see are
    zeros and their carry is unchanged."""
    slots = active.shape[0]
    if width == slots:
        return step(inputs, carry, shared)
    order = decoding_first(active)[:width]
    outputs, new_carry, shared = step(
        jax.tree.map(lambda x: x[order], inputs), jax.tree.map(lambda x: x[order], carry), shared
    )
    outputs = jax.tree.map(lambda y: jnp.zeros((slots, *y.shape[1:]), y.dtype).at[order].set(y), outputs)
    new_carry = jax.tree.map(lambda old, new: old.at[order].set(new), carry, new_carry)
    return outputs, new_carry, shared
