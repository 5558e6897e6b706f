"""Batches addressed by data position: the rows a run has consumed so far pin down every later
batch, so a resumed run draws exactly the batches of an uninterrupted one."""

from __future__ import annotations

import numpy as np


class Batcher:
    """Row ids of batches of `batch_size` rows out of `num_rows`, by data position (rows consumed).

    Epoch e = position // num_rows visits the rows in a permutation seeded by (seed, e); a batch
    that crosses an epoch's end continues in the next epoch's permutation.
    """

    def __init__(self, num_rows: int, batch_size: int, seed: int):
        self.num_rows, self.batch_size, self.seed = num_rows, batch_size, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)}
        return self._perms[epoch]

    def indices(self, position: int) -> np.ndarray:
        """Row ids int [batch_size] of the batch starting at data position `position`."""
        n = self.num_rows
        return np.array([self._perm(pos // n)[pos % n] for pos in range(position, position + self.batch_size)])
