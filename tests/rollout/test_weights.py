"""The rollout's weights: q and kv fused once per call, on the devices and mesh axes of q, and
left as they are where a mesh splits them unlike."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxspec.models import ModelConfig, Sharding, init_params, make_mesh, shard_params
from jaxspec.models.params import fuse_qkv
from jaxspec.rollout import Spec
from jaxspec.rollout.weights import rollout_spec, rollout_weights

# 4 query heads over 2 KV heads: a tensor axis of 2 splits both, one of 4 only the query heads
CFG = ModelConfig(
    family="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


def assert_fused(got, params):
    want = fuse_qkv(params)
    for got_layer, want_layer, layer in zip(got["layers"], want["layers"], params["layers"]):
        np.testing.assert_array_equal(got_layer["qkv"], want_layer["qkv"])
        assert got_layer.keys() == want_layer.keys()
        assert all(got_layer[k] is layer[k] for k in got_layer if k not in ("qkv", "qkv_bias"))  # no other leaf copied
    assert got["embed"] is params["embed"]


def test_one_device(params):
    fused = rollout_weights(params)
    assert_fused(fused, params)
    assert rollout_weights(fused) is fused  # nothing left to fuse


@pytest.mark.parametrize("shape", [(1, 4, 2), (2, 2, 2), (1, 8, 1)])
def test_a_mesh_that_splits_q_and_kv_alike(params, shape):
    sharding = Sharding(make_mesh(*shape))
    sharded = shard_params(sharding, params)
    fused = rollout_weights(sharded)
    assert_fused(fused, sharded)
    q_spec = sharded["layers"][0]["q"].sharding.spec
    assert fused["layers"][0]["qkv"].sharding.spec == P(q_spec[0], q_spec[1], None, None)
    assert fused["layers"][0]["qkv"].sharding.spec == sharding.spec(
        ("embed", "kv_heads", None, "head_dim"), fused["layers"][0]["qkv"].shape
    )


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 4, 2)])
def test_biases_are_fused_on_the_mesh_axes_of_their_heads(shape):
    cfg = dataclasses.replace(CFG, family="qwen2", attention_bias=True, qk_norm=False)
    params = init_params(cfg, jax.random.key(0))
    params = jax.tree.map(lambda x: x + jax.random.normal(jax.random.key(x.size), x.shape), params)
    sharding = Sharding(make_mesh(*shape, devices=jax.devices()[: int(np.prod(shape))]))
    sharded = shard_params(sharding, params)
    fused = rollout_weights(sharded)
    assert_fused(fused, sharded)
    bias = fused["layers"][0]["qkv_bias"]
    np.testing.assert_array_equal(bias, fuse_qkv(params)["layers"][0]["qkv_bias"])
    if shape != (1, 1, 1):
        assert bias.sharding.spec == sharding.spec(("kv_heads", None, "head_dim"), bias.shape)
        assert bias.sharding.spec[0] == "tensor"


def test_a_mesh_that_splits_only_the_query_heads_keeps_them_apart(params):
    sharded = shard_params(Sharding(make_mesh(1, 2, 4)), params)
    assert sharded["layers"][0]["q"].sharding.spec[1] == "tensor"  # 4 query heads over 4
    assert sharded["layers"][0]["kv"].sharding.spec[2] is None  # 2 KV heads: whole
    assert rollout_weights(sharded) is sharded


def test_the_drafts_weights_are_fused(tiny):
    cfg, params, eagle, *_ = tiny
    spec = Spec("eagle3", eagle, num_draft_tokens=2)
    fused = rollout_spec(spec)
    assert fused.num_draft_tokens == 2 and fused.draft[0] is eagle[0]
    assert "qkv" in fused.draft[1]["midlayer"] and "q" not in fused.draft[1]["midlayer"]
    np.testing.assert_array_equal(fused.draft[1]["midlayer"]["qkv"], fuse_qkv(eagle[1])["midlayer"]["qkv"])
    model = rollout_spec(Spec("draft_model", (cfg, params), num_draft_tokens=2))
    assert all("qkv" in layer for layer in model.draft[1]["layers"])
    assert rollout_spec(None) is None
    ngram = Spec("ngram")
    assert rollout_spec(ngram) is ngram


def test_weights_that_do_not_fit_are_left_for_generate_to_name(params):
    """Abstract params, and a layer whose q and kv are not one attention's (3 query heads over 2
    KV heads), are returned as they are: `generate`'s checks then name what does not fit."""
    abstract = jax.eval_shape(lambda: params)
    assert rollout_weights(abstract) is abstract
    layer = {**params["layers"][0], "q": params["layers"][0]["q"][:, :3]}
    odd = {**params, "layers": [layer, params["layers"][1]]}
    fused = rollout_weights(odd)
    assert fused["layers"][0].keys() == layer.keys() and fused["layers"][0]["q"] is layer["q"]
    assert "qkv" in fused["layers"][1]
    assert rollout_spec("eagle3") == "eagle3"  # not a Spec: generate says so
