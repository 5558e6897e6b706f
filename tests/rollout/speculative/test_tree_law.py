"""Stochastic EAGLE-2 trees drafted by `dynamic_tree` and verified by `jaxspec.kernels.tree_verify` emit
the policy's law exactly, in the two shapes where drafting itself can break exactness.

- Pruned across a level (2 deep, 2 wide: the second level keeps the best 2 of its 4 candidates):
  whether a node's children are kept depends on how the other node's children score, so every
  node of a level must draw with its own Gumbel noise; one vector shared by the level makes a kept
  child's identity depend on the other node's draws. (With 3 of the 4 nodes kept the second root
  child's children never survive, and the error has no effect.)
- A full tree wider than q's support (3 wide under the draft's top-p): a node with fewer tokens of
  q > 0 than children must not keep the draws past them (q = 0), which verification would accept.

The draft is a sharpened copy of the policy (`tests.kernels.trees.PrefixPolicy`, logit scale 3
against 1.5), so both errors move a lot of mass. The test is the chi-square of the first DEPTH
emitted tokens (the drafted ones; completed by the policy where fewer were emitted) against the
policy's law, p < ALPHA fails. Power was measured by simulation, the law of these trees having no
closed form: at ROWS rows the shared noise was rejected at each of 5 seeds with p below 1e-14, the
draws with q = 0 kept in the full tree at each of 5 with p below 1e-300; the correct code passed
at each seed.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels import tree_verify
from jaxspec.rollout import Sampling, processed_logprobs
from jaxspec.rollout.speculative.tree import ancestor_mask, dynamic_tree
from tests.kernels.trees import PrefixPolicy, chi_square_pvalue, complete, emitted_sequences, sequence_distribution

VOCAB, DEPTH, ROWS, ALPHA = 5, 2, 100_000, 1e-3
POLICY, DRAFT = PrefixPolicy(VOCAB, seed=5), PrefixPolicy(VOCAB, seed=5, scale=3.0)


def prefix_table(policy: PrefixPolicy, longest: int) -> jax.Array:
    """float32 [(V + 1)^longest, V]: the policy's logits after every prefix of up to `longest`
    tokens, at the prefix's `path_code`."""
    table = np.zeros(((VOCAB + 1) ** longest, VOCAB), np.float32)
    for length in range(longest + 1):
        for prefix in itertools.product(range(VOCAB), repeat=length):
            table[sum((t + 1) * (VOCAB + 1) ** i for i, t in enumerate(prefix))] = policy.logits(prefix)
    return jnp.asarray(table)


def path_code(tokens, mask, depth) -> jax.Array:
    """int32 [B, T]: each node's token prefix below the root as a number (digit d: the token at
    depth d + 1, plus 1), read through the tree's ancestor mask [B, T, T]."""
    digit = jnp.where(depth >= 1, (tokens + 1) * (VOCAB + 1) ** jnp.maximum(depth - 1, 0), 0)
    return jnp.sum(jnp.where(mask, digit[:, None, :], 0), axis=-1)


DRAFT_LOGITS, POLICY_LOGITS = prefix_table(DRAFT, DEPTH - 1), prefix_table(POLICY, DEPTH)


def draft_pass(carry, tokens, parents, depth, mask, frontier):
    return carry, DRAFT_LOGITS[path_code(tokens, mask, depth)][:, frontier]


@functools.partial(jax.jit, static_argnames=("width", "num_nodes", "top_p"))
def draft_and_verify(key, *, width: int, num_nodes: int, top_p: float):
    """ROWS trees from one root (the empty prefix), drawn from the draft processed with top_p,
    and their verification against the policy at temperature 1."""
    draft_key, verify_key = jax.random.split(key)
    sampling = Sampling(temperature=1.0, top_p=top_p)
    _, tree = dynamic_tree(
        draft_pass,
        None,
        jnp.zeros((ROWS,), jnp.int32),
        draft_key,
        depth=DEPTH,
        width=width,
        num_nodes=num_nodes,
        stochastic=True,
        process=lambda logits: processed_logprobs(logits, sampling),
    )
    logits = POLICY_LOGITS[path_code(tree.tokens, ancestor_mask(tree.parents, DEPTH), tree.depth)]
    result = tree_verify(
        logits, tree.parents, tree.tokens, tree.num_nodes, verify_key, temperature=1.0, draft_probs=tree.draft_probs
    )
    return tree, result


@pytest.mark.parametrize("width,num_nodes,top_p", [(2, 4, 1.0), (3, 6, 0.8)], ids=["pruned_level", "full_top_p"])
def test_drafted_stochastic_trees_are_lossless(width, num_nodes, top_p):
    tree, result = draft_and_verify(jax.random.key(0), width=width, num_nodes=num_nodes, top_p=top_p)
    rng = np.random.default_rng(0)
    seqs = complete(POLICY, [s[:DEPTH] for s in emitted_sequences(result, tree.tokens)], DEPTH, 1.0, rng)
    assert chi_square_pvalue(seqs, sequence_distribution(POLICY, DEPTH, 1.0)) > ALPHA
    if top_p < 1:  # the case exercised: nodes with fewer tokens of q > 0 than children
        assert np.mean(np.asarray(tree.num_nodes) < 1 + num_nodes) > 0.5
