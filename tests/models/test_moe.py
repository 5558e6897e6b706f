"""The mixture-of-experts layer (`jaxspec.models.moe`): the load-balancing loss, expert-sharded forwards
and extends on 8 virtual CPU devices, gradients against a dense reference, and the grouped-matmul
implementations (ragged_dot, the kernels) with the choice between them."""

import importlib.util
import logging
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import ModelConfig, Sharding, extend, forward, init_cache, make_mesh, shard_params
from jaxspec.models.moe import grouped_matmul, load_balancing_loss, moe_mlp, route
from jaxspec.models.transformer import forward_router
from tests.kernels.fake_jax_triton import install as fake_jax_triton
from tests.kernels.fake_jax_triton import kernels_in
from tests.models.hf_reference import random_params, random_tokens, rel_max_err

KERNELS = {"_grouped_matmul", "_grouped_transposed_matmul"}
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


# ----------------------------------------------------------------------------- grouped-matmul implementations


def _sparse_layer(key):
    layer = random_params(SHARDED_CFG, key)["layers"][1]
    return {k: layer[k] for k in ("router", "experts_gate", "experts_up", "experts_down")}


@needs_triton
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_moe_mlp_with_the_kernel_equals_ragged_dot(dtype):
    layer = jax.tree.map(lambda a: a.astype(dtype), _sparse_layer(jax.random.key(14)))
    x = jax.random.normal(jax.random.key(15), (3, 7, SHARDED_CFG.hidden_size)).astype(dtype)
    want, want_router, want_experts = moe_mlp(layer, x, 2, True, "ragged_dot")
    got, router, experts = moe_mlp(layer, x, 2, True, "triton-interpret")
    np.testing.assert_array_equal(experts, want_experts)
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(router, want_router)
    assert rel_max_err(got, want) < (FP32_TOL if dtype == jnp.float32 else 2.0**-7)


@needs_triton
def test_grouped_matmul_gradients_through_the_kernels_equal_ragged_dots():
    """dX and dW of the kernel path (empty groups, rows past the last group) equal ragged_dot's."""
    ks = jax.random.split(jax.random.key(18), 3)
    x, w = jax.random.normal(ks[0], (40, 24)), jax.random.normal(ks[1], (6, 24, 20))
    probe = jax.random.normal(ks[2], (40, 20))
    sizes = jnp.asarray([7, 0, 12, 9, 0, 8], jnp.int32)  # 36 of 40 rows

    def grads(impl):
        return jax.grad(lambda x, w: jnp.sum(grouped_matmul(x, w, sizes, impl) * probe), argnums=(0, 1))(x, w)

    (dx, dw), (want_dx, want_dw) = grads("triton-interpret"), grads("ragged_dot")
    assert rel_max_err(dx, want_dx) < FP32_TOL and rel_max_err(dw, want_dw) < FP32_TOL
    np.testing.assert_array_equal(dx[36:], 0.0)
    np.testing.assert_array_equal(dw[jnp.asarray([1, 4])], 0.0)


@needs_triton
def test_forward_with_the_kernel_equals_ragged_dot_with_gradients():
    params = random_params(SHARDED_CFG, jax.random.key(19))
    tokens = jnp.asarray(random_tokens(20, (2, 6), SHARDED_CFG.vocab_size))
    probe = jax.random.normal(jax.random.key(21), (2, 6, SHARDED_CFG.vocab_size))

    def loss(params, impl):
        logits = forward(SHARDED_CFG, params, tokens, moe_impl=impl)
        return jnp.sum(logits * probe), logits

    step = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, want), want_grads = step(params, "ragged_dot")
    (_, got), grads = step(params, "triton-interpret")
    assert rel_max_err(got, want) < FP32_TOL
    for name in ("experts_gate", "experts_up", "experts_down", "router"):
        assert rel_max_err(grads["layers"][1][name], want_grads["layers"][1][name]) < FP32_TOL, name


