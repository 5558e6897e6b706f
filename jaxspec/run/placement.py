"""Where a training run's arrays live: one device, or a (data, fsdp, tensor, expert) mesh (which may span
several processes: see `jaxspec.distributed`).

On a mesh the policy (and GRPO's frozen reference) is sharded by the model's logical-axis rules,
its optimizer moments follow it, the draft head and every scalar are replicated, and training
rows are split over the batch axes; rollouts read the same sharded arrays (`generate(...,
sharding=)`), so syncing the policy to the generator is at most a cast (and, with
rollout.gather_weights, one all-gather of the cast over the batch axes: `cast_floats`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxspec.models.memory import check_weights_fit, weights_bytes_per_device
from jaxspec.models.sharding import Sharding, gathered_param_shardings, make_mesh


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh (data, fsdp, tensor, expert) that the policy, its optimizer state and the
    rollouts are sharded over, built from the first data * fsdp * tensor * expert devices. All 1:
    one device. A resumed run may use another mesh (checkpoints are restored onto it).

    data: devices that split the training rows and rollouts, each holding the whole policy (data
    parallel).
    fsdp: devices that split the rows too and shard the policy's embedding dimension and its
    optimizer state over themselves (fully sharded data parallel).
    tensor: devices that split the attention heads, MLP width and vocabulary of every layer
    (tensor parallel); rows are not split over it.
    expert: devices that split a mixture-of-experts policy's experts (expert parallel); training
    rows are not split over it.
    rollout_devices: GRPO with rollout.mode async only: the last N devices form a separate rollout
    mesh (its own copy of the policy, see `jaxspec.rl.async_rollouts`); the trainer mesh is built
    from the devices before them. 0 = no rollout mesh. In a job of several processes each process
    gives the same share of both: its first local devices train, its last ones generate
    (`split_devices`).
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    rollout_devices: int = 0

    @property
    def devices(self) -> int:
        """Devices of the trainer mesh (the rollout devices come after them)."""
        return self.data * self.fsdp * self.tensor * self.expert


def check_devices(cfg: MeshConfig) -> None:
    """ValueError naming the mesh when an axis is below 1 or this process sees fewer devices than it
    needs."""
    for axis in ("data", "fsdp", "tensor", "expert"):
        if getattr(cfg, axis) < 1:
            raise ValueError(f"mesh.{axis}: must be > 0, got {getattr(cfg, axis)}")
    devices = cfg.devices
    expert = f" x expert={cfg.expert}" if cfg.expert != 1 else ""
    if cfg.rollout_devices and devices + cfg.rollout_devices > jax.device_count():
        raise ValueError(
            f"mesh.rollout_devices: {cfg.rollout_devices} rollout devices after the trainer mesh "
            f"data={cfg.data} x fsdp={cfg.fsdp} x tensor={cfg.tensor}{expert} ({devices} devices) "
            f"need {devices + cfg.rollout_devices} devices, this process sees {jax.device_count()}"
        )
    if devices > jax.device_count():
        raise ValueError(
            f"mesh: data={cfg.data} x fsdp={cfg.fsdp} x tensor={cfg.tensor}{expert} "
            f"needs {devices} devices, this process sees {jax.device_count()}"
        )
    processes = jax.process_count()
    if cfg.rollout_devices and processes > 1 and (devices % processes or cfg.rollout_devices % processes):
        raise ValueError(
            f"mesh.rollout_devices: each of the job's {processes} processes gives the same share of "
            f"the trainer mesh ({devices} devices) and of the {cfg.rollout_devices} rollout devices; "
            f"both must be multiples of {processes}"
        )


def split_devices(cfg: MeshConfig) -> tuple[list, list]:
    """(trainer mesh devices, rollout devices): the first cfg.devices and the last
    cfg.rollout_devices devices; in a job of several processes with rollout devices, the first
    cfg.devices / P and the last cfg.rollout_devices / P local devices of every process (process
    order), so that each process holds devices of both and the weights copy between them stays in
    the process."""
    every = jax.devices()
    if not cfg.rollout_devices or jax.process_count() == 1:
        return every[: cfg.devices], every[len(every) - cfg.rollout_devices :]
    processes = jax.process_count()
    hosts = [[d for d in every if d.process_index == p] for p in range(processes)]
    train, generate = cfg.devices // processes, cfg.rollout_devices // processes
    return (
        [d for local in hosts for d in local[:train]],
        [d for local in hosts for d in local[len(local) - generate :]],
    )


class Placement:
    def __init__(self, cfg: MeshConfig):
        devices = cfg.devices
        self.row_shards = cfg.data * cfg.fsdp  # training rows are split over these devices
        self.sharding = (
            None
            if devices == 1
            else Sharding(make_mesh(cfg.data, cfg.fsdp, cfg.tensor, devices=split_devices(cfg)[0], expert=cfg.expert))
        )

    def state(self, state: dict) -> dict:
        """The training state committed to its devices: leaves already on the mesh stay as they
        are (the policy, its moments), all others are replicated (on one device: device 0)."""
        if self.sharding is None:
            return jax.device_put(state, jax.devices()[0])
        mesh, replicated = self.sharding.mesh, self.sharding.replicated()

        def place(leaf):
            on_mesh = isinstance(getattr(leaf, "sharding", None), NamedSharding) and leaf.sharding.mesh == mesh
            return leaf if on_mesh else from_host(leaf, replicated)

        return jax.tree.map(place, state)

    def pin(self, tree, like):
        """`tree` placed like `like` (a pytree of the same structure): keeps a compiled update's
        outputs on the input layout, so the next call reuses its compilation.

        A leaf whose sharding only spells the same layout otherwise (an update returns
        P('fsdp',) for P('fsdp', None)) is relabelled over its own buffers: a copy would hold a
        second policy and optimizer state while the outputs live (Qwen3-8B on 2 x 80 GB ran out
        of memory in its second minibatch). The leaves that really move do so in one program.
        `jax.device_put` runs one per leaf (dozens per minibatch: the update returns the norms of
        the policy and its moments sharded otherwise), all dispatched without waiting: on a CPU
        mesh they pass the runtime's limit of computations in flight per device (32), and the
        launches that wait for a slot hold the worker threads (as many as local devices) that the
        collective program before them needs, so that process deadlocks and the others wait on it
        in their next collective."""
        if self.sharding is None:
            return tree
        leaves, treedef = jax.tree.flatten(tree)
        targets = [x.sharding for x in treedef.flatten_up_to(like)]
        moved = []
        for i, (x, target) in enumerate(zip(leaves, targets)):
            if x.sharding == target:
                continue
            if x.sharding.is_equivalent_to(target, x.ndim):
                leaves[i] = jax.make_array_from_single_device_arrays(
                    x.shape, target, [shard.data for shard in x.addressable_shards]
                )
            else:
                moved.append(i)
        if moved:
            placed = _placer(tuple(targets[i] for i in moved))([leaves[i] for i in moved])
            for i, x in zip(moved, placed):
                leaves[i] = x
        return treedef.unflatten(leaves)

    def row_sharding(self, shape: tuple[int, ...]) -> NamedSharding | None:
        """Sharding of an array [B, ...] whose rows are split over the mesh's batch axes (None on one
        device, where training rows stay host arrays)."""
        if self.sharding is None:
            return None
        return self.sharding.named(("batch",) + (None,) * (len(shape) - 1), shape)

    def rows(self, batch):
        """A pytree of host arrays [B, ...] (a dict, `jaxspec.rl.batch.PackedRows`) with their rows
        split over the mesh's batch axes."""
        if self.sharding is None:
            return batch
        return jax.tree.map(lambda v: from_host(v, self.row_sharding(np.shape(v))), batch)


