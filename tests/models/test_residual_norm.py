"""`extend` through the residual-norm kernel gives the logits, hidden states and caches of the
model's own pieces: a prefill and a tree-masked verification step after it, a family with q/k norms
and one with q/k/v biases, the hidden states an EAGLE-3 head reads (the last layer's too). The
kernel runs in Triton's interpreter (float32); each case also counts the kernel's calls in the
traced program (one per norm: two per layer and the final one), so that a comparison of the
reference with itself cannot pass for one of the kernel."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import command_buffers
from jaxspec.models import ModelConfig, extend, init_cache
from jaxspec.models.residual_norm import ACTIVATION_AXES, residual_norm, residual_norm_reference
from jaxspec.models.sharding import DEFAULT_RULES, KV_CACHE_AXES, Sharding, make_mesh, shard_params
from tests.kernels import fake_jax_triton
from tests.models.hf_reference import random_params

pytest.importorskip("triton", reason="the kernel runs in Triton's interpreter (the test extra has triton)")
pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")

FAMILIES = {"qwen3": dict(family="qwen3"), "qwen2": dict(family="qwen2", attention_bias=True)}
ROWS, LAYERS = 3, 3
HIDDEN = (0, 2)  # a first and the last layer's output


def config(name: str) -> ModelConfig:
    return ModelConfig(
        **FAMILIES[name],
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_layers=LAYERS,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )


def prefill_then_verify(cfg, params, cache):
    """A 6-token prefill, then 3 tree-masked nodes per row: logits and hidden states of both, and the final cache."""
    tokens = jax.random.randint(jax.random.key(1), (ROWS, 9), 0, cfg.vocab_size)
    lens = jnp.asarray([6, 4, 2], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (ROWS, 6))
    first = extend(cfg, params, cache, tokens[:, :6], positions, jnp.zeros((ROWS,), jnp.int32), hidden_layers=HIDDEN)
    tree = jnp.broadcast_to(jnp.asarray([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool), (ROWS, 3, 3))
    positions = lens[:, None] + jnp.asarray([0, 1, 1], jnp.int32)
    second = extend(cfg, params, first[2], tokens[:, 6:], positions, lens, tree_mask=tree, hidden_layers=HIDDEN)
    return first[:2], second


def kernel_calls(run, *args) -> int:
    return fake_jax_triton.kernel_calls(run, *args, wrapper="residual_norm")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_kernel_gives_the_models_logits_hidden_states_and_caches(monkeypatch, family):
    cfg = config(family)
    params = random_params(cfg, jax.random.key(0))
    cache = init_cache(cfg, ROWS, 16)
    run = functools.partial(prefill_then_verify, cfg)

    assert kernel_calls(run, params, cache) == 0  # the default: XLA's pieces
    want = jax.jit(run)(params, cache)
    monkeypatch.setenv("JAXSPEC_RESIDUAL_NORM", "triton-interpret")
    assert kernel_calls(run, params, cache) == 2 * (2 * LAYERS + 1)  # two extends
    got = jax.jit(run)(params, cache)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
    jax.clear_caches()


def test_on_a_mesh_each_device_runs_the_kernel_on_its_rows(monkeypatch):
    """The rows split over data x fsdp, replicated over tensor: the kernel per device (shard_map),
    its sums and norms those of the whole rows; the residual stream keeps its layout."""
    monkeypatch.setenv("JAXSPEC_RESIDUAL_NORM", "triton-interpret")
    sharding = Sharding(make_mesh(data=2, fsdp=2, tensor=2, devices=jax.devices()[:8]))
    x, delta = jax.random.normal(jax.random.key(0), (2, 4, 6, 32))
    layout = sharding.named(ACTIVATION_AXES, x.shape)
    assert layout.spec[0] == ("data", "fsdp")  # the rows really split
    x, delta = jax.device_put(x, layout), jax.device_put(delta, layout)
    weight = 1 + 0.3 * jax.random.normal(jax.random.key(1), (32,))
    for d in (delta, None):
        run = functools.partial(residual_norm, eps=1e-6, sharding=sharding)
        assert kernel_calls(run, x, d, weight) == 1
        got, want = jax.jit(run)(x, d, weight), residual_norm_reference(x, d, weight, 1e-6)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
        assert got[0].sharding.spec == layout.spec
    jax.clear_caches()


def test_a_sharded_extend_through_the_kernel_equals_xlas_pieces(monkeypatch):
    """Params and cache on a data x fsdp x tensor mesh: every norm of `extend` runs the kernel on
    each device's rows and gives the logits, hidden states and cache of XLA's pieces."""
    cfg = config("qwen3")
    sharding = Sharding(make_mesh(2, 2, 2))
    params = shard_params(sharding, random_params(cfg, jax.random.key(0)))
    cache = init_cache(cfg, 4, 16)
    cache = jax.device_put(cache, sharding.named(KV_CACHE_AXES, cache.k[0].shape))
    tokens = jax.random.randint(jax.random.key(1), (4, 5), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (4, 5))

    def run(params, cache):
        lens = jnp.zeros((4,), jnp.int32)
        return extend(cfg, params, cache, tokens, positions, lens, hidden_layers=HIDDEN, sharding=sharding)

    want = jax.jit(run)(params, cache)
    monkeypatch.setenv("JAXSPEC_RESIDUAL_NORM", "triton-interpret")
    assert kernel_calls(run, params, cache) == 2 * LAYERS + 1
    got = jax.jit(run)(params, cache)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
    jax.clear_caches()


def test_split_channels_and_a_weight_of_another_dtype_run_the_reference(monkeypatch):
    """A mesh that splits a row's channels (the norm needs all of them), or a weight the kernel does
    not read with x: XLA's pieces."""
    monkeypatch.setenv("JAXSPEC_RESIDUAL_NORM", "triton-interpret")
    x = jax.random.normal(jax.random.key(0), (4, 2, 32))
    weight = jnp.ones((32,))
    rules = (*dict(DEFAULT_RULES).items(),)
    split = Sharding(make_mesh(data=1, fsdp=1, tensor=2, devices=jax.devices()[:2]))
    split = dataclasses.replace(split, rules=tuple((k, ("tensor",) if k == "act_embed" else v) for k, v in rules))
    assert kernel_calls(functools.partial(residual_norm, eps=1e-6, sharding=split), x, x, weight) == 0
    assert kernel_calls(functools.partial(residual_norm, eps=1e-6), x, x, weight.astype(jnp.bfloat16)) == 0
    assert kernel_calls(functools.partial(residual_norm, eps=1e-6), x, x, weight) == 1  # the control
    jax.clear_caches()