@needs_triton
def test_extend_uses_the_kernel_only_where_asked(monkeypatch):
    """JAXSPEC_MOE_MATMUL picks extend's grouped matmuls (auto: ragged_dot on CPU) with equal
    logits; the training forward keeps ragged_dot whatever the variable says; a bad value is
    refused by name."""
    params = random_params(SHARDED_CFG, jax.random.key(16))
    tokens = jnp.asarray(random_tokens(17, (2, 5), SHARDED_CFG.vocab_size))
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    args = (SHARDED_CFG, params, init_cache(SHARDED_CFG, 2, 8), tokens, positions, jnp.zeros((2,), jnp.int32))

    def uses_kernel(fn, cfg, *a):  # a fresh function: make_jaxpr would reuse an earlier trace
        return kernels_in(str(jax.make_jaxpr(lambda *a: fn(cfg, *a))(*a))) == {"_grouped_matmul"}

    def logits():
        return jax.jit(lambda *a: extend(SHARDED_CFG, *a)[0])(*args[1:])

    monkeypatch.delenv("JAXSPEC_MOE_MATMUL", raising=False)
    assert not uses_kernel(extend, *args)
    want = logits()
    monkeypatch.setenv("JAXSPEC_MOE_MATMUL", "triton-interpret")
    assert uses_kernel(extend, *args) and not uses_kernel(forward, SHARDED_CFG, params, tokens)
    assert rel_max_err(logits(), want) < FP32_TOL
    monkeypatch.setenv("JAXSPEC_MOE_MATMUL", "pallas")
    with pytest.raises(ValueError, match="JAXSPEC_MOE_MATMUL"):
        logits()


@needs_triton
@pytest.mark.parametrize("axes", [dict(data=4, fsdp=2), dict(data=8)])
def test_the_kernel_runs_per_device_on_a_mesh_with_gradients(axes):
    """moe_mlp with the kernels on rows split over data x fsdp devices (experts whole on each)
    equals the one-device ragged_dot layer, outputs and gradients."""
    layer = _sparse_layer(jax.random.key(22))
    x = jax.random.normal(jax.random.key(23), (8, 3, SHARDED_CFG.hidden_size))
    probe = jax.random.normal(jax.random.key(24), x.shape)
    sharding = Sharding(make_mesh(**({"fsdp": 1} | axes)))
    placed = jax.device_put(x, sharding.named(("batch", "seq", "act_embed"), x.shape))

    def loss(layer, x, impl, sharding):
        out, router, _ = moe_mlp(layer, x, 2, True, impl, sharding)
        return jnp.sum(out * probe) + jnp.sum(router), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=(2, 3))
    (_, want), want_grads = step(layer, x, "ragged_dot", None)
    (_, got), grads = step(layer, placed, "triton-interpret", sharding)
    jaxpr = str(jax.make_jaxpr(lambda l, x: loss(l, x, "triton-interpret", sharding))(layer, placed))
    assert "shard_map" in jaxpr and kernels_in(jaxpr) == {"_grouped_matmul"}  # (a forward jaxpr)
    assert rel_max_err(got, want) < FP32_TOL
    for name in layer:
        assert rel_max_err(grads[0][name], want_grads[0][name]) < FP32_TOL, name
    assert rel_max_err(grads[1], want_grads[1]) < FP32_TOL


def test_a_mesh_that_splits_the_experts_keeps_ragged_dot():
    layer = _sparse_layer(jax.random.key(25))
    x = jax.random.normal(jax.random.key(26), (4, 3, SHARDED_CFG.hidden_size))
    sharding = Sharding(make_mesh(data=2, fsdp=1, expert=4))
    assert "pure_callback" not in str(jax.make_jaxpr(lambda l, x: moe_mlp(l, x, 2, True, "auto", sharding))(layer, x))
    with pytest.raises(
        ValueError, match=r"'triton-interpret' runs on whole experts, but the mesh splits them over \['expert'\]"
    ):
        moe_mlp(layer, x, 2, True, "triton-interpret", sharding)


