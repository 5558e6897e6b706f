"""Greedy (temperature 0) verification: accept a child iff it is the argmax, emit the argmax at
the last accepted node, report log_softmax(logits); exact cases on every implementation, ties
inside a vocabulary tile and across tiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import tree_verify
from jaxspec.kernels.tree_verify_reference import verify_reference
from jaxspec.kernels.tree_verify_triton import verify_triton
from jaxspec.rollout import Sampling, processed_logprobs
from tests.kernels.numpy_verify import greedy_verify

VOCAB, NODES = 40, 7
PARENTS = np.array([-1, 0, 0, 1, 1, 2, 3], np.int32)  # root -> {1, 2}; 1 -> {3, 4}; 2 -> {5}; 3 -> {6}


def greedy_case(argmax_path):
    """Logits whose argmax at the nodes of `argmax_path` leads along it: row tokens are 10 + node;
    at every node the argmax is the token of the next node on the path (or token 39 at its end)."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((NODES, VOCAB)).astype(np.float32)
    tokens = 10 + np.arange(NODES, dtype=np.int32)
    for i, node in enumerate(argmax_path):
        best = tokens[argmax_path[i + 1]] if i + 1 < len(argmax_path) else 39
        logits[node, best] = 5.0
    for node in range(NODES):
        if node not in argmax_path:
            logits[node, 38] = 5.0
    return logits, tokens


@pytest.mark.parametrize("impl", ["reference", "triton-interpret"])
@pytest.mark.parametrize(
    "argmax_path,accepted",
    [
        ((0, 1, 3, 6), 3),  # all accepted down to a leaf: bonus token = argmax at the leaf
        ((0, 2, 5), 2),  # second sibling accepted
        ((0,), 0),  # all rejected at the root
        ((0, 1), 1),  # accepted node whose children are all rejected
    ],
)
def test_greedy_paths(impl, argmax_path, accepted):
    logits, tokens = greedy_case(argmax_path)
    out = tree_verify(
        jnp.asarray(logits)[None],
        jnp.asarray(PARENTS)[None],
        jnp.asarray(tokens)[None],
        jnp.array([NODES], jnp.int32),
        jax.random.key(0),
        temperature=0.0,
        impl=impl,
    )
    path = list(argmax_path) + [-1] * (NODES - len(argmax_path))
    np.testing.assert_array_equal(out.path[0], path)
    assert int(out.num_accepted[0]) == accepted
    assert int(out.next_token[0]) == 39
    want = processed_logprobs(jnp.asarray(logits), Sampling(temperature=0.0))
    emitted = [tokens[n] for n in argmax_path[1:]] + [39]
    np.testing.assert_allclose(
        out.logprobs[0, : accepted + 1], [want[n, y] for n, y in zip(argmax_path, emitted)], rtol=1e-6, atol=1e-6
    )
    assert np.all(np.asarray(out.logprobs[0, accepted + 1 :]) == 0)


@pytest.mark.parametrize("impl", ["reference", "triton-interpret"])
def test_greedy_padding_ties_and_keys(impl):
    """Padding nodes matching the argmax are never accepted; ties go to the first index; the key
    does not matter."""
    logits, tokens = greedy_case((0, 1, 3, 6))
    logits = np.stack([logits, logits])
    logits[1, 0, 9] = 5.0  # row 1: token 9 ties with the root's argmax 11 (node 1) and comes first
    num_nodes = jnp.array([3, NODES], jnp.int32)  # row 0: node 3, the argmax of node 1, is padding
    args = (jnp.asarray(logits), jnp.asarray(np.stack([PARENTS] * 2)), jnp.asarray(np.stack([tokens] * 2)), num_nodes)
    a = tree_verify(*args, jax.random.key(0), temperature=0.0, impl=impl)
    b = tree_verify(*args, jax.random.key(1), temperature=0.0, impl=impl)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.num_accepted, [1, 0])
    np.testing.assert_array_equal(a.next_token, [tokens[3], 9])


TIE_VOCAB, TIE_TILE = 40, 8  # 5 vocabulary tiles of 8 tokens


@pytest.mark.parametrize(
    "impl,programs",
    [("reference", None), ("triton-interpret", 1), ("triton-interpret", 1000)],
    ids=["reference", "kernel-one-split", "kernel-split-per-tile"],
)
def test_greedy_ties_across_tiles_go_to_the_first_token(impl, programs):
    """The root's largest logit is shared by tokens 12 (tile 1) and 28 (tile 3), node 2's by 5
    (tile 0) and 37 (tile 4): the argmax is the first, 12 and 5, as np.argmax has it. Row 0 drafts
    28 then 12 at the root (28 rejected, 12 accepted, 5 emitted after it), row 1 drafts 28 and 30
    (both rejected, 12 emitted). The kernel compares the tiles inside one program (programs=1) or
    one split per tile, combined afterwards (programs=1000); the reference combines its tiles."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((2, 3, TIE_VOCAB)).astype(np.float32)
    logits[:, 0, [12, 28]] = 6.0
    logits[:, 2, [5, 37]] = 6.0
    parents = np.tile(np.array([-1, 0, 0], np.int32), (2, 1))
    tokens = np.array([[0, 28, 12], [0, 28, 30]], np.int32)
    num_nodes = np.array([3, 3], np.int32)
    args = tuple(map(jnp.asarray, (logits, parents, tokens, num_nodes)))
    if impl == "reference":
        out = verify_reference(*args, jax.random.key(0), temperature=0.0, tile=TIE_TILE)
    else:
        out = verify_triton(*args, jax.random.key(0), temperature=0.0, interpret=True, tile=TIE_TILE, programs=programs)
    path, accepted, next_token, logprobs = greedy_verify(logits, parents, tokens, num_nodes)
    np.testing.assert_array_equal(out.path, path)
    np.testing.assert_array_equal(out.num_accepted, accepted)
    np.testing.assert_array_equal(out.next_token, next_token)
    np.testing.assert_allclose(out.logprobs, logprobs, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.next_token, [5, 12])
    np.testing.assert_array_equal(out.path[:, :2], [[0, 2], [0, -1]])
