"""The rollout devices of an async GRPO job over one or several processes (`jaxspec.rl.async_rollouts`).

Each process generates on its own rollout devices (`jaxspec.run.placement.split_devices`: its last
local devices), a mesh local to the process, so that the rollout thread runs no program shared
with another process: programs with cross-process collectives that two threads launch in
different orders on different processes mismatch (CPU collectives abort, "Is there a distributed
collective mismatch"). The rows of a step are split into `generate` calls of rollout.sub_batch
rows, each with its own key (as in colocated mode); process p generates its contiguous share of
the calls, and the main thread gathers every process's rollouts (`gather`), in step order.

The weights reach the rollout devices without a host round trip: `jax.device_put` within one
process; across processes (where JAX does not reshard between the trainer mesh and other devices
of the same processes), a replicated copy on the trainer mesh (for the time of the sync, the whole
policy in rollout.dtype on every trainer device) of which each process copies its own replica to
its rollout devices. Checkpoints see the rollout copies as arrays over every process's
rollout devices (`global_view`), restored copies come back as per-process ones (`local_view`);
neither copies data.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from jaxspec.models.sharding import Sharding, make_mesh
from jaxspec.rl.batch import Rollouts
from jaxspec.rollout.speculative.stats import merge_stats
from jaxspec.run.placement import MeshConfig, split_devices


class RolloutHosts:
    """This process's rollout mesh (`sharding`: data = its rollout devices, weights replicated,
    rows split) and the job's (`job_mesh`, every process's rollout devices)."""

    def __init__(self, mesh: MeshConfig):
        every = split_devices(mesh)[1]
        local = [d for d in every if d.process_index == jax.process_index()]
        self.sharding = Sharding(make_mesh(len(local), 1, 1, devices=local))
        self.job_mesh = make_mesh(len(every), 1, 1, devices=every)
        self.processes = jax.process_count()

    def put(self, tree, shardings, trainer: Sharding | None):
        """`tree` (on the trainer mesh `trainer`) copied device to device onto `shardings` (this
        process's rollout mesh)."""
        if self.processes == 1:
            return jax.device_put(tree, shardings)
        replicated = _replicate(trainer.replicated())(tree)  # on the trainer mesh: a replica per process

        def copy(x, sharding):
            replica = x.addressable_shards[0].data
            return jax.make_array_from_single_device_arrays(
                x.shape, sharding, [jax.device_put(replica, d) for d in sharding.mesh.devices.flat]
            )

        return jax.tree.map(copy, replicated, shardings)

    def global_view(self, tree):
        """This process's rollout arrays as arrays over every process's rollout devices (the same
        buffers), for the checkpoint."""
        return _view(tree, self.job_mesh)

    def local_view(self, tree):
        """Arrays over every process's rollout devices (restored) as this process's."""
        return _view(tree, self.sharding.mesh)

    def calls(self, rows: int, sub_batch: int | None) -> list[int]:
        """The indices of this process's `generate` calls among the step's rows // sub_batch."""
        count = rows // (sub_batch or rows)
        share = count // self.processes
        return list(range(jax.process_index() * share, (jax.process_index() + 1) * share))

    def gather(self, out: Rollouts) -> Rollouts:
        """The step's rollouts from every process's share (`merge` in process order); every process
        must call it, in the same order (main thread)."""
        if self.processes == 1:
            return out
        data = np.frombuffer(pickle.dumps(out), np.uint8)
        sizes = multihost_utils.process_allgather(np.asarray([data.size], np.int32)).reshape(-1)
        padded = np.zeros(int(sizes.max()), np.uint8)
        padded[: data.size] = data
        parts = multihost_utils.process_allgather(padded)
        return merge([pickle.loads(parts[p, : sizes[p]].tobytes()) for p in range(self.processes)])


def merge(parts: list[Rollouts]) -> Rollouts:
    """Rollouts of consecutive row blocks (`RolloutGenerator.rollouts` outputs) as one, with the blocks'
    statistics merged."""
    if len(parts) == 1:
        return parts[0]
    return dataclasses.replace(Rollouts.concatenate(parts), stats=merge_stats([part.stats for part in parts]))


def _view(tree, mesh):
    def view(x):
        sharding = NamedSharding(mesh, x.sharding.spec)
        return jax.make_array_from_single_device_arrays(x.shape, sharding, [s.data for s in x.addressable_shards])

    return jax.tree.map(view, tree)


@functools.cache
def _replicate(sharding: NamedSharding):
    return jax.jit(lambda tree: tree, out_shardings=sharding)
