"""`extend` through the thin-matmul kernel gives the logits, hidden states and caches of XLA's GEMMs:
a prefill and a tree-masked verification step after it, for a family with q/k norms and its q/k/v
fused (as rollouts hold it), one with q/k/v biases and separate q and kv, and one whose LM head is
the tied embedding. The kernel runs in Triton's interpreter (float32); each case counts the kernel's
calls in the traced program (every projection of every layer and the LM head), so that a comparison
of XLA's GEMMs with themselves cannot pass for one of the kernel. Calls the kernel does not take (a
long prefill, a mesh, the training forward) keep XLA's GEMMs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import ModelConfig, extend, init_cache
from jaxspec.models.params import fuse_qkv
from jaxspec.models.projection import project, swiglu
from jaxspec.models.sharding import KV_CACHE_AXES, Sharding, make_mesh, shard_params
from jaxspec.models.transformer import forward_hidden
from tests.kernels import fake_jax_triton
from tests.models.hf_reference import random_params

pytest.importorskip("triton", reason="the kernel runs in Triton's interpreter (the test extra has triton)")
pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")

FAMILIES = {
    "qwen3-fused": dict(family="qwen3"),
    "qwen2-biases": dict(family="qwen2", attention_bias=True),
    "qwen3-tied": dict(family="qwen3", tie_word_embeddings=True),
}
ROWS, LAYERS = 3, 2
HIDDEN = (0, 1)


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
        max_position_embeddings=128,
    )


def params_of(name: str):
    params = random_params(config(name), jax.random.key(0))
    return params if name == "qwen2-biases" else fuse_qkv(params)


def prefill_then_verify(cfg, params, cache, prompt: int = 6):
    """A prefill of `prompt` tokens, then 3 tree-masked nodes per row: logits and hidden states of
    both, and the final cache."""
    tokens = jax.random.randint(jax.random.key(1), (ROWS, prompt + 3), 0, cfg.vocab_size)
    lens = jnp.asarray([prompt, prompt - 2, prompt - 4], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32), (ROWS, prompt))
    zeros = jnp.zeros((ROWS,), jnp.int32)
    first = extend(cfg, params, cache, tokens[:, :prompt], positions, zeros, hidden_layers=HIDDEN)
    tree = jnp.broadcast_to(jnp.asarray([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool), (ROWS, 3, 3))
    positions = lens[:, None] + jnp.asarray([0, 1, 1], jnp.int32)
    second = extend(cfg, params, first[2], tokens[:, prompt:], positions, lens, tree_mask=tree, hidden_layers=HIDDEN)
    return first[:2], second


def kernel_calls(run, *args) -> int:
    return fake_jax_triton.kernel_calls(run, *args, wrapper="thin_matmul")


def per_extend(name: str) -> int:
    """The kernel's calls in one extend: q/k/v (one GEMM fused, two apart), o, gate_up with its
    SwiGLU and down per layer, and the LM head."""
    return LAYERS * (3 + (2 if name == "qwen2-biases" else 1)) + 1


@pytest.mark.parametrize("name", FAMILIES)
def test_the_kernel_gives_the_models_logits_hidden_states_and_caches(monkeypatch, name):
    cfg, params = config(name), params_of(name)
    cache = init_cache(cfg, ROWS, 16)
    run = functools.partial(prefill_then_verify, cfg)

    assert kernel_calls(run, params, cache) == 0  # the default: XLA's GEMMs
    want = jax.jit(run)(params, cache)
    monkeypatch.setenv("JAXSPEC_THIN_MATMUL", "triton-interpret")
    assert kernel_calls(run, params, cache) == 2 * per_extend(name)  # two extends
    got = jax.jit(run)(params, cache)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
    jax.clear_caches()


def test_a_long_prefill_a_mesh_that_splits_weights_and_the_training_forward_keep_xlas_gemms(monkeypatch):
    """More than MAX_ROWS token rows (the prefill of 3 x 90 tokens; the verification after it still
    runs the kernel), a call on a mesh that splits the weights over fsdp and tensor, and the
    full-sequence forward that training differentiates (the kernel has no gradient)."""
    monkeypatch.setenv("JAXSPEC_THIN_MATMUL", "triton-interpret")
    cfg, params = config("qwen3-fused"), params_of("qwen3-fused")
    cache = init_cache(cfg, ROWS, 96)
    assert kernel_calls(functools.partial(prefill_then_verify, cfg, prompt=90), params, cache) == per_extend(
        "qwen3-fused"
    )

    sharding = Sharding(make_mesh(2, 2, 2))
    sharded = shard_params(sharding, random_params(cfg, jax.random.key(0)))
    cache = jax.device_put(init_cache(cfg, 4, 16), sharding.named(KV_CACHE_AXES, (4, 16, 2, 16)))
    tokens = jnp.zeros((4, 5), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (4, 5))

    def on_mesh(params, cache):
        return extend(cfg, params, cache, tokens, positions, jnp.zeros((4,), jnp.int32), sharding=sharding)

    assert kernel_calls(on_mesh, sharded, cache) == 0
    assert kernel_calls(lambda p: forward_hidden(cfg, p, tokens), params) == 0
    jax.clear_caches()


def test_project_takes_einsums_that_contract_the_first_operands_last_dims():
    x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
    np.testing.assert_array_equal(project("btc,cn->btn", x, w), jnp.einsum("btc,cn->btn", x, w))
    np.testing.assert_array_equal(project("btc,cn->btn", x, w.T, transpose=True), jnp.einsum("btc,cn->btn", x, w))
    with pytest.raises(ValueError, match="must contract the first operand's last dims"):
        project("bct,cn->btn", jnp.ones((2, 4, 3)), w)


def dot_lhs_shapes(fn, *args) -> list[tuple[int, ...]]:
    """The shapes of the first operand of every dot_general in fn's traced program."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [tuple(e.invars[0].aval.shape) for e in jaxpr.eqns if e.primitive.name == "dot_general"]