def from_host(value, sharding: NamedSharding) -> jax.Array:
    """`value`, a host value that every process holds in full (every process of a run computes the
    same host data), placed with `sharding`: each process copies the slices of its own devices.

    Not `jax.device_put`, which onto a mesh that spans processes first checks that all processes
    passed the same value, with a collective program per array (`multihost_utils.assert_equal`): a
    gather of every minibatch across hosts, and one more place where processes wait on each other.
    """
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def cast_floats(tree, dtype, shardings=None):
    """`tree` with its floating leaves cast to `dtype` (integer and boolean leaves as they are), as
    one program: leaf-by-leaf casts would be one dispatch each, and on a CPU mesh a burst of them
    can exhaust the runtime's programs in flight (see `Placement.pin`). shardings: a pytree of
    NamedShardings like `tree`, the layout the same program gives the outputs (e.g. the policy
    gathered over the batch axes, `jaxspec.models.sharding.gathered_param_shardings`); None keeps
    the inputs' layout, and then a tree whose floats are all in `dtype` comes back as it is (no
    copy)."""
    leaves, treedef = jax.tree.flatten(tree)
    if shardings is None and all(x.dtype == dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)):
        return tree
    targets = None if shardings is None else tuple(treedef.flatten_up_to(shardings))
    return treedef.unflatten(_caster(jnp.dtype(dtype), targets)(leaves))


def rollout_policy(policy, dtype, sharding: Sharding | None, gather: bool):
    """The policy as a rollout reads it: its floats cast to `dtype` (`cast_floats`); with `gather` on
    a mesh, laid out by `gathered_param_shardings` in the same program (whole on every device, or its
    tensor slice), so that decode steps read local weights, after a check that this copy fits the
    device's free memory (an error naming rollout.gather_weights)."""
    if not gather or sharding is None:
        return cast_floats(policy, dtype)
    targets = gathered_param_shardings(sharding, policy)
    check_weights_fit(
        weights_bytes_per_device(policy, targets, dtype),
        jax.local_devices()[0].memory_stats(),
        "rollout.gather_weights",
    )
    return cast_floats(policy, dtype, targets)


@functools.cache
def _caster(dtype, shardings: tuple[NamedSharding, ...] | None):
    def cast(xs):
        return [x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in xs]

    return jax.jit(cast, out_shardings=None if shardings is None else list(shardings))


@functools.cache
def _placer(shardings: tuple[NamedSharding, ...]):
    """A compiled copy of a list of arrays onto `shardings` (one per array)."""
    return jax.jit(lambda xs: xs, out_shardings=list(shardings))


def abstract(tree):
    """ShapeDtypeStructs of the arrays in `tree`, with their shardings and weak types."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.aval.weak_type), tree
    )
