"""Where a GRPO run's arrays live: one device, or a (data, fsdp, tensor) mesh (which may span
several processes: see `jaxspec.distributed`).

On a mesh the policy (and the frozen reference) is sharded by the model's logical-axis rules,
its optimizer moments follow it, the draft head and every scalar are replicated, and training
rows are split over the batch axes; rollouts read the same sharded arrays (`generate(...,
sharding=)`), so syncing the policy to the generator is at most a cast.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxspec.models.sharding import Sharding, make_mesh
from jaxspec.rl.config import MeshConfig


class Placement:
    def __init__(self, cfg: MeshConfig):
        devices = cfg.data * cfg.fsdp * cfg.tensor
        self.row_shards = cfg.data * cfg.fsdp  # training rows are split over these devices
        self.sharding = None if devices == 1 else Sharding(
            make_mesh(cfg.data, cfg.fsdp, cfg.tensor, devices=jax.devices()[:devices]))

    def state(self, state: dict) -> dict:
        """The training state committed to its devices: leaves already on the mesh stay as they
        are (the policy, its moments), all others are replicated (on one device: device 0)."""
        if self.sharding is None:
            return jax.device_put(state, jax.devices()[0])
        mesh, replicated = self.sharding.mesh, self.sharding.replicated()

        def place(leaf):
            on_mesh = isinstance(getattr(leaf, "sharding", None), NamedSharding) and leaf.sharding.mesh == mesh
            # Host copies, so that every process places its own replicas (a multi-process mesh).
            return leaf if on_mesh else jax.device_put(np.asarray(leaf), replicated)

        return jax.tree.map(place, state)

    def pin(self, tree, like):
        """`tree` placed like `like` (a pytree of the same structure): keeps a compiled update's
        outputs on the input layout, so the next call reuses its compilation."""
        if self.sharding is None:
            return tree
        return jax.device_put(tree, jax.tree.map(lambda x: x.sharding, like))

    def row_sharding(self, shape: tuple[int, ...]) -> NamedSharding | None:
        """Sharding of an array [B, ...] whose rows are split over the mesh's batch axes (None on one
        device, where training rows stay host arrays)."""
        if self.sharding is None:
            return None
        return self.sharding.named(("batch",) + (None,) * (len(shape) - 1), shape)

    def rows(self, batch: dict) -> dict:
        """Host arrays [B, ...] with their rows split over the mesh's batch axes."""
        if self.sharding is None:
            return batch
        return {k: jax.device_put(v, self.row_sharding(np.shape(v))) for k, v in batch.items()}
