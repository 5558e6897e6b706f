"""Per-row limits on emitted tokens (`generate(..., row_max_new_tokens=...)`).

On the embedded tiny policy and its trained EAGLE-3 head (accepted runs of several tokens, so a
limit falls inside a run as well as between steps): a row stopped at its limit holds the first
tokens of the row the same call draws without limits, in float32 at T = 1 for the engines whose
draws depend on the row and position alone (the staged autoregressive loop, the slot engine
autoregressive and speculative) and greedily for the staged speculative loop (its draws follow
the loop's batch, which rows leave earlier with limits); bad limits are refused by name. That the
slot engine gives a row pages only up to its own limit: tests/rollout/test_slot_schedule.py.
"""

import jax
import numpy as np
import pytest

from jaxspec.rollout import Spec, generate
from tests.rollout.conftest import TINY_MAX_NEW

LIMITS = [1, 2, 3, 4, 5, 6, 7, 9, 11, 13, 16, TINY_MAX_NEW]


def assert_prefix_of(limited, full, pad_id: int) -> None:
    """Row r of `limited` is row r of `full` cut to min(its length, LIMITS[r]) tokens, and the
    limits cut at least four rows short of where they end without them."""
    full_lengths = np.asarray(full.lengths)
    expected = np.minimum(full_lengths, LIMITS)
    assert int((expected < full_lengths).sum()) >= 4, f"the limits should cut rows: {full_lengths.tolist()}"
    np.testing.assert_array_equal(limited.lengths, expected)
    tokens, full_tokens = np.asarray(limited.tokens), np.asarray(full.tokens)
    logprobs, full_logprobs = np.asarray(limited.logprobs), np.asarray(full.logprobs)
    for r, n in enumerate(expected):
        np.testing.assert_array_equal(tokens[r, :n], full_tokens[r, :n], err_msg=f"row {r}")
        assert (tokens[r, n:] == pad_id).all(), f"row {r} has tokens past its limit {n}"
        np.testing.assert_allclose(logprobs[r, :n], full_logprobs[r, :n], rtol=1e-5, atol=1e-5)
        assert (logprobs[r, n:] == 0).all()
    assert limited.stats["generated_tokens"] == int(expected.sum())


@pytest.mark.parametrize("slots", [None, 3], ids=["staged", "slots3"])
def test_sampled_autoregressive_rows_stop_at_their_limits(tiny, slots):
    cfg, params, _, rows, _, sampled = tiny
    full = generate(cfg, params, rows, jax.random.key(5), sampled, slots=slots)
    limited = generate(cfg, params, rows, jax.random.key(5), sampled, slots=slots, row_max_new_tokens=LIMITS)
    assert_prefix_of(limited, full, cfg.pad_token_id or 0)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sampled_eagle3_rows_on_slots_stop_at_their_limits(tiny, tree):
    cfg, params, head, rows, _, sampled = tiny
    shape = dict(num_draft_tokens=3, tree_width=2, tree_budget=4) if tree else dict(num_draft_tokens=3)
    spec = Spec("eagle3", head, **shape)
    full = generate(cfg, params, rows, jax.random.key(6), sampled, spec=spec, slots=3)
    assert full.stats["acceptance_length"] > 1.5, "accepted runs should reach past the limits"
    limited = generate(cfg, params, rows, jax.random.key(6), sampled, spec=spec, slots=3, row_max_new_tokens=LIMITS)
    assert_prefix_of(limited, full, cfg.pad_token_id or 0)


def test_greedy_eagle3_rows_of_the_staged_loop_stop_at_their_limits(tiny):
    cfg, params, head, rows, greedy, _ = tiny
    spec = Spec("eagle3", head, num_draft_tokens=3)
    full = generate(cfg, params, rows, jax.random.key(0), greedy, spec=spec)
    limited = generate(cfg, params, rows, jax.random.key(0), greedy, spec=spec, row_max_new_tokens=LIMITS)
    assert_prefix_of(limited, full, cfg.pad_token_id or 0)


@pytest.mark.parametrize(
    "limits, message",
    [
        ([5] * 11, r"one integer per prompt \(12\)"),
        ([5] * 11 + [0], r"row_max_new_tokens\[11\] = 0 is outside \[1, max_new_tokens=40\]"),
        ([41] + [5] * 11, r"row_max_new_tokens\[0\] = 41 is outside"),
        ([5.0] * 12, "dtype float64"),
    ],
)
def test_bad_limits_are_refused_by_name(tiny, limits, message):
    cfg, params, _, rows, _, sampled = tiny
    with pytest.raises(ValueError, match=message):
        generate(cfg, params, rows, jax.random.key(0), sampled, row_max_new_tokens=limits)
