"""The mixture-of-experts layer (`jaxspec.models.moe`): the load-balancing loss, expert-sharded forwards
and extends on 8 virtual CPU devices and gradients against a dense reference (the experts'
implementations: `test_moe_kernels.py`)."""

import importlib.util

import jax
import jax.numpy as jnp
import pytest

from jaxspec.models import ModelConfig, Sharding, extend, forward, init_cache, make_mesh, shard_params
from jaxspec.models.moe import load_balancing_loss, moe_mlp, route
from jaxspec.models.transformer import forward_router
from tests.models.hf_reference import random_params, random_tokens, rel_max_err

needs_triton = pytest.mark.skipif(
    not (importlib.util.find_spec("triton") and importlib.util.find_spec("torch")),
    reason="the grouped-matmul kernels run in Triton's interpreter (the test extra has triton and torch)",
)

FP32_TOL = 1e-5  # relative to the reference's max |value|
SHARDED_TOL = 5e-6  # sharded reductions add partial sums in another order (observed ~4e-7)


def test_load_balancing_loss_is_top_k_under_balanced_routing():
    tokens = jnp.arange(4)
    balanced = jnp.zeros((1, 1, 4, 8)).at[0, 0, tokens, 2 * tokens].set(20.0).at[0, 0, tokens, 2 * tokens + 1].set(20.0)
    assert float(load_balancing_loss(balanced, 2)) == pytest.approx(2.0)  # each expert: 1/4 of the picks, p 1/8
    uniform = jnp.zeros((2, 3, 5, 8), jnp.float32)  # all probabilities 1/8: balanced whatever top_k picks
    assert float(load_balancing_loss(uniform, 2)) == pytest.approx(2.0)
    collapsed = jnp.zeros((1, 1, 4, 8)).at[..., 0].set(10.0)  # one expert takes (almost) all
    assert float(load_balancing_loss(collapsed, 1)) > 7.0


# ----------------------------------------------------------------------------- expert parallelism

SHARDED_CFG = ModelConfig(
    family="qwen3_moe",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    mlp_only_layers=(0,),
)


@pytest.fixture(scope="module")
def unsharded():
    params = random_params(SHARDED_CFG, jax.random.key(7))
    tokens = jnp.asarray(random_tokens(8, (4, 16), SHARDED_CFG.vocab_size))  # 4 rows: no dim but E is 8
    return params, tokens, jax.jit(forward, static_argnums=0)(SHARDED_CFG, params, tokens)


@pytest.mark.parametrize("axes", [dict(expert=8), dict(data=2, expert=4), dict(fsdp=2, tensor=2, expert=2)])
def test_expert_sharded_forward_matches_unsharded(unsharded, axes):
    params, tokens, ref = unsharded
    sharding = Sharding(make_mesh(**({"fsdp": 1} | axes)))
    sharded = shard_params(sharding, params)
    experts = sharded["layers"][1]["experts_gate"]
    assert experts.sharding.spec[0] == "expert"
    assert {s.data.shape[0] for s in experts.addressable_shards} == {8 // axes["expert"]}
    fwd = jax.jit(forward, static_argnums=0, static_argnames=("sharding",))
    placed = jax.device_put(tokens, sharding.named(("batch", "seq"), tokens.shape))
    assert rel_max_err(fwd(SHARDED_CFG, sharded, placed, sharding=sharding), ref) < SHARDED_TOL
    # The experts stay split: no device gathers another device's expert weights ([8, ., .]).
    hlo = fwd.lower(SHARDED_CFG, sharded, placed, sharding=sharding).compile().as_text()
    gathered = [line for line in hlo.splitlines() if "all-gather(" in line and "f32[8," in line.split("=")[1][:12]]
    assert not gathered, gathered[:2]


def test_expert_sharded_extend_matches_unsharded(unsharded):
    params, tokens, _ = unsharded
    cache = init_cache(SHARDED_CFG, 4, 16)
    cache_len = jnp.zeros((4,), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (4, 6))
    step = jax.jit(extend, static_argnums=0, static_argnames=("sharding",))
    ref_logits, _, _ = step(SHARDED_CFG, params, cache, tokens[:, :6], positions, cache_len)
    sharding = Sharding(make_mesh(data=2, fsdp=1, expert=4))
    logits, _, _ = step(
        SHARDED_CFG, shard_params(sharding, params), cache, tokens[:, :6], positions, cache_len, sharding=sharding
    )
    assert rel_max_err(logits, ref_logits) < SHARDED_TOL


# ----------------------------------------------------------------------------- training


def _dense_moe_reference(layer, x, top_k, norm_topk_prob):
    """Every expert on every token, weighted by a [N, E] gate matrix that is zero off the top-k."""
    flat = x.reshape(-1, x.shape[-1])
    _, weights, experts = route(flat, layer["router"], top_k, norm_topk_prob)
    gates = (
        jnp.zeros((flat.shape[0], layer["router"].shape[1]))
        .at[jnp.arange(flat.shape[0])[:, None], experts]
        .set(weights)
    )
    hidden = jax.nn.silu(jnp.einsum("nh,ehi->eni", flat, layer["experts_gate"])) * jnp.einsum(
        "nh,ehi->eni", flat, layer["experts_up"]
    )
    out = jnp.einsum("eni,eih,ne->nh", hidden, layer["experts_down"], gates)
    return out.reshape(x.shape)


@pytest.mark.parametrize("impl", ["ragged_dot", pytest.param("triton-interpret", marks=needs_triton)])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_moe_mlp_gradients_match_a_dense_reference(norm_topk_prob, impl):
    """Gradients through the sorted grouped-matmul path (experts and router) equal those of
    computing every expert on every token and masking, with ragged_dot and with the kernel."""
    layer = random_params(SHARDED_CFG, jax.random.key(9))["layers"][1]
    layer = {k: layer[k] for k in ("router", "experts_gate", "experts_up", "experts_down")}
    x = jax.random.normal(jax.random.key(10), (3, 5, SHARDED_CFG.hidden_size))
    probe = jax.random.normal(jax.random.key(11), x.shape)

    def loss(fn, params, x):
        return jnp.sum(fn(params, x) * probe)

    ours = jax.grad(loss, argnums=(1, 2))(lambda p, x: moe_mlp(p, x, 3, norm_topk_prob, impl)[0], layer, x)
    ref = jax.grad(loss, argnums=(1, 2))(lambda p, x: _dense_moe_reference(p, x, 3, norm_topk_prob), layer, x)
    for name in layer:
        assert float(jnp.max(jnp.abs(ref[0][name]))) > 0, name
        assert rel_max_err(ours[0][name], ref[0][name]) < FP32_TOL, name
    assert rel_max_err(ours[1], ref[1]) < FP32_TOL


def test_load_balancing_loss_trains_the_router():
    params = random_params(SHARDED_CFG, jax.random.key(12))
    tokens = jnp.asarray(random_tokens(13, (2, 8), SHARDED_CFG.vocab_size))

    def aux(params):
        _, _, router = forward_router(SHARDED_CFG, params, tokens)
        return load_balancing_loss(router, SHARDED_CFG.num_experts_per_tok)

    grads = jax.jit(jax.grad(aux))(params)
    assert float(jnp.max(jnp.abs(grads["layers"][1]["router"]))) > 0
    assert float(jnp.max(jnp.abs(grads["layers"][1]["experts_gate"]))) == 0  # the loss sees only the router
