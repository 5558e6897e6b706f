"""MeshConfig -> Placement on the 8 virtual CPU devices: the expert axis and its checks."""

import jax
import pytest

from jaxspec.placement import MeshConfig, Placement, check_devices


def test_expert_axis_builds_a_mesh_that_splits_experts_not_rows():
    placement = Placement(MeshConfig(data=2, expert=4))
    assert dict(placement.sharding.mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 1, "expert": 4}
    assert placement.row_shards == 2
    assert placement.sharding.spec(("expert", "embed", "mlp"), (8, 32, 16))[0] == "expert"
    assert placement.row_sharding((4, 3)).spec[0] == "data"


@pytest.mark.parametrize("mesh, match", [
    (MeshConfig(expert=0), "mesh.expert: must be > 0, got 0"),
    (MeshConfig(data=2, expert=8), "mesh: data=2 x fsdp=1 x tensor=1 x expert=8 needs 16 devices, this process sees 8"),
])
def test_check_devices_rejects_bad_expert_axis(mesh, match):
    assert jax.device_count() == 8
    with pytest.raises(ValueError, match=match):
        check_devices(mesh)
