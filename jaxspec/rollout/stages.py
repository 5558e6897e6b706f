"""Shrinking the decode batch as rows finish.

RL rollouts end at very different lengths: most rows stop long before the longest one, yet a
decode loop over B rows costs about the same per step however few of them still run. The
compiled loops therefore run in stages of B, B/2, B/4 rows (`batch_stages`). A stage runs while
more rows are running than the next stage holds; then the running rows, topped up with finished
ones, move into the smaller batch (`running_first`, `take_rows`) and the loop goes on there.
Finished rows keep their outputs, which are written back to their original rows.

Every row is still sampled from the policy's distribution; only which random draws a row gets
changes with the batch it sits in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.models.sharding import Sharding

MIN_STAGE_ROWS = 32  # below this a decode step is launch-bound: a smaller batch would not be cheaper
MAX_STAGES = 3  # each stage is one more compiled loop


def batch_stages(num_rows: int, sharding: Sharding | None = None, min_rows: int | None = None) -> tuple[int, ...]:
    """Batch sizes of the loop's stages: num_rows, then halvings of at least `min_rows` (default
    MIN_STAGE_ROWS) rows that still split evenly over the mesh's batch axes."""
    min_rows = MIN_STAGE_ROWS if min_rows is None else min_rows
    shards = 1 if sharding is None else sharding.mesh.shape["data"] * sharding.mesh.shape["fsdp"]
    sizes = [num_rows]
    while (
        len(sizes) < MAX_STAGES and sizes[-1] % 2 == 0 and sizes[-1] // 2 >= min_rows and (sizes[-1] // 2) % shards == 0
    ):
        sizes.append(sizes[-1] // 2)
    return tuple(sizes)


def running_first(done: jax.Array, size: int) -> jax.Array:
    """int32 [size]: rows to keep from bool done [B] (running rows first, in order; then finished ones)."""
    return jnp.argsort(done, stable=True)[:size].astype(jnp.int32)


def take_rows(tree, rows: jax.Array):
    """Every leaf of `tree` (all batch-major) restricted to `rows` int32 [b] along axis 0."""
    return jax.tree.map(lambda x: jnp.take(x, rows, axis=0), tree)


def put_rows(full: jax.Array, rows: jax.Array, part: jax.Array) -> jax.Array:
    """`full` [B, ...] with rows `rows` int32 [b] (distinct) replaced by `part` [b, ...]."""
    return full.at[rows].set(part)


def run_in_stages(
    step,
    state,
    stages: tuple[int, ...],
    batch_fields: tuple[str, ...],
    place=lambda state: state,
    outputs: tuple[str, ...] = ("tokens", "logprobs", "lengths"),
    counted: bool = False,
):
    """`jax.lax.while_loop(step)` over `state` stage by stage until every row is done.

    step: the loop body, or a sequence of one body per stage; state: a NamedTuple of the loop whose
    `batch_fields` are batch-major (among them done [B], the `outputs` and cache); stages: batch
    sizes, stages[0] = B. Between stages the running rows move into the smaller batch and `place`
    re-lays the moved state out. outputs: the batch fields that come back for all B rows (each
    row's from the stage it finished in). counted: bodies that run several iterations at once are
    called as body(state, runs) with the stage's condition runs(state) -> bool scalar (where to
    stop) and return (state, int32 scalar iterations they ran).
    Returns (final state, {output field: its [B, ...] array}, the B-row cache after the first
    stage, int32 [len(stages)] iterations run in each stage).
    """
    num_rows = state.done.shape[0]
    full = {name: getattr(state, name) for name in outputs}
    origin = jnp.arange(num_rows, dtype=jnp.int32)  # row of the full batch each loop row is
    bodies = tuple(step) if isinstance(step, (list, tuple)) else (step,) * len(stages)
    stage_steps = []
    for i, size in enumerate(stages):
        if i:  # the running rows move into a batch of `size`
            with jax.named_scope("stage_move"):
                rows = running_first(state.done, size)
                origin = origin[rows]
                state = place(state._replace(**take_rows({f: getattr(state, f) for f in batch_fields}, rows)))
        next_size = stages[i + 1] if i + 1 < len(stages) else 0

        def runs(s, n=next_size) -> jax.Array:  # more rows run than the next stage holds
            return jnp.sum(~s.done) > n

        def iterate(c, body=bodies[i], runs=runs):
            new, ran = body(c[0], runs) if counted else (body(c[0]), 1)
            return new, c[1] + ran

        with jax.named_scope(f"stage{i}"):  # lets a profile charge kernels to their stage
            state, steps = jax.lax.while_loop(lambda c: runs(c[0]), iterate, (state, jnp.zeros((), jnp.int32)))
        stage_steps.append(steps)
        if not i:
            full_cache = state.cache
        full = {name: put_rows(array, origin, getattr(state, name)) for name, array in full.items()}
    return state, full, full_cache, jnp.stack(stage_steps)
