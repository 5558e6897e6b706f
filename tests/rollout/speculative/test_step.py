"""One speculative step's commit: the accepted tree nodes' KV moves to consecutive cache slots."""

import jax.numpy as jnp
import numpy as np

from jaxspec.models import KVCache
from jaxspec.rollout.speculative.step import commit_path


def test_commit_path_moves_accepted_nodes_to_consecutive_slots():
    slots = np.arange(2 * 12, dtype=np.float32).reshape(2, 12, 1, 1)
    cache = KVCache(k=(jnp.asarray(slots),), v=(jnp.asarray(-slots),))
    path = jnp.asarray([[0, 2, 5, -1], [0, -1, -1, -1]], jnp.int32)
    out = commit_path(cache, jnp.asarray([3, 4]), path)
    k = np.asarray(out.k[0])[..., 0, 0]
    assert k[0, :6].tolist() == [0, 1, 2, 3, 5, 8] and k[0, 6:].tolist() == slots[0, 6:, 0, 0].tolist()
    assert k[1].tolist() == slots[1, :, 0, 0].tolist()
    np.testing.assert_array_equal(np.asarray(out.v[0]), -np.asarray(out.k[0]))
