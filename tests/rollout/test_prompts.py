import numpy as np
import pytest

from jaxspec.rollout.prompts import count_bucket, group_prompts, prompt_bucket, row_limits


@pytest.mark.parametrize(
    "length, bucket", [(1, 16), (16, 16), (17, 32), (33, 64), (1000, 1024), (1024, 1024), (1025, 2048), (3000, 3072)]
)
def test_prompt_bucket(length, bucket):
    assert prompt_bucket(length) == bucket


@pytest.mark.parametrize("count, batch, bucket", [(1, 4, 1), (3, 8, 4), (4, 8, 4), (5, 6, 6), (5, 64, 8)])
def test_count_bucket(count, batch, bucket):
    assert count_bucket(count, batch) == bucket


def test_identical_prompts_are_prefilled_once():
    a, b, c = (4, 5, 6), (7,), (4, 5)
    batch = group_prompts([a, b, a, a, c, b], row_limits(None, 6, 8))
    assert batch.num_distinct == 3
    np.testing.assert_array_equal(batch.row_prompt, [0, 1, 0, 0, 2, 1])
    np.testing.assert_array_equal(batch.row_lengths, [3, 1, 3, 3, 2, 1])
    assert batch.tokens.shape == (4, 16) and batch.tokens.dtype == np.int32
    np.testing.assert_array_equal(batch.lengths, [3, 1, 2, 1])  # the 4th row is filler
    for u, prompt in enumerate((a, b, c)):
        assert batch.tokens[u, : len(prompt)].tolist() == list(prompt)
        assert not batch.tokens[u, len(prompt) :].any()


def test_min_width_sets_the_bucket():
    assert group_prompts([(1, 2, 3)], row_limits(None, 1, 8), min_width=40).tokens.shape == (1, 64)
    assert group_prompts([tuple(range(70))], row_limits(None, 1, 8), min_width=40).tokens.shape == (1, 128)