@needs_triton
def test_auto_picks_the_kernel_on_gpus_where_the_experts_stay_whole(monkeypatch):
    """auto = the grouped-matmul kernels on a GPU (validated there: tests/gpu/test_moe.py) for
    calls of KERNEL_MIN_WORK experts x rows or more, ragged_dot for smaller ones, on other backends,
    for mismatched dtypes and on meshes that split the experts. jax_triton is stood in for by one
    that runs the kernels in Triton's interpreter (`tests.kernels.fake_jax_triton`)."""
    from jaxspec.models import moe

    monkeypatch.delenv("JAXSPEC_MOE_MATMUL", raising=False)
    assert moe.resolve_impl("auto", True) == "ragged_dot"  # this CPU
    monkeypatch.setattr(moe, "on_gpu", lambda: True)
    monkeypatch.setattr(moe, "_kernels_import", lambda: True)
    assert moe.resolve_impl("auto", True) == "triton"
    assert moe.resolve_impl("auto", True, work=moe.KERNEL_MIN_WORK) == "triton"
    assert moe.resolve_impl("auto", True, work=moe.KERNEL_MIN_WORK - 1) == "ragged_dot"  # a small decode step
    assert moe.resolve_impl("auto", False) == "ragged_dot"
    split = Sharding(make_mesh(data=2, fsdp=1, expert=4))
    assert moe.resolve_impl("auto", True, split) == "ragged_dot"
    assert moe.resolve_impl("ragged_dot", True) == "ragged_dot"
    layer = _sparse_layer(jax.random.key(27))
    fake_jax_triton(monkeypatch)

    def uses_kernel(tokens: int) -> bool:  # E=8, top-2: experts x rows = 16 x tokens
        x = jax.ShapeDtypeStruct((1, tokens, SHARDED_CFG.hidden_size), jnp.float32)
        return kernels_in(str(jax.make_jaxpr(lambda l, x: moe_mlp(l, x, 2, True, "auto"))(layer, x))) != set()

    assert uses_kernel(moe.KERNEL_MIN_WORK // 16) and not uses_kernel(moe.KERNEL_MIN_WORK // 16 - 1)


@pytest.fixture
def fresh_kernels_check():
    """`resolve_impl`'s cached check that the kernels and jax-triton import, forgotten before and after."""
    from jaxspec.models import moe

    moe._kernels_import.cache_clear()
    yield
    moe._kernels_import.cache_clear()


def test_auto_without_jax_triton_keeps_ragged_dot_and_says_so_once(monkeypatch, caplog, fresh_kernels_check):
    """On a GPU where jax_triton does not import, "auto" runs ragged_dot with one warning naming
    the extra to install."""
    from jaxspec.models import moe

    monkeypatch.delenv("JAXSPEC_MOE_MATMUL", raising=False)
    monkeypatch.setattr(moe, "on_gpu", lambda: True)
    monkeypatch.setitem(sys.modules, "jax_triton", None)  # import jax_triton raises ImportError
    with caplog.at_level(logging.WARNING, logger=moe.__name__):
        for _ in range(2):
            assert moe.resolve_impl("auto", True) == "ragged_dot"
    warnings = [r.getMessage() for r in caplog.records if r.name == moe.__name__]
    assert len(warnings) == 1 and "pip install 'jaxspec[triton]'" in warnings[0]


@needs_triton
def test_the_gpu_path_hands_jax_triton_the_kernels_arguments(monkeypatch):
    """moe_mlp with impl "triton" (jax_triton stood in for by one that runs the kernel it is given,
    with the arrays, outputs and constexprs it is given, in Triton's interpreter): outputs and
    gradients equal ragged_dot's."""
    fake_jax_triton(monkeypatch)
    layer = _sparse_layer(jax.random.key(28))
    x = jax.random.normal(jax.random.key(29), (2, 5, SHARDED_CFG.hidden_size))
    probe = jax.random.normal(jax.random.key(30), x.shape)

    def loss(layer, x, impl):
        out = moe_mlp(layer, x, 2, True, impl)[0]
        return jnp.sum(out * probe), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    (_, want), want_grads = step(layer, x, "ragged_dot")
    (_, got), grads = step(layer, x, "triton")
    assert rel_max_err(got, want) < FP32_TOL
    for name in layer:
        assert rel_max_err(grads[0][name], want_grads[0][name]) < FP32_TOL, name
    assert rel_max_err(grads[1], want_grads[1]) < FP32_TOL


# ----------------------------------------------------------------------------- the expert kernel of decode steps


def expert_kernel_calls(run, *args) -> int:
    from tests.kernels.fake_jax_triton import kernel_calls

    return kernel_calls(run, *args, wrapper="expert_matmul", kernel="_thin_matmul")


@needs_triton
@pytest.mark.parametrize("replay", [False, True])
def test_the_expert_kernel_equals_the_grouped_matmuls(replay):
    """moe_mlp's decode-sized path (two expert-kernel launches) gives the grouped matmuls' outputs,
    router logits and experts, routing its own top-k or replaying given experts."""
    layer = _sparse_layer(jax.random.key(31))
    x = jax.random.normal(jax.random.key(32), (3, 4, SHARDED_CFG.hidden_size))
    given = jax.random.randint(jax.random.key(33), (3, 4, 2), 0, 8) if replay else None
    given = None if given is None else given.at[..., 1].set((given[..., 0] + 1) % 8)  # two distinct experts
    want = moe_mlp(layer, x, 2, True, "ragged_dot", experts=given)
    got = moe_mlp(layer, x, 2, True, "ragged_dot", experts=given, matmul_impl="triton-interpret")
    assert expert_kernel_calls(lambda l, x: moe_mlp(l, x, 2, True, matmul_impl="triton-interpret"), layer, x) == 2
    assert rel_max_err(got[0], want[0]) < FP32_TOL
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])


