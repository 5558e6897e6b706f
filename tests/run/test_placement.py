"""MeshConfig -> Placement on the 8 virtual CPU devices: the expert axis and its checks; the cast of
the rollout weights."""

import jax
import numpy as np
import pytest

from jaxspec.run.placement import MeshConfig, Placement, check_devices


def test_expert_axis_builds_a_mesh_that_splits_experts_not_rows():
    placement = Placement(MeshConfig(data=2, expert=4))
    assert dict(placement.sharding.mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 1, "expert": 4}
    assert placement.row_shards == 2
    assert placement.sharding.spec(("expert", "embed", "mlp"), (8, 32, 16))[0] == "expert"
    assert placement.row_sharding((4, 3)).spec[0] == "data"


@pytest.mark.parametrize(
    "mesh, match",
    [
        (MeshConfig(expert=0), "mesh.expert: must be > 0, got 0"),
        (
            MeshConfig(data=2, expert=8),
            "mesh: data=2 x fsdp=1 x tensor=1 x expert=8 needs 16 devices, this process sees 8",
        ),
    ],
)
def test_check_devices_rejects_bad_expert_axis(mesh, match):
    assert jax.device_count() == 8
    with pytest.raises(ValueError, match=match):
        check_devices(mesh)


def test_cast_floats_casts_and_lays_out_in_one_program():
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxspec.models import make_mesh
    from jaxspec.run.placement import cast_floats

    tree = {"w": jnp.arange(8, dtype=jnp.float32), "ids": jnp.arange(4)}
    assert cast_floats(tree, jnp.float32) is tree  # nothing to change: no copy
    cast = cast_floats(tree, jnp.bfloat16)
    assert (cast["w"].dtype, cast["ids"].dtype) == (jnp.bfloat16, tree["ids"].dtype)
    np.testing.assert_array_equal(np.asarray(cast["w"], np.float32), np.arange(8))
    mesh = make_mesh(1, 2, 1, devices=jax.devices()[:2])
    split = NamedSharding(mesh, PartitionSpec("fsdp"))
    placed = cast_floats(tree, jnp.float32, {"w": split, "ids": NamedSharding(mesh, PartitionSpec())})
    assert placed["w"].sharding == split and {s.data.shape for s in placed["w"].addressable_shards} == {(4,)}
    assert placed["ids"].sharding.is_fully_replicated


def test_pin_relabels_an_equivalent_layout_over_its_buffers_and_moves_the_rest():
    """An update returns P('fsdp',) for its inputs' P('fsdp', None): the pinned leaf is the same
    buffers under the input's sharding (a copy held a second 8B policy and optimizer state); a leaf
    laid out otherwise moves."""
    from jax.sharding import NamedSharding, PartitionSpec

    placement = Placement(MeshConfig(data=2, fsdp=4))
    mesh = placement.sharding.mesh
    like = {
        "w": jax.device_put(np.zeros((8, 3), np.float32), NamedSharding(mesh, PartitionSpec("fsdp", None))),
        "norm": jax.device_put(np.zeros(4, np.float32), NamedSharding(mesh, PartitionSpec())),
    }
    out = {
        "w": jax.device_put(np.arange(24, dtype=np.float32).reshape(8, 3), NamedSharding(mesh, PartitionSpec("fsdp"))),
        "norm": jax.device_put(np.arange(4, dtype=np.float32), NamedSharding(mesh, PartitionSpec("fsdp"))),
    }
    assert out["w"].sharding != like["w"].sharding  # spelled otherwise, the same layout
    buffers = {s.device: s.data.unsafe_buffer_pointer() for s in out["w"].addressable_shards}
    pinned = placement.pin(out, like)
    assert pinned["w"].sharding == like["w"].sharding and pinned["norm"].sharding == like["norm"].sharding
    assert {s.device: s.data.unsafe_buffer_pointer() for s in pinned["w"].addressable_shards} == buffers
    np.testing.assert_array_equal(np.asarray(pinned["w"]), np.arange(24).reshape(8, 3))
    np.testing.assert_array_equal(np.asarray(pinned["norm"]), np.arange(4))
