"""Acceptance statistics of speculative rollouts, accumulated inside the compiled loop."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.distributed import to_host


class Counts(NamedTuple):
    """Running totals over verification steps, counting only rows that were still generating.

    row_steps: int32 scalar (row, step) pairs verified.
    drafted: int32 scalar draft nodes verified (tree nodes minus the root).
    accepted: int32 scalar draft tokens accepted.
    reached: int32 [K]: steps whose accepted path got to depth i (i = 0 is the root) at a node
        that has at least one draft child, i.e. a depth-(i + 1) draft was tested.
    accepted_at: int32 [K]: steps that accepted a depth-(i + 1) draft.
    depth_steps: int32 [D + 1] (D: the deepest draft): loop iterations that drafted d levels (d = 0: autoregressive
        iterations of an adaptive loop, `jaxspec.rollout.speculative.adaptive`).
    """

    row_steps: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    reached: jax.Array
    accepted_at: jax.Array
    depth_steps: jax.Array

    @classmethod
    def zeros(cls, max_depth: int, max_draft_depth: int | None = None) -> Counts:
        """No steps yet: K = max_depth (the longest acceptable run), depth_steps for draft depths up
        to max_draft_depth (default K; deeper than K where a tree budget cuts the runs)."""
        scalar = jnp.zeros((), jnp.int32)
        depths = jnp.zeros((max_depth,), jnp.int32)
        draft_depths = max_depth if max_draft_depth is None else max_draft_depth
        return cls(scalar, scalar, scalar, depths, depths, jnp.zeros((draft_depths + 1,), jnp.int32))


def count_step(
    counts: Counts,
    parents: jax.Array,
    num_nodes: jax.Array,
    path: jax.Array,
    num_accepted: jax.Array,
    active: jax.Array,
) -> Counts:
    """Adds one verification step. parents int32 [B, N]; num_nodes int32 [B]; path int32 [B, K + 1]
    (accepted node ids from the root, -1 after); num_accepted int32 [B]; active bool [B]."""
    num = parents.shape[1]
    idx = jnp.arange(num, dtype=jnp.int32)
    valid_child = (idx[None, :] > 0) & (idx[None, :] < num_nodes[:, None])
    has_child = jnp.any(valid_child[:, None, :] & (parents[:, None, :] == idx[None, :, None]), axis=-1)  # [B, N]
    on_path = path[:, :-1] >= 0
    reached = on_path & jnp.take_along_axis(has_child, jnp.maximum(path[:, :-1], 0), axis=1)  # [B, K]
    accepted_at = path[:, 1:] >= 0
    act = active.astype(jnp.int32)
    return Counts(
        row_steps=counts.row_steps + act.sum(),
        drafted=counts.drafted + jnp.sum(act * (num_nodes - 1)),
        accepted=counts.accepted + jnp.sum(act * num_accepted),
        reached=counts.reached + jnp.sum(act[:, None] * reached, axis=0),
        accepted_at=counts.accepted_at + jnp.sum(act[:, None] * accepted_at, axis=0),
        depth_steps=counts.depth_steps,
    )


def summarize(counts: Counts, lengths: jax.Array, depth: int, stages: tuple[int, ...], stage_steps: jax.Array) -> dict:
    """The `RolloutOutput.stats` dict of a speculative rollout (K = depth, the tree's deepest level)
    whose loop ran stage_steps int32 [len(stages)] iterations at each batch size in `stages`.

    steps: verification steps (the first token of every row comes from the prefill logits).
    stage_rows, stage_steps: the loop's batch sizes and the steps run at each.
    acceptance_length: mean tokens a verification step yields per row, accepted drafts + 1 (the
        residual or bonus token), before eos/max_new_tokens truncation; 1.0 when no step ran.
    acceptance_rate_per_position: float32 [K]; entry i is the fraction of the steps that tested a
        depth-(i + 1) draft (the path reached depth i at a node with draft children) in which
        one of those drafts was accepted; NaN where no step tested that depth.
    drafted_tokens, accepted_tokens: draft nodes verified and draft tokens accepted.
    generated_tokens: sum of lengths.
    depth_steps: loop iterations that drafted 0, 1, ..., D levels (D: the deepest draft) (0: an adaptive loop's
        autoregressive fallback, `jaxspec.rollout.speculative.adaptive`); fallback_steps: those of
        depth 0.
    verified_row_steps, tested_at, accepted_at: the counts behind the two ratios ((row, step)
        pairs verified; per depth, steps that tested a draft there and steps that accepted one),
        so that the statistics of several rollouts combine exactly (`merge_stats`).
    """
    counts = jax.device_get(counts)
    row_steps = int(counts.row_steps)
    reached = np.asarray(counts.reached, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        rates = np.where(reached > 0, np.asarray(counts.accepted_at) / reached, np.nan).astype(np.float32)
    stage_steps = [int(n) for n in to_host(stage_steps)]
    return {
        "steps": sum(stage_steps),
        "stage_rows": list(stages),
        "stage_steps": stage_steps,
        "acceptance_length": (int(counts.accepted) + row_steps) / row_steps if row_steps else 1.0,
        "acceptance_rate_per_position": rates[:depth],
        "drafted_tokens": int(counts.drafted),
        "accepted_tokens": int(counts.accepted),
        "generated_tokens": int(to_host(lengths).sum()),
        "verified_row_steps": row_steps,
        "tested_at": [int(n) for n in np.asarray(counts.reached)[:depth]],
        "accepted_at": [int(n) for n in np.asarray(counts.accepted_at)[:depth]],
        "depth_steps": [int(n) for n in np.asarray(counts.depth_steps)],
        "fallback_steps": int(counts.depth_steps[0]),
    }


def merge_stats(parts: list[dict]) -> dict:
    """The statistics of rollouts generated in several calls (sub-batches of one batch) as one
    `RolloutOutput.stats` dict: counts add, the ratios are recomputed from the summed counts, and
    `steps` / `stage_steps` add up the calls' loop iterations (the loops ran one after another)."""
    first = parts[0]
    out = {
        "steps": sum(p["steps"] for p in parts),
        "stage_rows": first["stage_rows"],
        "stage_steps": [sum(n) for n in zip(*(p["stage_steps"] for p in parts))],
        "generated_tokens": sum(p["generated_tokens"] for p in parts),
    }
    if "verified_row_steps" not in first:  # autoregressive
        return {**first, **out}
    row_steps = sum(p["verified_row_steps"] for p in parts)
    accepted = sum(p["accepted_tokens"] for p in parts)
    tested = np.sum([p["tested_at"] for p in parts], axis=0, dtype=np.float64)
    accepted_at = np.sum([p["accepted_at"] for p in parts], axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        rates = np.where(tested > 0, accepted_at / tested, np.nan).astype(np.float32)
    return {
        **out,
        "acceptance_length": (accepted + row_steps) / row_steps if row_steps else 1.0,
        "acceptance_rate_per_position": rates,
        "drafted_tokens": sum(p["drafted_tokens"] for p in parts),
        "accepted_tokens": accepted,
        "verified_row_steps": row_steps,
        "tested_at": [int(n) for n in tested],
        "accepted_at": [int(n) for n in accepted_at],
        "depth_steps": [int(n) for n in np.sum([p["depth_steps"] for p in parts], axis=0)],
        "fallback_steps": sum(p["fallback_steps"] for p in parts),
    }
