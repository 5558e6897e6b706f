"""Acceptance statistics against an independent count: random trees, random accepted paths and
active rows, counted step by step in plain Python."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.rollout.speculative.stats import Counts, count_step, summarize

DEPTH, NODES = 3, 6


def random_step(rng: np.random.Generator, batch: int):
    """(parents int32 [B, N], num_nodes int32 [B], path int32 [B, DEPTH + 1], num_accepted int32 [B],
    active bool [B]): random trees (padding nodes past num_nodes point at the root) and a random
    walk from the root down valid children, stopping at random or at a node without children."""
    parents = np.zeros((batch, NODES), np.int32)
    parents[:, 0] = -1
    num_nodes = rng.integers(1, NODES + 1, size=batch).astype(np.int32)
    path = np.full((batch, DEPTH + 1), -1, np.int32)
    path[:, 0] = 0
    for b in range(batch):
        depth = [0]
        for n in range(1, num_nodes[b]):
            shallow = [m for m in range(n) if depth[m] < DEPTH]
            parents[b, n] = rng.choice(shallow)
            depth.append(depth[parents[b, n]] + 1)
        node = 0
        for i in range(1, DEPTH + 1):
            kids = [n for n in range(1, num_nodes[b]) if parents[b, n] == node]
            if not kids or rng.random() < 0.4:
                break
            node = path[b, i] = rng.choice(kids)
    return parents, num_nodes, path, (path[:, 1:] >= 0).sum(axis=1).astype(np.int32), rng.random(batch) < 0.8


def test_counts_and_rates_equal_an_independent_count():
    rng = np.random.default_rng(0)
    counts = Counts.zeros(DEPTH)
    row_steps = drafted = accepted = 0
    reached, accepted_at = np.zeros(DEPTH), np.zeros(DEPTH)
    for _ in range(5):
        parents, num_nodes, path, num_accepted, active = random_step(rng, 64)
        counts = count_step(counts, *map(jnp.asarray, (parents, num_nodes, path, num_accepted, active)))
        for b in np.flatnonzero(active):
            row_steps += 1
            drafted += num_nodes[b] - 1
            accepted += num_accepted[b]
            for i in range(DEPTH):
                node = path[b, i]
                if node >= 0 and any(parents[b, n] == node for n in range(1, num_nodes[b])):
                    reached[i] += 1  # a depth-(i + 1) draft was tested
                    accepted_at[i] += path[b, i + 1] >= 0
    assert 0 < reached[-1] < reached[0] and accepted_at[-1] > 0
    stats = summarize(counts, jnp.asarray([3, 4]), DEPTH, (64,), jnp.asarray([5]))
    assert (stats["drafted_tokens"], stats["accepted_tokens"]) == (drafted, accepted)
    assert stats["acceptance_length"] == pytest.approx((accepted + row_steps) / row_steps)
    np.testing.assert_allclose(stats["acceptance_rate_per_position"], accepted_at / reached, rtol=1e-6)
    assert stats["steps"] == 5 and stats["generated_tokens"] == 7


def test_rates_are_nan_where_no_draft_was_tested():
    path = jnp.asarray([[0, -1, -1, -1]], jnp.int32)
    counts = count_step(
        Counts.zeros(DEPTH),
        jnp.asarray([[-1, 0, 1, 0, 0, 0]], jnp.int32),
        jnp.asarray([2]),
        path,
        jnp.asarray([0]),
        jnp.asarray([True]),
    )
    stats = summarize(counts, jnp.asarray([1]), DEPTH, (1,), jnp.asarray([1]))
    np.testing.assert_array_equal(stats["acceptance_rate_per_position"], [0.0, np.nan, np.nan])
    assert stats["acceptance_length"] == 1.0


def test_merged_statistics_are_those_of_the_summed_counts():
    """Two calls' statistics combine from their counts, not by averaging their ratios."""
    from jaxspec.rollout.speculative.stats import merge_stats

    a = {
        "steps": 10,
        "stage_rows": [4, 2],
        "stage_steps": [6, 4],
        "generated_tokens": 50,
        "acceptance_length": 2.0,
        "acceptance_rate_per_position": np.asarray([0.5, 0.5]),
        "drafted_tokens": 40,
        "accepted_tokens": 20,
        "verified_row_steps": 20,
        "tested_at": [20, 10],
        "accepted_at": [10, 5],
        "depth_steps": [2, 1, 7],
        "fallback_steps": 2,
    }
    b = {
        "steps": 5,
        "stage_rows": [4, 2],
        "stage_steps": [5, 0],
        "generated_tokens": 40,
        "acceptance_length": 5.0,
        "acceptance_rate_per_position": np.asarray([1.0, np.nan]),
        "drafted_tokens": 10,
        "accepted_tokens": 8,
        "verified_row_steps": 2,
        "tested_at": [2, 0],
        "accepted_at": [2, 0],
        "depth_steps": [0, 0, 5],
        "fallback_steps": 0,
    }
    m = merge_stats([a, b])
    assert m["acceptance_length"] == (20 + 8 + 20 + 2) / (20 + 2)  # not the mean of 2.0 and 5.0
    np.testing.assert_allclose(m["acceptance_rate_per_position"], [12 / 22, 5 / 10])
    assert (m["steps"], m["stage_steps"], m["generated_tokens"]) == (15, [11, 4], 90)
    assert (m["drafted_tokens"], m["accepted_tokens"], m["tested_at"]) == (50, 28, [22, 10])
    assert (m["depth_steps"], m["fallback_steps"]) == ([2, 1, 12], 2)
    ar = {
        "steps": 3,
        "stage_rows": [2],
        "stage_steps": [3],
        "generated_tokens": 6,
        "acceptance_length": 1.0,
        "acceptance_rate_per_position": np.zeros((0,)),
    }
    assert merge_stats([ar, ar])["steps"] == 6 and merge_stats([ar, ar])["acceptance_length"] == 1.0
