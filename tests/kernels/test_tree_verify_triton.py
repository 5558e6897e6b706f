"""The Triton kernels (in Triton's interpreter) compute the reference's node reductions and, from
the same key, the same verification results: random trees, -inf masks, padding,
all-accepted/all-rejected; compiled for sm90, they are valid GPU programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import tree_verify, tree_verify_triton
from jaxspec.kernels.tree_race import RACE_TILE, race_tile
from jaxspec.kernels.tree_verify_reference import node_stats_reference, verification_noise, verify_reference
from jaxspec.kernels.tree_verify_triton import node_stats_triton, verify_triton
from tests.kernels.trees import random_parents_and_tokens
from tests.kernels.triton_compile import compile_for_hopper

BATCH, NODES, VOCAB = 6, 8, 300
TILE = 64  # several tiles and vocabulary splits per node, with a ragged last tile


def random_forest(seed: int):
    """Random trees (each node's parent below it), random tokens, num_nodes 8, 8, 5, 3, 1, 2; logits
    with ~30% -inf entries, and one node whose children are its top tokens (likely accepted)."""
    rng = np.random.default_rng(seed)
    parents, tokens = random_parents_and_tokens(rng, BATCH, NODES, VOCAB)
    logits = 2.0 * rng.standard_normal((BATCH, NODES, VOCAB)).astype(np.float32)
    logits[rng.random(logits.shape) < 0.3] = -np.inf
    logits[:, :, 7] = 1.0  # keep every node's support non-empty
    # row 0: node 0's children are its most likely tokens and carry most of its mass
    kids = np.flatnonzero(parents[0] == 0)
    logits[0, 0, tokens[0, kids]] = 12.0
    num_nodes = np.array([8, 8, 5, 3, 1, 2], np.int32)
    return jnp.asarray(logits), jnp.asarray(parents), jnp.asarray(tokens), jnp.asarray(num_nodes)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_kernel_stats_equal_reference(temperature):
    logits, parents, tokens, num_nodes = random_forest(1)
    noise = verification_noise(jax.random.key(4), BATCH, NODES)
    want = node_stats_reference(logits, parents, tokens, num_nodes, noise, temperature, tile=TILE)
    got = node_stats_triton(logits, parents, tokens, num_nodes, noise, temperature, interpret=True, tile=TILE)
    np.testing.assert_allclose(got.lse, want.lse, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got.residual_mass, want.residual_mass, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(got.sample, want.sample)
    if temperature == 0:
        np.testing.assert_array_equal(got.sample, np.argmax(np.asarray(logits), axis=-1))
    else:
        # the residual sample is never a child of its node and never a -inf token
        p, t, s, n = (np.asarray(x) for x in (parents, tokens, got.sample, num_nodes))
        for b in range(BATCH):
            for node in range(n[b]):
                kids = [m for m in range(1, n[b]) if p[b, m] == node]
                assert s[b, node] not in t[b, kids]
                assert np.isfinite(np.asarray(logits)[b, node, s[b, node]])


@pytest.mark.parametrize("programs", [1, 2 * BATCH * NODES])
def test_vocabulary_splits_do_not_change_the_stats(programs):
    """One split per node (all 5 tiles in one program) or two uneven ones (3 + 2 tiles): the same
    normalisers up to summation order, the same samples."""
    logits, parents, tokens, num_nodes = random_forest(3)
    noise = verification_noise(jax.random.key(5), BATCH, NODES)
    want = node_stats_reference(logits, parents, tokens, num_nodes, noise, 1.0, tile=TILE)
    got = node_stats_triton(
        logits, parents, tokens, num_nodes, noise, 1.0, interpret=True, tile=TILE, programs=programs
    )
    np.testing.assert_allclose(got.lse, want.lse, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got.residual_mass, want.residual_mass, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(got.sample, want.sample)


@pytest.mark.parametrize("programs", [1, 2 * BATCH * NODES])
def test_node_without_residual_mass_samples_like_the_reference(programs):
    """Node 0 of row 0 puts all its mass on its children: no tile scores above -inf, and the
    kernel's (unused) sample is still the reference's, the race inside tile 0 (token 0)."""
    logits, parents, tokens, num_nodes = random_forest(6)
    kids = np.flatnonzero(np.asarray(parents)[0, :8] == 0)
    assert kids.size
    row = np.full(VOCAB, -np.inf, np.float32)
    row[np.asarray(tokens)[0, kids]] = 1.0
    logits = logits.at[0, 0].set(row)
    noise = verification_noise(jax.random.key(7), BATCH, NODES)
    want = node_stats_reference(logits, parents, tokens, num_nodes, noise, 1.0, tile=TILE)
    got = node_stats_triton(
        logits, parents, tokens, num_nodes, noise, 1.0, interpret=True, tile=TILE, programs=programs
    )
    assert want.residual_mass[0, 0] == 0.0 and got.residual_mass[0, 0] == 0.0 and want.sample[0, 0] == 0
    np.testing.assert_array_equal(got.sample, want.sample)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_kernel_verification_equals_reference(temperature):
    """Same key -> identical paths, counts, next tokens, log-probs, over many keys."""
    logits, parents, tokens, num_nodes = random_forest(2)
    accepted = []
    for seed in range(6):
        key = jax.random.key(seed)
        want = verify_reference(logits, parents, tokens, num_nodes, key, temperature=temperature, tile=TILE)
        got = verify_triton(logits, parents, tokens, num_nodes, key, temperature=temperature, interpret=True, tile=TILE)
        for name, w, g in zip(want._fields, want, got):
            if name == "logprobs":
                np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
            else:
                np.testing.assert_array_equal(g, w, err_msg=name)
        accepted.append(np.asarray(want.num_accepted))
    accepted = np.stack(accepted)
    # the cases exercised: rows that reject everything and rows that accept, single-node rows
    assert (accepted == 0).any() and (accepted[:, 0] > 0).any() and np.all(accepted[:, 4] == 0)


def test_kernel_all_accepted_and_all_rejected_chains():
    """A chain whose drafts are (near-)certain is fully accepted; one whose drafts have p = 0 is
    rejected at the root; both agree with the reference and emit a bonus/residual token."""
    vocab, n = 200, 5
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, n, vocab)).astype(np.float32)
    tokens = np.array([[0, 11, 22, 33, 44], [0, 55, 66, 77, 88]], np.int32)
    for node in range(n - 1):
        logits[0, node, tokens[0, node + 1]] = 40.0  # p ~ 1
        logits[1, node, tokens[1, node + 1]] = -np.inf  # p = 0
    parents = np.tile(np.arange(-1, n - 1, dtype=np.int32), (2, 1))
    args = [jnp.asarray(x) for x in (logits, parents, tokens, np.full(2, n, np.int32))]
    for impl in ("reference", "triton-interpret"):
        out = tree_verify(*args, jax.random.key(1), temperature=1.0, impl=impl)
        np.testing.assert_array_equal(out.num_accepted, [n - 1, 0])
        np.testing.assert_array_equal(out.path, [[0, 1, 2, 3, 4], [0, -1, -1, -1, -1]])
        assert out.next_token[1] != tokens[1, 1]
        lp = np.asarray(out.logprobs)
        np.testing.assert_allclose(lp[0, : n - 1], 0.0, atol=1e-5)  # log p ~ 0 for the certain drafts
        assert np.all(np.isfinite(lp[:, 0]))


def test_kernel_reads_bfloat16_logits():
    logits, parents, tokens, num_nodes = random_forest(3)
    low = logits.astype(jnp.bfloat16)
    noise = verification_noise(jax.random.key(0), BATCH, NODES)
    want = node_stats_reference(low.astype(jnp.float32), parents, tokens, num_nodes, noise, 1.0, tile=TILE)
    got = node_stats_triton(low, parents, tokens, num_nodes, noise, 1.0, interpret=True, tile=TILE)
    np.testing.assert_array_equal(got.sample, want.sample)
    np.testing.assert_allclose(got.lse, want.lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("vocab,dtype", [(512, jnp.float32), (151936, jnp.float32), (151936, jnp.bfloat16)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("batch", [1, 1024])  # many vocabulary splits per node / one (8192 programs)
def test_the_node_stats_kernel_compiles_for_hopper(vocab, dtype, temperature, batch):
    """The node-statistics kernel at the rollout's shapes (greedy verification reads the policy's
    logits, sampled verification float32 log-probs) and launch plans."""
    logits = jax.ShapeDtypeStruct((batch, 8, vocab), dtype)
    grid, constants = tree_verify_triton.launch(logits, temperature, tile=race_tile(vocab, RACE_TILE))
    assert (grid[2] > 1) == (batch * 8 < tree_verify_triton.TARGET_PROGRAMS and vocab > RACE_TILE)
    f32, i32 = jnp.float32, jnp.int32
    compiled = compile_for_hopper(
        tree_verify_triton.tree_verify_node_stats, [dtype, i32, i32, i32, f32, f32, f32, f32, i32], constants
    )
    assert compiled.metadata.shared <= 227 * 1024
