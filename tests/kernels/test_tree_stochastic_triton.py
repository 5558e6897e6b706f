"""The stochastic-draft kernel (in Triton's interpreter) returns the jnp reference's `verify_stochastic`
result from the same key: random trees and chains, padding, per-row node counts, ragged and whole
vocabulary tiles, -inf entries, bf16 and f32 logits; compiled for sm90, it is a valid GPU program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import tree_stochastic_triton, tree_verify
from jaxspec.kernels.tree_stochastic_triton import verify_stochastic_triton
from jaxspec.kernels.tree_verify_reference import verify_reference
from tests.kernels.trees import random_parents_and_tokens
from tests.kernels.triton_compile import compile_for_hopper

BATCH, NODES, TILE = 8, 9, 64
NUM_NODES = np.array([9, 9, 6, 4, 1, 2, 9, 7], np.int32)


def stochastic_forest(seed: int, vocab: int, chain: bool, dtype):
    """Random trees (or chains), per-row node counts NUM_NODES; logits and q in `dtype`; q a peaked
    random distribution (unnormalised) with ~20% zeros, each child's token drawn from its parent's
    q; logits with ~30% -inf entries (never on token 7) and raised at about half of the drafted
    tokens, so that paths of every length, rejections followed by acceptances and whole accepted
    chains all occur."""
    rng = np.random.default_rng(seed)
    parents, _ = random_parents_and_tokens(rng, BATCH, NODES, vocab)
    if chain:
        parents[:] = np.arange(-1, NODES - 1)
    q = rng.gamma(0.3, size=(BATCH, NODES, vocab)).astype(np.float32)
    q[rng.random(q.shape) < 0.2] = 0.0
    q[..., 7] += 1e-3
    tokens = np.zeros((BATCH, NODES), np.int32)
    for b in range(BATCH):
        for n in range(1, NODES):
            parent_q = q[b, parents[b, n]].astype(np.float64)
            tokens[b, n] = rng.choice(vocab, p=parent_q / parent_q.sum())
    logits = 2.0 * rng.standard_normal((BATCH, NODES, vocab)).astype(np.float32)
    logits[rng.random(logits.shape) < 0.3] = -np.inf
    logits[..., 7] = 1.0
    for b in range(BATCH):
        for n in range(1, NODES):
            if rng.random() < 0.5:
                logits[b, parents[b, n], tokens[b, n]] = 5.0 + 3.0 * rng.random()
    return (
        jnp.asarray(logits, dtype),
        jnp.asarray(q, dtype),
        jnp.asarray(parents),
        jnp.asarray(tokens),
        jnp.asarray(NUM_NODES),
    )


def assert_same(got, want):
    for name, w, g in zip(want._fields, want, got):
        if name == "logprobs":
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)


@pytest.mark.parametrize("temperature,dtype", [(1.0, jnp.float32), (0.7, jnp.bfloat16)], ids=["t1-f32", "t0.7-bf16"])
@pytest.mark.parametrize("vocab", [256, 300], ids=["whole_tiles", "ragged_tile"])
@pytest.mark.parametrize("chain", [False, True], ids=["tree", "chain"])
def test_kernel_equals_reference(chain, vocab, temperature, dtype):
    """Same key -> identical paths, counts, next tokens (log-probs up to rounding), over many keys."""
    logits, q, parents, tokens, num_nodes = stochastic_forest(vocab + chain, vocab, chain, dtype)
    first_child = np.array(
        [
            np.flatnonzero((np.asarray(parents[b]) == 0) & (np.arange(NODES) > 0) & (np.arange(NODES) < NUM_NODES[b]))[
                :1
            ].tolist()
            or [-1]
            for b in range(BATCH)
        ]
    )[:, 0]
    accepted, later_sibling = [], False
    for seed in range(8):
        key = jax.random.key(seed)
        want = verify_reference(logits, parents, tokens, num_nodes, key, temperature=temperature, draft_probs=q)
        got = verify_stochastic_triton(
            logits, q, parents, tokens, num_nodes, key, temperature=temperature, interpret=True, tile=TILE
        )
        assert_same(got, want)
        accepted.append(np.asarray(want.num_accepted))
        path1 = np.asarray(want.path)[:, 1]
        later_sibling |= bool(np.any((path1 >= 0) & (path1 != first_child)))
    accepted = np.stack(accepted)
    # the cases exercised: rejections at the root, deep paths, single-node rows (nothing to test),
    # and (in trees) a child accepted after its earlier sibling was rejected
    assert (accepted == 0).any() and accepted.max() >= 2 and np.all(accepted[:, 4] == 0)
    assert chain or later_sibling


def test_padding_values_are_ignored():
    """Nodes past num_nodes may hold any parent and token (out of the tree, out of the vocabulary):
    the result is the one with well-formed padding."""
    logits, q, parents, tokens, num_nodes = stochastic_forest(4, 300, False, jnp.float32)
    padding = np.arange(NODES)[None, :] >= NUM_NODES[:, None]
    junk_parents = jnp.where(padding, NODES + 3, parents)
    junk_tokens = jnp.where(padding, -5, tokens)
    for seed in range(3):
        key = jax.random.key(seed)
        clean = verify_stochastic_triton(
            logits, q, parents, tokens, num_nodes, key, temperature=1.0, interpret=True, tile=TILE
        )
        junk = verify_stochastic_triton(
            logits, q, junk_parents, junk_tokens, num_nodes, key, temperature=1.0, interpret=True, tile=TILE
        )
        assert_same(junk, clean)


def test_whole_chain_accepted_and_rejected_at_the_root():
    """q = p accepts every draft (u * q < p for u < 1); a draft with p = 0 is always rejected and
    the residual sample is then never that token. Both as the reference."""
    vocab, n = 200, 5
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, n, vocab)).astype(np.float32)
    tokens = np.array([[0, 11, 22, 33, 44], [0, 55, 66, 77, 88]], np.int32)
    logits[1, 0, 55] = -np.inf
    q = np.array(jax.nn.softmax(jnp.asarray(logits), axis=-1))
    q[1, 0, 55] = 0.5
    parents = np.tile(np.arange(-1, n - 1, dtype=np.int32), (2, 1))
    args = [jnp.asarray(x) for x in (logits, parents, tokens, np.full(2, n, np.int32))]
    for seed in range(4):
        key = jax.random.key(seed)
        got = tree_verify(*args, key, temperature=1.0, draft_probs=jnp.asarray(q), impl="triton-interpret")
        assert_same(got, verify_reference(*args, key, temperature=1.0, draft_probs=jnp.asarray(q)))
        np.testing.assert_array_equal(got.num_accepted, [n - 1, 0])
        assert got.next_token[1] != 55


def test_large_vocabulary_in_tiles():
    """A 151936-token vocabulary (Qwen's) in the default tile, a small batch: same result."""
    vocab = 151936
    rng = np.random.default_rng(5)
    parents = np.array([[-1, 0, 0, 1], [-1, 0, 1, 2]], np.int32)
    tokens = np.array([[0, 3, 9, 17], [0, 151935, 4, 8]], np.int32)
    logits = rng.standard_normal((2, 4, vocab)).astype(np.float32)
    q = rng.random((2, 4, vocab)).astype(np.float32) ** 8
    for b, n in ((0, 1), (0, 2), (0, 3), (1, 1), (1, 2)):
        logits[b, parents[b, n], tokens[b, n]] = 12.0
        q[b, parents[b, n], tokens[b, n]] = 2000.0
    args = [jnp.asarray(x) for x in (logits, parents, tokens, np.array([4, 4], np.int32))]
    for seed in range(2):
        key = jax.random.key(seed)
        want = verify_reference(*args, key, temperature=1.0, draft_probs=jnp.asarray(q))
        got = verify_stochastic_triton(args[0], jnp.asarray(q), *args[1:], key, temperature=1.0, interpret=True)
        assert_same(got, want)


def test_kernel_rejects_greedy():
    logits, q, parents, tokens, num_nodes = stochastic_forest(0, 64, False, jnp.float32)
    with pytest.raises(ValueError, match="temperature > 0"):
        verify_stochastic_triton(logits, q, parents, tokens, num_nodes, jax.random.key(0), temperature=0.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_kernel_compiles_for_hopper(dtype):
    """The kernel at the rollout's shapes (Qwen's vocabulary, logits and q in `dtype`)."""
    f32, i32 = jnp.float32, jnp.int32
    constants = tree_stochastic_triton.launch(jax.ShapeDtypeStruct((4, 7, 151936), dtype), 0.7)
    pointers = [dtype, dtype, f32, f32, i32, i32, i32, f32, i32, i32, i32, i32, f32]
    compiled = compile_for_hopper(tree_stochastic_triton.tree_verify_stochastic, pointers, constants, num_stages=2)
    assert compiled.metadata.shared <= 227 * 1024
