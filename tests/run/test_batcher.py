"""Batches by data position: an epoch visits every row once, a position pins its batch down."""

import numpy as np

from jaxspec.run import Batcher


def test_batches_are_addressed_by_position():
    batcher = Batcher(10, batch_size=4, seed=0)
    seen = np.concatenate([batcher.indices(p) for p in (0, 4, 8)])  # 12 rows span two epochs
    assert sorted(seen[:10]) == list(range(10))
    np.testing.assert_array_equal(seen[10:], np.random.default_rng([0, 1]).permutation(10)[:2])
    np.testing.assert_array_equal(Batcher(10, 4, 0).indices(8), batcher.indices(8))  # fresh = cached
    assert not np.array_equal(Batcher(10, 4, 1).indices(0), batcher.indices(0))
