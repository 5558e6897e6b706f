"""`extend` through the residual-norm kernel gives the logits, hidden states and caches of the
model's own pieces: a prefill and a tree-masked verification step after it, a family with q/k norms
and one with q/k/v biases, the hidden states an EAGLE-3 head reads (the last layer's too). The
kernel runs in Triton's interpreter (float32); each case also counts the kernel's calls in the
traced program (one per norm: two per layer and the final one), so that a comparison of the
reference with itself cannot pass for one of the kernel."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import ModelConfig, extend, init_cache
from jaxspec.models.residual_norm import residual_norm
from jaxspec.models.sharding import Sharding, make_mesh
from tests.kernels.fake_jax_triton import kernels_in
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
    """How many times `run(*args)` calls the kernel (its jitted wrapper's call sites, once the
    kernel is in the program: a jaxpr prints a jitted function's body once)."""
    jax.clear_caches()  # traced afresh under the variables set now
    jaxpr = str(jax.make_jaxpr(run)(*args))
    return len(re.findall(r"name=residual_norm\b", jaxpr)) if "_residual_norm" in kernels_in(jaxpr) else 0


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


def test_on_a_mesh_and_for_a_weight_of_another_dtype_the_reference_runs(monkeypatch):
    """The kernel's call does not follow a mesh's layout, and reads one dtype."""
    monkeypatch.setenv("JAXSPEC_RESIDUAL_NORM", "triton-interpret")
    x = jax.random.normal(jax.random.key(0), (4, 2, 32))
    weight = jnp.ones((32,))
    sharding = Sharding(make_mesh(data=2, fsdp=1, tensor=1, devices=jax.devices()[:2]))
    on_mesh = functools.partial(residual_norm, eps=1e-6, sharding=sharding)
    assert kernel_calls(on_mesh, x, x, weight) == 0
    assert kernel_calls(functools.partial(residual_norm, eps=1e-6), x, x, weight.astype(jnp.bfloat16)) == 0
    assert kernel_calls(functools.partial(residual_norm, eps=1e-6), x, x, weight) == 1  # the control
    jax.clear_caches()


def test_an_unknown_impl_is_named(monkeypatch):
    monkeypatch.setenv("JAXSPEC_RESIDUAL_NORM", "cuda")
    with pytest.raises(ValueError, match="JAXSPEC_RESIDUAL_NORM must be one of"):
        residual_norm(jnp.ones((2, 8)), None, jnp.ones((8,)), 1e-6)
