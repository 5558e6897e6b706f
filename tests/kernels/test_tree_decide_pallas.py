"""The per-row decision kernel (interpret mode) equals the jnp path it replaces: `combine_blocks`
then `verify_from_stats`, on the node-statistics kernel's partials, with several vocabulary splits
and trees whose node count is not a power of 2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels.tree_decide_pallas import decide_pallas
from jaxspec.kernels.tree_verify_pallas import node_stats_pallas, split_partials_pallas
from jaxspec.kernels.tree_verify_reference import combine_blocks, verification_noise, verify_from_stats
from tests.kernels.trees import random_parents_and_tokens
from tests.kernels.triton_ir import verify_triton

BATCH, NODES, VOCAB, TILE = 5, 6, 200, 32


def _forest(seed: int):
    rng = np.random.default_rng(seed)
    parents, tokens = random_parents_and_tokens(rng, BATCH, NODES, VOCAB)
    logits = 1.5 * rng.standard_normal((BATCH, NODES, VOCAB)).astype(np.float32)
    for b in range(BATCH):  # some drafts are the likeliest tokens, so paths of every length occur
        for n in range(1, NODES):
            if rng.random() < 0.6:
                logits[b, parents[b, n], tokens[b, n]] = 6.0
    num_nodes = np.array([6, 6, 4, 1, 5], np.int32)
    return tuple(jnp.asarray(x) for x in (logits, parents, tokens, num_nodes))


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_decide_kernel_equals_the_jnp_decisions(temperature):
    logits, parents, tokens, num_nodes = _forest(0)
    for seed in range(5):
        noise = verification_noise(jax.random.key(seed), BATCH, NODES)
        peak, total, candidates, best, best_tile = split_partials_pallas(
            logits,
            parents,
            tokens,
            num_nodes,
            noise,
            temperature,
            interpret=True,
            tile=TILE,
            programs=4 * BATCH * NODES,
        )
        assert best.shape[-1] >= 3
        sample = node_stats_pallas(
            logits,
            parents,
            tokens,
            num_nodes,
            noise,
            temperature,
            interpret=True,
            tile=TILE,
            programs=4 * BATCH * NODES,
        ).sample
        stats = combine_blocks(peak, total, candidates, best, lambda winner: sample, temperature)
        want = verify_from_stats(stats, logits, parents, tokens, num_nodes, noise.uniforms, temperature)
        got = decide_pallas(
            peak,
            total,
            candidates,
            sample,
            logits,
            parents,
            tokens,
            num_nodes,
            noise.uniforms,
            temperature,
            interpret=True,
        )
        for name, w, g in zip(want._fields, want, got):
            assert g.shape == w.shape, name
            if name == "logprobs":
                np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
            else:
                np.testing.assert_array_equal(g, w, err_msg=name)
    assert int(jnp.max(want.num_accepted)) >= 2


@pytest.mark.parametrize("nodes", [2, 3, 4, 5, 6, 7, 8, 16])  # chains of 1..7 drafts, trees up to 16 nodes
@pytest.mark.parametrize("vocab,splits", [(512, 1), (151936, 1), (151936, 75)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_gpu_kernel_is_a_valid_triton_module(nodes, vocab, splits, temperature):
    """The decision kernel as a GPU compiles it, at the rollout's shapes."""
    batch = 4
    f32, i32 = jnp.float32, jnp.int32
    partial = jax.ShapeDtypeStruct((batch, nodes, splits), f32)
    per_node = lambda dtype: jax.ShapeDtypeStruct((batch, nodes), dtype)  # noqa: E731
    decide = lambda *args: decide_pallas(*args, temperature)  # noqa: E731
    assert (
        verify_triton(
            decide,
            partial,
            partial,
            partial,
            per_node(i32),
            jax.ShapeDtypeStruct((batch, nodes, vocab), f32),
            per_node(i32),
            per_node(i32),
            jax.ShapeDtypeStruct((batch,), i32),
            per_node(f32),
        )
        == 1
    )
