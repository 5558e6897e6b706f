"""Coupled draws (one key per node): the verifier stays lossless, and the token it emits at a node
is the one a lone root draws under that node's key, whatever the tree around it.

Law: the chi-square test of the emitted sequences against float64 enumeration, on the trees,
temperatures and masks of tests/kernels/test_tree_verify_exact.py, and at the power test's rows
and tree (tests/kernels/test_tree_verify_power.py: 90% power against a temperature error of
2.5%), where two wrong coupled verifiers are rejected: one 3% hot, and one that keys every node by
its row alone (the root's noise at every depth, the error of a rollout that forgot the position).
A child is accepted exactly when it is the node's draw, so the number accepted is a function of
the emitted sequence: the law test covers the acceptance too, which is the sibling rule's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import tree_verify
from tests.kernels.biased_verifier import biased_noise, reuse_across_levels
from tests.kernels.test_tree_verify_exact import DETERMINISTIC, VOCAB, check_structure_and_logprobs
from tests.kernels.trees import (
    WIDE2_DEEP2,
    PrefixPolicy,
    chi_square_power,
    chi_square_pvalue,
    emitted_sequences,
    random_parents_and_tokens,
    top_tokens_tree,
    tree_arrays,
    tree_walk_distribution,
)

SAMPLES = 20000
POWER_ROWS, POWER_VOCAB, ALPHA = 50_000, 4, 1e-3


def node_keys(seed: int, batch: int, nodes: int) -> jax.Array:
    return jax.random.split(jax.random.key(seed), (batch, nodes))


@pytest.mark.parametrize("name,parents,temperature,top_p", DETERMINISTIC, ids=[c[0] for c in DETERMINISTIC])
def test_coupled_drafts_are_lossless(name, parents, temperature, top_p):
    policy = PrefixPolicy(VOCAB, seed=11, top_p=top_p)
    tokens = top_tokens_tree(PrefixPolicy(VOCAB, seed=12), parents)
    logits, par, tok, num, _ = tree_arrays(policy, parents, tokens, SAMPLES)
    keys = node_keys(len(name), SAMPLES, par.shape[1])
    result = tree_verify(logits, par, tok, num, keys, temperature=temperature)
    exact = tree_walk_distribution(policy, parents, tokens, temperature)
    assert chi_square_pvalue(emitted_sequences(result, tok), exact) > 1e-3
    check_structure_and_logprobs(result, par, tok, policy, temperature)


def test_coupled_power_and_wrong_verifiers():
    policy = PrefixPolicy(POWER_VOCAB, seed=5)
    tokens = top_tokens_tree(policy, WIDE2_DEEP2)
    args = tree_arrays(policy, WIDE2_DEEP2, tokens, POWER_ROWS)[:4]
    keys = node_keys(1, POWER_ROWS, args[1].shape[1])
    exact = tree_walk_distribution(policy, WIDE2_DEEP2, tokens, 1.0)
    assert chi_square_power(exact, tree_walk_distribution(policy, WIDE2_DEEP2, tokens, 1.025), POWER_ROWS, ALPHA) >= 0.9

    def pvalue(temperature=1.0, noise=None):
        if noise is None:
            result = tree_verify(*args, keys, temperature=temperature)
        else:
            with biased_noise(noise):
                result = tree_verify(*args, keys, temperature=temperature)
        return chi_square_pvalue(emitted_sequences(result, args[2]), exact)

    assert pvalue() > ALPHA
    assert pvalue(temperature=1.03) < ALPHA
    assert pvalue(noise=reuse_across_levels) < ALPHA


def lone_draws(logits, keys, impl: str) -> np.ndarray:
    """int32 [B, N]: the token a lone root draws from each node's logits under that node's key."""
    batch, nodes, _ = logits.shape
    column = jnp.zeros((batch * nodes, 1), jnp.int32)
    flat = logits.reshape(batch * nodes, 1, -1)
    result = tree_verify(flat, column - 1, column, column[:, 0] + 1, keys.reshape(-1, 1), temperature=1.0, impl=impl)
    return np.asarray(result.next_token).reshape(batch, nodes)


def walked(lone: np.ndarray, parents: np.ndarray, tokens: np.ndarray, num_nodes: np.ndarray) -> list[tuple]:
    """Per row, what a coupled verifier must emit: from the root, each node's lone draw, moving to
    the node's first child with that token while there is one."""
    out = []
    for b in range(lone.shape[0]):
        node, emitted = 0, []
        while True:
            emitted.append(int(lone[b, node]))
            kids = [m for m in range(1, num_nodes[b]) if parents[b, m] == node and tokens[b, m] == emitted[-1]]
            if not kids:
                break
            node = kids[0]
        out.append(tuple(emitted))
    return out


