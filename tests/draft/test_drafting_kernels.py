"""`draft_extend` through the decoder layer's kernels gives the logits, layer outputs and caches of
the head's own pieces: the attention prologue before the attention kernel (the head's q, k and v
fused, as rollouts read them), the residual norms (the MLP's norm after attention, the final norm;
the input norms stay XLA's, one fusion with their concatenation) and the weight projections (q/k/v,
o, the MLP, the LM head), for a prefill then a tree-masked step over a dense cache and a paged one.
The kernels run in Triton's interpreter (float32); the traced program must call each of them, so
that a comparison of the reference with itself cannot pass for one of the kernels."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.draft import draft_extend, init_draft_cache
from jaxspec.models import ModelConfig
from jaxspec.models.paged import init_paged_cache
from jaxspec.models.params import fuse_qkv
from tests.draft.conftest import random_head
from tests.kernels.fake_jax_triton import kernels_in
from tests.models.hf_reference import random_params

pytest.importorskip("triton", reason="the kernels run in Triton's interpreter (the test extra has triton)")
pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")

# head dim 16: the smallest the attention kernel takes
CFG = ModelConfig(
    family="qwen3",
    vocab_size=61,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)
ROWS, PAGE, PAGES_PER_ROW = 3, 4, 4
KERNELS = {"_attention_prologue", "_paged_attention", "_merge_partials", "_residual_norm", "_thin_matmul"}


def cache(dcfg, paged: bool):
    if not paged:
        return init_draft_cache(dcfg, ROWS, PAGE * PAGES_PER_ROW)
    table = np.random.default_rng(0).permutation(ROWS * PAGES_PER_ROW + 1)[: ROWS * PAGES_PER_ROW]
    table = jnp.asarray(table.reshape(ROWS, PAGES_PER_ROW), jnp.int32)
    return init_paged_cache(1, dcfg.num_kv_heads, dcfg.head_dim, ROWS * PAGES_PER_ROW + 1, PAGE, table)


def prefill_then_tree(dcfg, dparams, embed, cache):
    """Entries 0..5 of each row, then two siblings and a child of the first (rows' lengths 6, 4, 2),
    only each row's last node's outputs: both calls' logits and outputs, and the cache."""
    keys = jax.random.split(jax.random.key(1), 3)
    tokens = jax.random.randint(keys[0], (ROWS, 9), 0, CFG.vocab_size)
    hidden = jax.random.normal(keys[1], (ROWS, 9, dcfg.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (ROWS, 6))
    first = draft_extend(
        dcfg, dparams, embed, cache, tokens[:, :6], hidden[:, :6], positions, jnp.zeros((ROWS,), jnp.int32)
    )
    lens = jnp.asarray([6, 4, 2], jnp.int32)
    tree = jnp.broadcast_to(jnp.asarray([[1, 0, 0], [0, 1, 0], [1, 0, 1]], bool), (ROWS, 3, 3))
    positions = lens[:, None] + jnp.asarray([0, 0, 1], jnp.int32)
    last = jnp.asarray([2, 1, 2], jnp.int32)
    second = draft_extend(
        dcfg, dparams, embed, first[2], tokens[:, 6:], hidden[:, 6:], positions, lens, tree_mask=tree, last=last
    )
    return first[:2], second


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_drafting_through_the_kernels_equals_the_heads_pieces(monkeypatch, paged):
    dcfg, dparams = random_head(CFG, seed=4)
    dparams = fuse_qkv(dparams)
    embed = random_params(CFG, jax.random.key(3))["embed"]

    def traced():
        """A new function (JAX caches a trace per function; the variables are read when traced, and
        `jax.clear_caches` can crash the process), jitted, and the kernels its program calls."""
        run = jax.jit(functools.partial(prefill_then_tree, dcfg, dparams, embed))
        return run, kernels_in(str(run.trace(cache(dcfg, paged)).jaxpr))

    run, called = traced()
    assert not called  # the default: XLA's pieces
    want = run(cache(dcfg, paged))
    monkeypatch.setenv("JAXSPEC_PAGED_ATTENTION" if paged else "JAXSPEC_CACHE_ATTENTION", "triton-interpret")
    monkeypatch.setenv("JAXSPEC_ATTENTION_PROLOGUE", "triton")
    monkeypatch.setenv("JAXSPEC_ATTENTION_MERGE", "triton")
    monkeypatch.setenv("JAXSPEC_RESIDUAL_NORM", "triton-interpret")
    monkeypatch.setenv("JAXSPEC_THIN_MATMUL", "triton-interpret")
    run, called = traced()
    assert called == KERNELS
    got = run(cache(dcfg, paged))  # the program just traced
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
