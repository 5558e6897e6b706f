"""Meshes over the 8 virtual CPU devices: param placement, sharded forward and extend."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxspec.models import (
    KVCache,
    ModelConfig,
    Sharding,
    extend,
    forward,
    init_cache,
    load_hf,
    make_mesh,
    param_shardings,
    save_hf,
    shard_params,
)
from jaxspec.models.sharding import KV_CACHE_AXES, splits_weights
from tests.models.hf_reference import random_params, random_tokens, rel_max_err

# Sharded reductions add partial sums in another order: fp32 rounding only.
TOL = 5e-6  # relative to max |logit| (observed ~4e-7)
BATCH, SEQ = 8, 16

# hidden 32, 4 query heads, 2 KV heads, MLP 48, vocab 97: some dims divide the mesh axes, some
# (vocab always, KV heads under tensor=4/8, query heads under tensor=8) must fall back to replication.
CFG = ModelConfig(
    family="qwen2",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    params = random_params(CFG, jax.random.key(0))
    path = tmp_path_factory.mktemp("sharding") / "ckpt"
    save_hf(CFG, params, path)
    return path, params


def test_eight_virtual_devices():
    assert jax.device_count() == 8


@pytest.mark.parametrize("shape", [(1, 8, 1), (2, 2, 2), (1, 2, 4), (8, 1, 1), (1, 1, 8)])
def test_make_mesh_shapes(shape):
    mesh = make_mesh(*shape)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert tuple(mesh.shape.values()) == shape
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


def test_make_mesh_expert_axis():
    """The expert axis exists only when it splits experts; without it expert weights replicate."""
    mesh = make_mesh(fsdp=-1, expert=2)
    assert mesh.axis_names == ("data", "fsdp", "tensor", "expert") and tuple(mesh.shape.values()) == (1, 4, 1, 2)
    assert Sharding(mesh).spec(("expert", "embed", "mlp"), (4, 32, 16)) == P("expert", "fsdp", None)
    assert Sharding(make_mesh(1, 8, 1)).spec(("expert", "embed", "mlp"), (4, 32, 16)) == P(None, "fsdp", None)
    with pytest.raises(ValueError, match="mesh data=1 x fsdp=2 x tensor=1 x expert=3 needs 6 devices"):
        make_mesh(1, 2, 1, expert=3)


@pytest.mark.parametrize("sizes,expected", [((2, -1, 1), (2, 4, 1)), ((1, -1, 8), (1, 1, 8)), ((-1, 2, 2), (2, 2, 2))])
def test_make_mesh_fills_one_axis(sizes, expected):
    assert tuple(make_mesh(*sizes).shape.values()) == expected


@pytest.mark.parametrize(
    "sizes,words",
    [
        ((3, 3, 1), ["data=3", "fsdp=3", "tensor=1", "9", "8"]),
        ((2, 2, 1), ["data=2", "fsdp=2", "4", "8"]),
        ((3, -1, 1), ["3", "8"]),
        ((-1, -1, 2), ["data=-1", "fsdp=-1"]),
    ],
)
def test_make_mesh_impossible_shapes(sizes, words):
    with pytest.raises(ValueError) as err:
        make_mesh(*sizes)
    for word in words:
        assert word in str(err.value)


EXPECTED_SPECS = {  # mesh (data=1, fsdp=2, tensor=4)
    ("embed",): P(None, "fsdp"),  # vocab 97 not divisible by tensor=4
    ("lm_head",): P("fsdp", None),
    ("final_norm",): P(None),
    ("layers", 0, "q"): P("fsdp", "tensor", None),
    ("layers", 0, "kv"): P("fsdp", None, None, None),  # 2 KV heads over tensor=4: replicated
    ("layers", 1, "o"): P("tensor", None, "fsdp"),
    ("layers", 1, "q_bias"): P("tensor", None),
    ("layers", 1, "v_bias"): P(None, None),
    ("layers", 0, "gate_up"): P("fsdp", None, "tensor"),  # gate and up split alike along F
    ("layers", 0, "down"): P("tensor", "fsdp"),
    ("layers", 1, "mlp_norm"): P(None),
}


def _leaf(params, path):
    for key in path:
        params = params[key]
    return params


def test_load_hf_places_each_param_in_its_sharding(checkpoint):
    path, params = checkpoint
    sharding = Sharding(make_mesh(1, 2, 4))
    cfg, sharded = load_hf(path, sharding=sharding)
    for leaf_path, spec in EXPECTED_SPECS.items():
        leaf = _leaf(sharded, leaf_path)
        assert leaf.sharding.spec == spec, leaf_path
        assert leaf.sharding.mesh == sharding.mesh
        shard_shape = tuple(n // (4 if s == "tensor" else 2 if s == "fsdp" else 1) for n, s in zip(leaf.shape, spec))
        assert {s.data.shape for s in leaf.addressable_shards} == {shard_shape}, leaf_path
        assert len(leaf.addressable_shards) == 8
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # shard_params of host params lands on the same shardings as loading with `sharding`.
    placed = shard_params(sharding, params)
    assert jax.tree.map(lambda x: x.sharding, placed) == jax.tree.map(lambda x: x.sharding, sharded)
    assert param_shardings(sharding, jax.eval_shape(lambda: params)) == jax.tree.map(lambda x: x.sharding, sharded)


@pytest.mark.parametrize("shape", [(1, 8, 1), (8, 1, 1), (1, 1, 8)])
def test_param_specs_on_one_axis_meshes(checkpoint, shape):
    _, params = checkpoint
    sharded = shard_params(Sharding(make_mesh(*shape)), params)
    specs = {k: _leaf(sharded, k).sharding.spec for k in [("embed",), ("layers", 0, "q"), ("layers", 0, "gate_up")]}
    if shape == (1, 8, 1):  # hidden 32 over fsdp=8
        assert specs == {
            ("embed",): P(None, "fsdp"),
            ("layers", 0, "q"): P("fsdp", None, None),
            ("layers", 0, "gate_up"): P("fsdp", None, None),
        }
    elif shape == (8, 1, 1):  # data parallel only: params replicated
        assert all(spec == P(*[None] * len(spec)) for spec in specs.values())
    else:  # tensor=8: 4 heads fall back to replication, MLP 48 splits
        assert specs == {
            ("embed",): P(None, None),
            ("layers", 0, "q"): P(None, None, None),
            ("layers", 0, "gate_up"): P(None, None, "tensor"),
        }


def test_spec_rejects_mismatched_rank():
    with pytest.raises(ValueError, match="do not match shape"):
        Sharding(make_mesh(1, 8, 1)).spec(("batch", "seq"), (8,))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Unsharded logits for one batch of tokens."""
    _, params = checkpoint
    tokens = random_tokens(1, (BATCH, SEQ), CFG.vocab_size)
    return tokens, jax.jit(forward, static_argnums=0)(CFG, params, jnp.asarray(tokens))


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 2, 4), (1, 8, 1)])
def test_sharded_forward_matches_unsharded(checkpoint, reference, shape):
    path, _ = checkpoint
    tokens, ref = reference
    sharding = Sharding(make_mesh(*shape))
    cfg, params = load_hf(path, sharding=sharding)
    tokens = jax.device_put(tokens, sharding.named(("batch", "seq"), tokens.shape))
    fwd = jax.jit(forward, static_argnums=0, static_argnames=("sharding",))
    logits = fwd(cfg, params, tokens, sharding=sharding)
    assert logits.sharding.is_equivalent_to(sharding.named(("batch", "seq", "vocab"), logits.shape), logits.ndim)
    assert rel_max_err(logits, ref) < TOL