@pytest.mark.parametrize("impl,batch", [("reference", 256), ("triton-interpret", 6)])
def test_the_token_at_a_node_is_its_lone_draw_whatever_the_tree(impl, batch):
    """Random trees (random parents, repeated sibling tokens) whose nodes often propose their
    parent's lone draw, so that paths run deep; raw and typed keys alike. The control: the
    same trees under one key per row (the sibling rule's draws) emit other sequences."""
    if impl != "reference":
        pytest.importorskip("triton")
        pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    nodes, vocab = 9, 7
    logits = jnp.asarray(1.5 * rng.standard_normal((batch, nodes, vocab)), jnp.float32)
    keys = node_keys(4, batch, nodes)
    lone = lone_draws(logits, keys, impl)
    parents, tokens = random_parents_and_tokens(rng, batch, nodes, vocab)
    follow = rng.random((batch, nodes)) < 0.6
    tokens = np.where(follow, np.take_along_axis(lone, np.maximum(parents, 0), axis=1), tokens).astype(np.int32)
    num_nodes = rng.integers(1, nodes + 1, size=batch).astype(np.int32)
    want = walked(lone, parents, tokens, num_nodes)
    assert max(len(w) for w in want) >= 4  # deep paths are exercised
    for k in (keys, jax.random.key_data(keys)):
        result = tree_verify(logits, parents, tokens, num_nodes, k, temperature=1.0, impl=impl)
        assert emitted_sequences(result, tokens) == want
    per_row = tree_verify(logits, parents, tokens, num_nodes, keys[:, 0], temperature=1.0, impl=impl)
    assert emitted_sequences(per_row, tokens) != want


def test_greedy_ignores_node_keys():
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.standard_normal((16, 5, 9)), jnp.float32)
    parents, tokens = random_parents_and_tokens(rng, 16, 5, 9)
    num = np.full(16, 5, np.int32)
    coupled = tree_verify(logits, parents, tokens, num, node_keys(0, 16, 5), temperature=0.0)
    plain = tree_verify(logits, parents, tokens, num, jax.random.key(0), temperature=0.0)
    for x, y in zip(coupled, plain, strict=True):
        np.testing.assert_array_equal(x, y)


def test_node_keys_are_refused_where_they_cannot_apply():
    rng = np.random.default_rng(6)
    logits = jnp.asarray(rng.standard_normal((4, 3, 5)), jnp.float32)
    parents, tokens = random_parents_and_tokens(rng, 4, 3, 5)
    num = np.full(4, 3, np.int32)
    probs = jax.nn.softmax(logits)
    with pytest.raises(ValueError, match="one key per node .* needs deterministic drafts"):
        tree_verify(logits, parents, tokens, num, node_keys(0, 4, 3), temperature=1.0, draft_probs=probs)
    with pytest.raises(ValueError, match=r"node keys for \(4, 2\)"):
        tree_verify(logits, parents, tokens, num, node_keys(0, 4, 2), temperature=1.0)
    with pytest.raises(ValueError, match="one key, one per row or one per node"):
        tree_verify(logits, parents, tokens, num, jax.random.split(jax.random.key(0), (4, 3, 2)), temperature=1.0)
