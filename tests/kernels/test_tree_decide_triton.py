"""The per-row decision kernel (in Triton's interpreter) equals the jnp path it replaces: `combine_blocks`
then `verify_from_stats`, on the node-statistics kernel's partials, with several vocabulary splits
and trees whose node count is not a power of 2; compiled for sm90, it is a valid GPU program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import tree_decide_triton
from jaxspec.kernels.tree_decide_triton import decide_triton
from jaxspec.kernels.tree_verify_reference import combine_blocks, verification_noise, verify_from_stats
from jaxspec.kernels.tree_verify_triton import node_stats_triton, split_partials_triton
from tests.kernels.trees import random_parents_and_tokens
from tests.kernels.triton_compile import compile_for_hopper

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
        peak, total, candidates, best, best_tile = split_partials_triton(
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
        sample = node_stats_triton(
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
        got = decide_triton(
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


@pytest.mark.parametrize("nodes", [2, 3, 5, 16, 17])  # chains of 1, 2 and 4 drafts, trees of 16 and 32 lanes
@pytest.mark.parametrize("vocab,splits,dtype", [(512, 1, jnp.float32), (151936, 75, jnp.bfloat16)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_decide_kernel_compiles_for_hopper(nodes, vocab, splits, dtype, temperature):
    """The decision kernel at the rollout's shapes."""
    f32, i32 = jnp.float32, jnp.int32
    constants = tree_decide_triton.decide_constants(jax.ShapeDtypeStruct((4, nodes, vocab), dtype), splits, temperature)
    pointers = [f32, f32, f32, i32, dtype, i32, i32, i32, f32, i32, i32, i32, f32]
    compiled = compile_for_hopper(tree_decide_triton.tree_verify_decide, pointers, constants, num_stages=1)
    assert compiled.metadata.shared <= 227 * 1024
