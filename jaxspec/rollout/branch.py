"""`run_if`: a conditional update of a compiled loop's state that XLA makes in place.

Inside a `while_loop`'s body, a `lax.switch` (or a loop nested in one of its branches) over a
state that holds KV caches makes XLA's copy insertion copy the whole state into and out of the
branch at every iteration that takes it (read in the optimized HLO of JAX 0.10.2 on the CPU, and by
what the staged loop's probes cost, of 0.11.2 on a GPU; 0.12 copies in neither form). A loop that
runs its body once or not at all updates the state where it lies: the staged adaptive loop takes
its drafting depths as a sequence of such loops, one per depth, each under its own predicate
(`tests/rollout/speculative/test_loop_copies.py` checks the HLO).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp

State = TypeVar("State")


def run_if(pred: jax.Array, fn: Callable[[State], State], state: State) -> State:
    """fn(state) where `pred` (bool scalar) holds, else `state`: a `while_loop` whose body runs at
    most once (on a GPU it costs one more test of a predicate than a branch does)."""
    state, _ = jax.lax.while_loop(lambda c: c[1], lambda c: (fn(c[0]), jnp.zeros((), bool)), (state, pred))
    return state