@pytest.mark.parametrize(
    "equation, x_shape, w_shape, transpose",
    [("btnd,ndh->bth", (1, 1, 3, 8), (3, 8, 5), False), ("bth,hv->btv", (1, 1, 24), (24, 5), True)],
)
def test_a_single_token_row_runs_as_a_two_row_gemm_with_the_einsums_values(equation, x_shape, w_shape, transpose):
    """One token row (a batch-1 decode step) is multiplied as two rows, the second zeros, so that
    XLA's GPU compiler keeps a GEMM instead of a product written to memory and a reduction
    (`projection._as_matrix_product`); the row's values are the einsum's, and a call of two rows
    gives it the same first row. The SwiGLU's gate and up the same."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
    stored = w.T if transpose else w

    def call(x):
        return project(equation, x, stored, transpose=transpose)

    np.testing.assert_allclose(call(x), jnp.einsum(equation, x, w), rtol=1e-6, atol=1e-6)
    assert [shape[0] for shape in dot_lhs_shapes(call, x)] == [2]
    rows = jnp.concatenate([x, x + 1])
    assert [shape[0] for shape in dot_lhs_shapes(call, rows)] == [2]
    np.testing.assert_allclose(call(rows)[:1], call(x), rtol=1e-6, atol=1e-6)

    h, gate_up = jax.random.normal(kx, (1, 1, 6)), jax.random.normal(kg, (6, 2, 4))
    both = jnp.einsum("...h,hcf->...cf", h, gate_up)
    want = jax.nn.silu(both[..., 0, :]) * both[..., 1, :]
    np.testing.assert_allclose(swiglu(h, gate_up), want, rtol=1e-6, atol=1e-6)
    assert [shape[0] for shape in dot_lhs_shapes(lambda h: swiglu(h, gate_up), h)] == [2]


@pytest.mark.parametrize("k, n, rows", [(2048, 4096, 2), (2048, 8192, 1), (4096, 4096, 1)])
def test_only_a_weight_xla_would_reduce_gets_the_second_row(k, n, rows):
    """Qwen3-1.7B's q/k/v (2048 x 4096, K x (1 + N) under 10^7) is padded to two rows; a weight
    XLA keeps as a GEMM anyway (its gate/up or Qwen3-8B's attention output) is not."""
    x, w = jax.ShapeDtypeStruct((1, 1, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    assert [shape[0] for shape in dot_lhs_shapes(functools.partial(project, "btc,cn->btn"), x, w)] == [rows]


@pytest.mark.parametrize("layout", ["data", "gathered-fsdp"])
def test_where_every_device_holds_the_weights_each_runs_the_kernel_on_its_rows(monkeypatch, layout):
    """A mesh that splits only the rows (data=2), or fsdp=2 with the weights gathered (a rollout's
    copy under rollout.gather_weights): every projection runs the kernel per device on its rows and
    gives XLA's logits, hidden states and cache."""
    cfg, params = config("qwen3-fused"), params_of("qwen3-fused")
    sizes = dict(data=2, fsdp=1) if layout == "data" else dict(data=1, fsdp=2)
    sharding = Sharding(make_mesh(**sizes, tensor=1, devices=jax.devices()[:2]), gathered_weights=layout != "data")
    params = jax.device_put(params, sharding.named((), ()))
    cache = init_cache(cfg, 4, 16)
    cache = jax.device_put(cache, sharding.named(KV_CACHE_AXES, cache.k[0].shape))
    tokens = jax.random.randint(jax.random.key(1), (4, 5), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (4, 5))

    def run(params, cache):
        lens = jnp.zeros((4,), jnp.int32)
        return extend(cfg, params, cache, tokens, positions, lens, hidden_layers=HIDDEN, sharding=sharding)

    want = jax.jit(run)(params, cache)
    monkeypatch.setenv("JAXSPEC_THIN_MATMUL", "triton-interpret")
    assert kernel_calls(run, params, cache) == per_extend("qwen3-fused")
    got = jax.jit(run)(params, cache)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
    assert got[0].sharding.spec[0] == layout.split("-")[-1]  # the logits' rows stay split
    jax.clear_caches()
