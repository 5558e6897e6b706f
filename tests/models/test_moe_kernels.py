"""The implementations of a sparse layer's experts (`jaxspec.models.moe`): the grouped matmuls
(ragged_dot, the grouped-matmul kernels) and the choice between them, and the thin matmul's expert
form that decode-sized calls of `extend` run, on one device and on meshes of 8 virtual CPU devices."""

import logging
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import Sharding, extend, forward, init_cache, make_mesh
from jaxspec.models.moe import grouped_matmul, moe_mlp
from tests.kernels.fake_jax_triton import install as fake_jax_triton
from tests.kernels.fake_jax_triton import kernel_calls, kernels_in
from tests.models.hf_reference import random_params, random_tokens, rel_max_err
from tests.models.test_moe import FP32_TOL, SHARDED_CFG, needs_triton

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
