"""The walk down a verified tree: chosen children followed from the root."""

import numpy as np
import pytest

from jaxspec.kernels.tree_verify_reference import walk


def walked_in_python(chosen: np.ndarray) -> np.ndarray:
    path = np.full(chosen.shape, -1, np.int32)
    for b, row in enumerate(chosen):
        node, i = 0, 0
        while node >= 0:
            path[b, i] = node
            node, i = row[node], i + 1
    return path


@pytest.mark.parametrize("nodes", [1, 2, 3, 5, 8, 13, 64])
def test_walk_follows_chosen_children_from_the_root(nodes):
    rng = np.random.default_rng(nodes)
    batch = 32
    parents = np.stack([[-1] + [rng.integers(0, n) for n in range(1, nodes)] for _ in range(batch)])
    chosen = np.full((batch, nodes), -1, np.int32)
    for b in range(batch):
        for n in range(nodes):
            children = np.flatnonzero(parents[b] == n)
            if children.size and rng.random() < 0.8:
                chosen[b, n] = rng.choice(children)
    chain = np.where(np.arange(nodes) + 1 < nodes, np.arange(nodes) + 1, -1)  # a chain accepted to its leaf
    chosen[0] = chain
    want = walked_in_python(chosen)
    path, num_accepted = walk(chosen)
    np.testing.assert_array_equal(path, want)
    np.testing.assert_array_equal(num_accepted, np.sum(want[:, 1:] >= 0, axis=1))
    assert int(num_accepted[0]) == nodes - 1