@needs_triton
def test_extend_runs_the_expert_kernel_where_the_thin_matmul_is_chosen(monkeypatch):
    """JAXSPEC_THIN_MATMUL=triton-interpret: every sparse layer of extend's decode-sized calls runs
    two expert-kernel launches with the grouped matmuls' logits; a call of more than the kernel's
    MAX_ROWS tokens and the training forward keep the grouped matmuls; unset, none runs."""
    from jaxspec.kernels import thin_matmul_triton

    params = random_params(SHARDED_CFG, jax.random.key(34))
    tokens = jnp.asarray(random_tokens(35, (2, 5), SHARDED_CFG.vocab_size))
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    args = (params, init_cache(SHARDED_CFG, 2, 8), tokens, positions, jnp.zeros((2,), jnp.int32))

    def run(*a):
        return extend(SHARDED_CFG, *a)[0]

    monkeypatch.delenv("JAXSPEC_THIN_MATMUL", raising=False)
    want = jax.jit(run)(*args)
    assert expert_kernel_calls(run, *args) == 0
    monkeypatch.setenv("JAXSPEC_THIN_MATMUL", "triton-interpret")
    sparse_layers = SHARDED_CFG.num_layers - len(SHARDED_CFG.mlp_only_layers)
    assert expert_kernel_calls(run, *args) == 2 * sparse_layers
    assert rel_max_err(jax.jit(run)(*args), want) < FP32_TOL
    assert expert_kernel_calls(lambda p: forward(SHARDED_CFG, p, tokens), params) == 0
    monkeypatch.setattr(thin_matmul_triton, "MAX_ROWS", 9)  # 10 tokens: a prefill past the kernel's reach
    assert expert_kernel_calls(run, *args) == 0
    jax.clear_caches()


@needs_triton
def test_the_expert_kernel_runs_per_device_and_not_where_the_experts_are_split(monkeypatch):
    """On rows split over data x fsdp (experts whole on each device) the expert kernel runs per
    device with the one-device layer's outputs; a mesh that splits the experts keeps ragged_dot."""
    layer = _sparse_layer(jax.random.key(36))
    x = jax.random.normal(jax.random.key(37), (8, 1, SHARDED_CFG.hidden_size))
    want = moe_mlp(layer, x, 2, True)[0]
    sharding = Sharding(make_mesh(data=4, fsdp=2))
    placed = jax.device_put(x, sharding.named(("batch", "seq", "act_embed"), x.shape))

    def run(layer, x, sharding):
        return moe_mlp(layer, x, 2, True, "ragged_dot", sharding, matmul_impl="triton-interpret")[0]

    assert "shard_map" in str(jax.make_jaxpr(lambda l, x: run(l, x, sharding))(layer, placed))
    assert rel_max_err(jax.jit(run, static_argnums=2)(layer, placed, sharding), want) < FP32_TOL
    split = Sharding(make_mesh(data=2, fsdp=1, expert=4))
    assert expert_kernel_calls(lambda l, x: run(l, x, split), layer, x) == 0