def test_an_unknown_impl_is_named(monkeypatch):
    monkeypatch.setenv("JAXSPEC_RESIDUAL_NORM", "cuda")
    with pytest.raises(ValueError, match="JAXSPEC_RESIDUAL_NORM must be one of"):
        residual_norm(jnp.ones((2, 8)), None, jnp.ones((8,)), 1e-6)


def test_auto_runs_the_kernel_off_a_mesh_where_the_kernels_run_in_command_buffers(monkeypatch):
    """The default: the kernel (here jax-triton's stand-in running it in the interpreter) where the
    Triton kernels run inside XLA's command buffers, not on a mesh, not where they do not (the CPU)."""
    fake_jax_triton.install(monkeypatch)
    x = jax.random.normal(jax.random.key(0), (8, 1, 32))
    weight = jnp.ones((32,))
    run = functools.partial(residual_norm, eps=1e-6)
    assert kernel_calls(run, x, x, weight) == 0
    monkeypatch.setattr(command_buffers, "in_graphs", lambda: True)
    assert kernel_calls(run, x, x, weight) == 1
    mesh = Sharding(make_mesh(data=2, fsdp=1, tensor=1, devices=jax.devices()[:2]))
    assert kernel_calls(functools.partial(run, sharding=mesh), x, x, weight) == 0
    monkeypatch.setenv("JAXSPEC_RESIDUAL_NORM", "xla")
    assert kernel_calls(run, x, x, weight) == 0
    jax.clear_caches()