def test_sharded_extend_matches_unsharded(checkpoint):
    path, params = checkpoint
    tokens = random_tokens(2, (BATCH, 6), CFG.vocab_size)
    cache_len = jnp.asarray([3, 0, 5, 3, 1, 2, 4, 3], jnp.int32)
    positions = cache_len[:, None] + jnp.arange(6, dtype=jnp.int32)[None, :]
    cache = init_cache(CFG, BATCH, 16)  # a stand-in prefix in slots 0..4
    cache = KVCache(k=tuple(x.at[:, :5].set(0.5) for x in cache.k), v=tuple(x.at[:, :5].set(-0.25) for x in cache.v))
    step = jax.jit(extend, static_argnums=0, static_argnames=("sharding", "hidden_layers"))
    ref_logits, ref_hidden, ref_cache = step(
        CFG, params, cache, jnp.asarray(tokens), positions, cache_len, hidden_layers=(0,)
    )

    sharding = Sharding(make_mesh(2, 2, 2))
    _, sharded_params = load_hf(path, sharding=sharding)
    cache_sharding = sharding.named(KV_CACHE_AXES, cache.k[0].shape)
    assert cache_sharding.spec == P(("data", "fsdp"), None, "tensor", None)
    sharded_cache = jax.device_put(cache, cache_sharding)
    logits, hidden, new_cache = step(
        CFG,
        sharded_params,
        sharded_cache,
        jax.device_put(tokens, sharding.named(("batch", "seq"), tokens.shape)),
        positions,
        cache_len,
        hidden_layers=(0,),
        sharding=sharding,
    )
    assert rel_max_err(logits, ref_logits) < TOL
    assert rel_max_err(hidden, ref_hidden) < TOL
    for got, want in zip(new_cache.k + new_cache.v, ref_cache.k + ref_cache.v):
        assert rel_max_err(got, want) < TOL


def test_splits_weights_knows_where_every_device_holds_the_whole_weights():
    """One device, a mesh over data alone, and a rollout's gathered copy over fsdp hold whole
    weights on every device; fsdp (without the gather) and tensor split them."""
    devices = jax.devices()[:2]
    assert not splits_weights(None)
    assert not splits_weights(Sharding(make_mesh(data=2, fsdp=1, tensor=1, devices=devices)))
    fsdp = Sharding(make_mesh(data=1, fsdp=2, tensor=1, devices=devices))
    assert splits_weights(fsdp)
    assert not splits_weights(dataclasses.replace(fsdp, gathered_weights=True))
    tensor = Sharding(make_mesh(data=1, fsdp=1, tensor=2, devices=devices), gathered_weights=True)
    assert splits_weights(tensor)
