"""Routing replay (R3) in the model: a sparse layer run on given experts against a dense reference
(outputs and gradients, ragged_dot and the kernel, one device and a mesh), the full forward's
per-position and per-layer alignment of replayed experts, and `extend` recording the experts the
full forward routes to."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import ModelConfig, Sharding, extend, init_cache, make_mesh, shard_params
from jaxspec.models.moe import SPARSE_KEYS, expert_id_dtype, moe_mlp, top_experts
from jaxspec.models.transformer import forward_router
from tests.models.hf_reference import random_params, random_tokens, rel_max_err
from tests.models.test_moe import needs_triton

FP32_TOL = 1e-5
_forward = jax.jit(forward_router, static_argnums=0)  # one compilation per shape, not one per op
_extend = jax.jit(extend, static_argnums=0, static_argnames=("record_experts",))
# Layers 0, 2 and 3 sparse (16 experts, top-2, renormalised: small_moe's routing), layer 1 dense.
CFG = ModelConfig(
    family="qwen3_moe",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    norm_topk_prob=True,
    mlp_only_layers=(1,),
)


@pytest.fixture(scope="module")
def params():
    assert CFG.sparse_layers == (0, 2, 3)
    return random_params(CFG, jax.random.key(40))


def _other_experts(key, shape, num_experts):
    """int32 [..., k] distinct expert ids per token, drawn uniformly (not the router's choice)."""
    scores = jax.random.uniform(key, (*shape[:-1], num_experts))
    return jax.lax.top_k(scores, shape[-1])[1]


def _dense_replay_reference(layer, x, experts, norm_topk_prob):
    """Every expert on every token, weighted by the router's softmax probabilities on the given
    experts [B, T, k] (renormalised over them with norm_topk_prob) and zero elsewhere."""
    flat = x.reshape(-1, x.shape[-1])
    probs = jax.nn.softmax(flat @ layer["router"], axis=-1)
    chosen = jax.nn.one_hot(experts.reshape(flat.shape[0], -1), probs.shape[-1]).sum(axis=1)  # [N, E]
    gates = probs * chosen
    if norm_topk_prob:
        gates = gates / gates.sum(axis=-1, keepdims=True)
    hidden = jax.nn.silu(jnp.einsum("nh,ehi->eni", flat, layer["experts_gate"])) * jnp.einsum(
        "nh,ehi->eni", flat, layer["experts_up"]
    )
    return jnp.einsum("eni,eih,ne->nh", hidden, layer["experts_down"], gates).reshape(x.shape)


@pytest.mark.parametrize("impl", ["ragged_dot", pytest.param("triton-interpret", marks=needs_triton)])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_a_sparse_layer_runs_replayed_experts_weighted_by_its_router(params, norm_topk_prob, impl):
    """moe_mlp with given experts (not the top-k) equals every expert on every token masked to
    them, outputs and gradients; the router gets its gradient through the gate weights."""
    layer = {k: params["layers"][0][k] for k in SPARSE_KEYS}
    x = jax.random.normal(jax.random.key(41), (3, 5, CFG.hidden_size))
    experts = _other_experts(jax.random.key(42), (3, 5, 2), CFG.num_experts)
    _, router, own = moe_mlp(layer, x, 2, norm_topk_prob, impl)
    np.testing.assert_array_equal(own, top_experts(router, 2))  # the experts a token ran on: its top-k
    assert np.mean(np.sort(np.asarray(own), -1) != np.sort(np.asarray(experts), -1)) > 0.5
    probe = jax.random.normal(jax.random.key(43), x.shape)

    def loss(fn, layer, x):
        return jnp.sum(fn(layer, x) * probe)

    ours = jax.grad(loss, argnums=(1, 2))(
        lambda p, x: moe_mlp(p, x, 2, norm_topk_prob, impl, experts=experts.astype(jnp.uint8))[0], layer, x
    )
    ref = jax.grad(loss, argnums=(1, 2))(lambda p, x: _dense_replay_reference(p, x, experts, norm_topk_prob), layer, x)
    out, _, ran_on = moe_mlp(layer, x, 2, norm_topk_prob, impl, experts=experts)
    np.testing.assert_array_equal(ran_on, experts)
    assert rel_max_err(out, _dense_replay_reference(layer, x, experts, norm_topk_prob)) < FP32_TOL
    for name in layer:
        assert float(jnp.max(jnp.abs(ref[0][name]))) > 0, name
        assert rel_max_err(ours[0][name], ref[0][name]) < FP32_TOL, name
    assert rel_max_err(ours[1], ref[1]) < FP32_TOL


def test_replaying_a_forwards_own_experts_changes_nothing(params):
    tokens = jnp.asarray(random_tokens(44, (2, 12), CFG.vocab_size))
    logits, _, router = _forward(CFG, params, tokens)
    own = jnp.moveaxis(top_experts(router, 2), 0, 2).astype(jnp.uint8)  # [B, T, L_sparse, k]
    replayed, _, replayed_router = _forward(CFG, params, tokens, experts=own)
    np.testing.assert_array_equal(replayed, logits)
    np.testing.assert_array_equal(replayed_router, router)


@pytest.mark.parametrize("position, layer", [(0, 0), (5, 1), (11, 2)])
def test_a_replayed_expert_acts_at_its_own_position_and_layer(params, position, layer):
    """Changing the replayed experts of one (position, sparse layer) leaves the logits before that
    position and the router logits of the layers up to it as they were, and changes the logits
    from that position on: experts[b, t, j] is sparse layer j's routing of token t."""
    tokens = jnp.asarray(random_tokens(45, (1, 12), CFG.vocab_size))
    _, _, router = _forward(CFG, params, tokens)
    own = jnp.moveaxis(top_experts(router, 2), 0, 2)
    base_logits, _, base_router = _forward(CFG, params, tokens, experts=own)
    others = [e for e in range(CFG.num_experts) if e not in np.asarray(own[0, position, layer])][:2]
    changed = own.at[0, position, layer].set(jnp.asarray(others))
    logits, _, new_router = _forward(CFG, params, tokens, experts=changed)
    np.testing.assert_array_equal(logits[:, :position], base_logits[:, :position])
    assert float(jnp.max(jnp.abs(logits[:, position] - base_logits[:, position]))) > 1e-4
    np.testing.assert_array_equal(new_router[: layer + 1], base_router[: layer + 1])  # the routers read no output
    np.testing.assert_array_equal(new_router[:, :, :position], base_router[:, :, :position])


def test_replayed_experts_must_fit_the_policy(params):
    tokens = jnp.zeros((2, 6), jnp.int32)
    with pytest.raises(ValueError, match=r"experts must be integer \[B, T, sparse layers, top_k\] = \[2, 6, 3, 2\]"):
        forward_router(CFG, params, tokens, experts=jnp.zeros((2, 6, 4, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"got float32"):
        forward_router(CFG, params, tokens, experts=jnp.zeros((2, 6, 3, 2), jnp.float32))
    dense = ModelConfig(
        family="qwen3",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    dense_params = random_params(dense, jax.random.key(46))
    with pytest.raises(ValueError, match="experts: the policy is dense"):
        forward_router(dense, dense_params, tokens, experts=jnp.zeros((2, 6, 0, 1), jnp.int32))
    with pytest.raises(ValueError, match="record_experts: the policy is dense"):
        extend(
            dense,
            dense_params,
            init_cache(dense, 2, 8),
            tokens,
            jnp.zeros((2, 6), jnp.int32),
            jnp.zeros((2,), jnp.int32),
            record_experts=True,
        )


@pytest.mark.parametrize("num_experts", [16, 300])
def test_extend_records_the_experts_the_full_forward_routes_to(num_experts):
    """A prefill and then a decode step through the cache record, for every token and sparse layer,
    the top-k of the full forward's router (compact ids: uint8 up to 256 experts, else int16)."""
    cfg = dataclasses.replace(CFG, num_experts=num_experts)
    params = random_params(cfg, jax.random.key(47))
    tokens = jnp.asarray(random_tokens(48, (2, 9), cfg.vocab_size))
    _, _, router = _forward(cfg, params, tokens)
    want = np.asarray(jnp.moveaxis(top_experts(router, 2), 0, 2))  # [B, T, L_sparse, k]
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    _, _, cache, prefill = _extend(
        cfg,
        params,
        init_cache(cfg, 2, 12),
        tokens[:, :8],
        positions[:, :8],
        jnp.zeros((2,), jnp.int32),
        record_experts=True,
    )
    _, _, _, step = _extend(
        cfg, params, cache, tokens[:, 8:], positions[:, 8:], jnp.full((2,), 8, jnp.int32), record_experts=True
    )
    assert prefill.dtype == step.dtype == expert_id_dtype(num_experts)
    assert prefill.shape == (2, 8, 3, 2) and step.shape == (2, 1, 3, 2)
    np.testing.assert_array_equal(np.concatenate([prefill, step], axis=1), want)
    if num_experts > 256:
        assert want.max() > 255  # ids a uint8 record would wrap


def test_expert_ids_are_stored_compactly():
    assert expert_id_dtype(8) == jnp.uint8 and expert_id_dtype(256) == jnp.uint8
    assert expert_id_dtype(257) == jnp.int16 and expert_id_dtype(32768) == jnp.int16
    with pytest.raises(ValueError, match="32769 experts do not fit int16"):
        expert_id_dtype(32769)


@pytest.mark.parametrize(
    "axes, impl",
    [pytest.param(dict(data=2), "triton-interpret", marks=needs_triton), (dict(data=2, expert=4), "ragged_dot")],
)
def test_replay_on_a_mesh_equals_one_device(params, axes, impl):
    """The replayed forward with rows split over 2 devices (the kernel per device, or ragged_dot with
    the experts split over 4) equals the one-device replay, logits and gradients."""
    tokens = jnp.asarray(random_tokens(49, (4, 10), CFG.vocab_size))
    experts = _other_experts(jax.random.key(50), (4, 10, 3, 2), CFG.num_experts).astype(jnp.uint8)
    probe = jax.random.normal(jax.random.key(51), (4, 10, CFG.vocab_size))

    def loss(params, tokens, experts, impl, sharding):
        logits = forward_router(CFG, params, tokens, experts=experts, moe_impl=impl, sharding=sharding)[0]
        return jnp.sum(logits * probe), logits

    step = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=(3, 4))
    (_, want), want_grads = step(params, tokens, experts, "ragged_dot", None)
    devices = jax.devices()[: 2 * axes.get("expert", 1)]
    sharding = Sharding(make_mesh(**({"fsdp": 1} | axes), devices=devices))
    rows = sharding.named(("batch", None), tokens.shape)
    (_, got), grads = step(
        shard_params(sharding, params),
        jax.device_put(tokens, rows),
        jax.device_put(experts, sharding.named(("batch", None, None, None), experts.shape)),
        impl,
        sharding,
    )
    assert rel_max_err(got, want) < FP32_TOL
    for name in SPARSE_KEYS:
        assert rel_max_err(grads["layers"][2][name], want_grads["layers"][2][name]) < FP32_TOL, name
