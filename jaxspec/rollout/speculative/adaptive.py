"""Draft depth chosen per loop iteration from the acceptance measured so far and a cost model, so
that speculation falls back to plain autoregressive steps where its drafts do not pay.

Each iteration of a stage that drafts k levels runs one of the depths `candidate_depths(k)`
(0, then the powers of two below k, then k); depth 0 verifies the root alone, i.e. it is an
autoregressive step through the same loop. With a_i the running (exponentially decayed) rate at
which a tested depth-i draft is accepted, a depth-d step is expected to emit
E(d) = 1 + a_1 + a_1 a_2 + ... + a_1...a_d tokens per row and to cost
C(d) = 1 + d * draft_token_cost + nodes(d) * v(rows) decode steps (nodes(d): the draft nodes of a
depth-d tree; v(rows): what one verified node adds at the number of rows the step runs, which
grows with the batch as the verification forward turns from reading weights to multiplying them:
`verify_token_cost` points (rows, cost), linear between them and flat beyond); the loop runs the
depth of largest E(d) / C(d) (ties: the shallower).
A depth's rate is its first measurement, then a running average, and moves only when a step tested
it; a depth no step has tested yet is taken to accept as the nearest tested depth above it does
(the first depth, untested: 1, so the loop drafts first). A useless draft therefore costs one
drafting iteration at the start, not the several a prior of 1 decaying towards 0 would take (each a
deep verification, dear at large batch). After a run of autoregressive iterations one iteration
drafts at the smallest depth again (a probe), to notice drafts that have become useful. The run is
`probe_interval` iterations long at first and doubles after every probe that does not bring
drafting back (two drafting iterations in a row), up to `probe_max`: a draft that stays useless
costs a probe every `probe_max` iterations.

The choice depends only on earlier iterations' outcomes, never on the current one's random draws,
so every rollout is still distributed exactly as the policy samples it.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxspec.rollout.speculative.stats import Counts


@dataclasses.dataclass(frozen=True)
class AdaptiveDepth:
    """The loop's static settings for choosing depths (`SpecConfig`'s adaptive keys and tree shape).

    tree_width, tree_budget: the tree's shape (`SpecConfig`); verify_token_cost: (rows, cost)
    points, rows ascending (`cost_points`), and draft_token_cost: the cost model, in decode steps;
    decay: weight of the old rate in each update (0: the last iteration's rate alone);
    probe_interval, probe_max: the first and the longest run of iterations that ends in a probe.
    """

    tree_width: int
    tree_budget: int | None
    verify_token_cost: tuple[tuple[int, float], ...]
    draft_token_cost: float
    decay: float
    probe_interval: int
    probe_max: int

    def nodes(self, depth: int) -> int:
        full = depth * self.tree_width
        return full if self.tree_budget is None else min(self.tree_budget, full)

    def verify_cost(self, rows) -> jax.Array:
        """float32 scalar: decode steps one verified node adds to a step of `rows` rows (an int or
        an int32 scalar), interpolated linearly between the points, flat beyond the ends. The
        segment is found by one comparison with every point (jnp.interp's binary search is a loop,
        which a GPU would run trip by trip inside the rollout loop)."""
        sizes = jnp.asarray([r for r, _ in self.verify_token_cost], jnp.float32)
        costs = jnp.asarray([c for _, c in self.verify_token_cost], jnp.float32)
        if sizes.size == 1:
            return costs[0]
        at = jnp.asarray(rows, jnp.float32)
        right = jnp.clip(jnp.sum(sizes <= at), 1, sizes.size - 1)  # the segment [right - 1, right]
        low, high = sizes[right - 1], sizes[right]
        share = jnp.where(high > low, jnp.clip((at - low) / jnp.maximum(high - low, 1e-30), 0.0, 1.0), 1.0)
        return costs[right - 1] + share * (costs[right] - costs[right - 1])

    def cost(self, depth: int, rows) -> jax.Array:
        """float32 scalar: decode steps one iteration at `depth` costs when `rows` rows run it."""
        return 1.0 + depth * self.draft_token_cost + self.nodes(depth) * self.verify_cost(rows)


def cost_points(value) -> tuple[tuple[int, float], ...]:
    """`Spec.verify_token_cost` as (rows, cost) points: a number is the cost at every batch size."""
    if isinstance(value, (list, tuple)):
        return tuple((int(rows), float(cost)) for rows, cost in value)
    return ((1, float(value)),)


class DepthState(NamedTuple):
    """rates float32 [K]: running acceptance rate of the draft at each depth, where tested; tested
    bool [K]: whether a step has tested the depth; since_draft int32 scalar: iterations since the
    last one that drafted; interval int32 scalar: the run of iterations that ends in a probe now
    (`probe_interval` to `probe_max`)."""

    rates: jax.Array
    tested: jax.Array
    since_draft: jax.Array
    interval: jax.Array

    def expected_rates(self) -> jax.Array:
        """float32 [K]: the rates the choice weighs: a tested depth's own, an untested one the
        nearest tested depth's above it (1 above the first)."""
        above, out = jnp.ones((), jnp.float32), []
        for i in range(self.rates.shape[0]):
            above = jnp.where(self.tested[i], self.rates[i], above)
            out.append(above)
        return jnp.stack(out)

    def before_probe(self) -> jax.Array:
        """int32 scalar: autoregressive iterations left before the next probe (<= 0: it is due)."""
        return self.interval - 1 - self.since_draft

    @classmethod
    def start(cls, max_depth: int, settings: AdaptiveDepth) -> DepthState:
        zero = jnp.zeros((), jnp.int32)
        untested = jnp.zeros((max_depth,), bool)
        return cls(jnp.ones((max_depth,), jnp.float32), untested, zero, zero + settings.probe_interval)


def candidate_depths(depth: int) -> tuple[int, ...]:
    """Depths an iteration of a stage drafting `depth` levels may run: 0, powers of two below
    `depth`, and `depth`."""
    powers = [1 << i for i in range(depth.bit_length()) if (1 << i) < depth]
    return (0, *powers, depth)


def choose(settings: AdaptiveDepth, state: DepthState, depths: tuple[int, ...], rows) -> jax.Array:
    """int32 scalar: the index into `depths` (ascending, depths[0] = 0) this iteration runs, for a
    step of `rows` rows (an int or an int32 scalar: the staged loop's stage batch, the slot
    engine's decoding slots)."""
    reach = jnp.concatenate([jnp.ones((1,), jnp.float32), jnp.cumprod(state.expected_rates())])  # [K + 1]
    expected = jnp.cumsum(reach)  # expected[d] = E(d)
    # A tree budget below its depth caps the run a step can accept at K = len(rates).
    value = jnp.stack([expected[min(d, state.rates.shape[0])] / settings.cost(d, rows) for d in depths])
    best = jnp.argmax(value).astype(jnp.int32)  # the first (shallowest) of equal values
    probe = (best == 0) & (state.before_probe() <= 0)
    return jnp.where(probe, 1, best).astype(jnp.int32)


def observe(
    settings: AdaptiveDepth, state: DepthState, before: Counts, after: Counts, drafted: jax.Array
) -> DepthState:
    """The state after an iteration whose statistics moved from `before` to `after`; drafted: bool
    scalar, whether it drafted (depth > 0). A depth's first test sets its rate, later ones move
    it by `decay`. A drafting iteration right after another one resets the probe interval; one
    after autoregressive iterations (a probe, as a rule) doubles it."""
    tested = after.reached - before.reached
    accepted = after.accepted_at - before.accepted_at
    rate = accepted / jnp.maximum(tested, 1)
    moved = jnp.where(state.tested, settings.decay * state.rates + (1.0 - settings.decay) * rate, rate)
    return DepthState(
        rates=jnp.where(tested > 0, moved, state.rates),
        tested=state.tested | (tested > 0),
        since_draft=jnp.where(drafted, 0, state.since_draft + 1),
        interval=jnp.where(
            drafted,
            jnp.where(
                state.since_draft == 0, settings.probe_interval, jnp.minimum(2 * state.interval, settings.probe_max)
            ),
            state.interval,
        ),
    )
