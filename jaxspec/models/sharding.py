"""Device mesh (data, fsdp, tensor, expert) and logical-axis sharding rules for params and
activations.

Every param dimension has a logical name (`PARAM_AXES`); `rules` map logical names to mesh axes.
A mapping is dropped for a dimension the mesh axes do not divide, so any device count works: the
dimension is then replicated instead of failing.

The expert axis splits the stacked expert weights of mixture-of-experts layers (expert
parallelism); everything else is replicated over it. Under jit, XLA's SPMD partitioner moves the
routed tokens to the devices holding their experts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("q_heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("expert", ("expert",)),
    ("head_dim", ()),
    ("norm", ()),
    ("seq", ()),
    ("act_embed", ()),
    ("cache_seq", ()),
)

WEIGHT_AXES = ("embed", "vocab", "q_heads", "kv_heads", "head_dim", "mlp")  # a dense layer's and the LM head's

# Logical axes of each param leaf, keyed by the leaf's name in the params pytree.
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("norm",),
    "attn_norm": ("norm",),
    "mlp_norm": ("norm",),
    "q": ("embed", "q_heads", "head_dim"),
    "kv": ("embed", None, "kv_heads", "head_dim"),
    "qkv": ("embed", "kv_heads", None, "head_dim"),  # a rollout's fused q, k, v (`params.fuse_qkv`)
    "o": ("q_heads", "head_dim", "embed"),
    "q_bias": ("q_heads", "head_dim"),
    "k_bias": ("kv_heads", "head_dim"),
    "v_bias": ("kv_heads", "head_dim"),
    "qkv_bias": ("kv_heads", None, "head_dim"),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "gate_up": ("embed", None, "mlp"),
    "down": ("mlp", "embed"),
    "router": ("embed", None),
    "experts_gate": ("expert", "embed", "mlp"),
    "experts_up": ("expert", "embed", "mlp"),
    "experts_down": ("expert", "mlp", "embed"),
}

KV_CACHE_AXES = ("batch", "cache_seq", "kv_heads", "head_dim")
# The slot engine's page pools on a mesh: [group, page, position in the page, kv head, head dim]
# (`jaxspec.rollout.slot_state`); a group's pages stay on its devices.
KV_PAGES_AXES = ("batch", None, "cache_seq", "kv_heads", "head_dim")


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence | None = None, expert: int = 1) -> Mesh:
    """Mesh with axes (data, fsdp, tensor) and, when expert != 1, expert; one size may be -1 to take
    the remaining devices. (Without experts the mesh keeps the three axes of dense policies.)"""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor, expert]
    if sizes.count(-1) > 1:
        raise ValueError(
            f"at most one mesh axis may be -1, got data={data} fsdp={fsdp} tensor={tensor} expert={expert}"
        )
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices are not divisible by the fixed mesh axes ({known})")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} x expert={sizes[3]} needs "
            f"{math.prod(sizes)} devices, "
            f"have {len(devices)}"
        )
    if sizes[3] == 1:
        return Mesh(np.asarray(devices).reshape(sizes[:3]), MESH_AXES[:3])
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


@dataclasses.dataclass(frozen=True)
class Sharding:
    """A mesh plus logical-axis rules; resolves logical axes to PartitionSpecs for given shapes.
    gathered_weights: the weights a call reads are laid out by `gathered_param_shardings` (whole
    over the batch axes: a rollout with rollout.gather_weights), not by the rules."""

    mesh: Mesh
    rules: tuple[tuple[str, tuple[str, ...]], ...] = DEFAULT_RULES
    gathered_weights: bool = False

    def spec(self, axes: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec:
        if len(axes) != len(shape):
            raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
        rules = dict(self.rules)
        used: set[str] = set()
        parts = []
        for name, size in zip(axes, shape):
            mesh_axes = []
            for ax in rules.get(name, ()) if name else ():
                ax_size = self.mesh.shape.get(ax, 1)  # an axis the mesh lacks has size 1
                if ax in used or ax_size == 1:
                    continue
                if size % (math.prod(self.mesh.shape[a] for a in mesh_axes) * ax_size) == 0:
                    mesh_axes.append(ax)
            used.update(mesh_axes)
            parts.append(tuple(mesh_axes) if len(mesh_axes) > 1 else (mesh_axes[0] if mesh_axes else None))
        return PartitionSpec(*parts)

    def named(self, axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape))

    def constrain(self, x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, self.named(axes, x.shape))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


def param_axes(path: tuple) -> tuple[str, ...]:
    """Logical axes for the param at a pytree key path (the last dict key names the leaf)."""
    leaf = next((k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey)), None)
    if leaf not in PARAM_AXES:
        raise ValueError(f"no sharding rule for param {jax.tree_util.keystr(path)}")
    return PARAM_AXES[leaf]


def param_shardings(sharding: Sharding, params_shapes) -> object:
    """Pytree of NamedShardings matching a params pytree (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: sharding.named(param_axes(path), leaf.shape), params_shapes
    )


def gathered_param_shardings(sharding: Sharding, params_shapes) -> object:
    """`param_shardings` with no dimension split over the mesh's batch axes (data, fsdp): every
    device holds the whole params, or its tensor (and expert) slice of them. A rollout that reads
    weights laid out so gathers them once, not in every decode step (rollout.gather_weights)."""
    batch_axes = set(dict(sharding.rules).get("batch", ()))
    rules = tuple((name, tuple(a for a in axes if a not in batch_axes)) for name, axes in sharding.rules)
    return param_shardings(dataclasses.replace(sharding, rules=rules), params_shapes)


def on_devices(sharding: Sharding | None) -> bool:
    """Whether a call with this sharding runs on a mesh of several devices (None or a one-device
    mesh: one device)."""
    return sharding is not None and sharding.mesh.size > 1


def splits_weights(sharding: Sharding | None, axes: Sequence[str] = WEIGHT_AXES) -> bool:
    """Whether the mesh splits a weight dimension of these logical axes (default: a dense layer's
    and the LM head's) over more than one device: not on one device, nor over the batch axes where
    the weights are gathered (`Sharding.gathered_weights`)."""
    if sharding is None:
        return False
    rules = dict(sharding.rules)
    mesh_axes = {axis for name in axes for axis in rules.get(name, ())}
    if sharding.gathered_weights:
        mesh_axes -= set(rules.get("batch", ()))
    return any(sharding.mesh.shape.get(axis, 1) > 1 for axis in mesh_axes)


def shard_params(sharding: Sharding, params):
    """Places an existing params pytree onto the mesh."""
    return jax.device_put(params, param_shardings(sharding, params))


def constrain(sharding: Sharding | None, x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """x constrained to the logical `axes` on the mesh; x itself without a mesh (one device)."""
    return x if sharding is None else sharding.constrain(x, axes)
