from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxspec.models import ModelConfig
from jaxspec.models.memory import check_weights_fit, weights_bytes_per_device

CFG = ModelConfig.from_json(Path(__file__).resolve().parents[2] / "configs" / "models" / "qwen3-8b.json")


def test_weights_bytes_per_device_count_the_gathered_copy():
    """The rollout copy of Qwen3-8B in bf16: half the policy per GPU sharded over fsdp=2, the whole
    policy (16.4 GB) gathered; with tensor=2 too, the gathered copy is the policy / tensor but for
    the replicated norms."""
    import jax

    from jaxspec.models import Sharding, init_params, make_mesh, param_shardings
    from jaxspec.models.sharding import gathered_param_shardings

    shapes = jax.eval_shape(lambda: init_params(CFG, jax.random.key(0)))
    whole = sum(x.size for x in jax.tree.leaves(shapes)) * 2
    fsdp = Sharding(make_mesh(data=1, fsdp=2, tensor=1, devices=jax.devices()[:2]))
    sharded = weights_bytes_per_device(shapes, param_shardings(fsdp, shapes), jnp.bfloat16)
    gathered = weights_bytes_per_device(shapes, gathered_param_shardings(fsdp, shapes), jnp.bfloat16)
    assert gathered == whole and 16.3e9 < whole < 16.5e9
    assert whole / 2 <= sharded < whole / 2 + 1e6  # only the norms are not split
    assert weights_bytes_per_device(shapes, param_shardings(fsdp, shapes), jnp.float32) == 2 * sharded

    both = Sharding(make_mesh(data=1, fsdp=2, tensor=2, devices=jax.devices()[:4]))
    tensor_split = (
        sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(shapes) if not path[-1].key.endswith("norm")) * 2
    )
    got = weights_bytes_per_device(shapes, gathered_param_shardings(both, shapes), jnp.bfloat16)
    assert got == tensor_split // 2 + (whole - tensor_split)
    assert got < weights_bytes_per_device(shapes, gathered_param_shardings(fsdp, shapes), jnp.bfloat16)


def test_check_weights_fit():
    check_weights_fit(10**12, None, "rollout.gather_weights")  # CPU: nothing to check
    check_weights_fit(800, {"bytes_limit": 1000, "bytes_in_use": 200}, "rollout.gather_weights")
    with pytest.raises(
        ValueError,
        match=r"rollout.gather_weights: .* needs 0.00 GB per device, but the device has "
        r"only 0.00 GB free .*; set rollout.gather_weights: false",
    ):
        check_weights_fit(801, {"bytes_limit": 1000, "bytes_in_use": 200}, "rollout.gather_weights")
