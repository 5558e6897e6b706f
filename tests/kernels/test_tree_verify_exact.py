"""The jnp reference verifier is lossless: emitted tokens follow the policy exactly (chi-square
against float64 enumeration), for deterministic and sampled draft trees, with -inf-masked logits;
sampled drafts also through the stochastic-draft kernel, compiled on a GPU (`pytest -m gpu
tests/kernels`).

These cases cover tree shapes, temperatures and masks rather than small errors: at SAMPLES rows the
deterministic-draft cases detect with 90% power an acceptance bias of 3-8% and a temperature error
of 8-10% (33% for `single`, which has no drafts), by `chi_square_power` from the exact laws of the
biased verifiers. Errors of 2% (acceptance) and 3% (temperature) and reused noise are the job of
tests/kernels/test_tree_verify_power.py."""

import jax
import numpy as np
import pytest

from jaxspec.kernels import tree_verify
from jaxspec.kernels.tree_verify_reference import verify_reference
from tests.kernels.trees import (
    CHAIN3,
    IRREGULAR,
    SINGLE,
    WIDE2_DEEP2,
    PrefixPolicy,
    chi_square_pvalue,
    complete,
    emitted_sequences,
    per_row_arrays,
    prefixes,
    sampled_trees,
    sequence_distribution,
    top_tokens_tree,
    tree_arrays,
    tree_walk_distribution,
)

VOCAB = 5
SAMPLES = 20000


def check_structure_and_logprobs(result, parents, tokens, policy, temperature, rows=2000):
    """path walks parent -> child from the root; logprobs are log p at each emitted token's parent."""
    path, count, nxt, logprobs = (np.asarray(x) for x in result)
    tokens = np.asarray(tokens)
    parents = np.asarray(parents)
    for b in range(rows):
        k = count[b]
        assert path[b, 0] == 0 and np.all(path[b, k + 1 :] == -1) and np.all(path[b, 1 : k + 1] >= 0)
        assert all(parents[b, path[b, i]] == path[b, i - 1] for i in range(1, k + 1))
        paths = prefixes(parents[b], tokens[b])
        nodes = path[b, : k + 1]
        emitted = [tokens[b, n] for n in nodes[1:]] + [nxt[b]]
        want = [np.log(policy.probs(paths[n], temperature)[y]) for n, y in zip(nodes, emitted)]
        np.testing.assert_allclose(logprobs[b, : k + 1], want, rtol=1e-5, atol=1e-5)
        assert np.all(logprobs[b, k + 1 :] == 0)


DETERMINISTIC = [
    ("chain3", CHAIN3, 1.0, 1.0),
    ("wide2_deep2", WIDE2_DEEP2, 1.0, 1.0),
    ("single", SINGLE, 1.0, 1.0),
    ("irregular_t0.7", IRREGULAR, 0.7, 1.0),
    ("wide2_deep2_top_p", WIDE2_DEEP2, 1.0, 0.8),
    ("chain3_top_p", CHAIN3, 1.0, 0.7),
]


@pytest.mark.parametrize("name,parents,temperature,top_p", DETERMINISTIC, ids=[c[0] for c in DETERMINISTIC])
def test_deterministic_drafts_are_lossless(name, parents, temperature, top_p):
    policy = PrefixPolicy(VOCAB, seed=11, top_p=top_p)
    tokens = top_tokens_tree(PrefixPolicy(VOCAB, seed=12), parents)
    logits, par, tok, num, _ = tree_arrays(policy, parents, tokens, SAMPLES)
    result = tree_verify(logits, par, tok, num, jax.random.key(len(name)), temperature=temperature)
    exact = tree_walk_distribution(policy, parents, tokens, temperature)
    assert chi_square_pvalue(emitted_sequences(result, tok), exact) > 1e-3
    check_structure_and_logprobs(result, par, tok, policy, temperature)


def test_masked_children_and_empty_residual():
    """A child with p = 0 is never accepted; when the children cover p's support, every row
    accepts one (the residual is empty), and the law is still exact."""
    root = np.array([0.3, 0.0, -np.inf, -np.inf, -np.inf], np.float32)
    second = np.array([0.0, 1.0, -0.5, -np.inf, 0.2], np.float32)
    parents = (-1, 0, 0, 0, 1, 1)
    tokens = np.array([0, 3, 1, 0, 4, 2], np.int32)  # root: {3 (p=0), 1, 0} covers the support {0, 1}

    class Fixed(PrefixPolicy):
        def logits(self, prefix):
            return root if prefix == () else second

    policy = Fixed(VOCAB, seed=0)
    logits, par, tok, num, _ = tree_arrays(policy, parents, tokens, SAMPLES)
    result = tree_verify(logits, par, tok, num, jax.random.key(3), temperature=1.0)
    seqs = emitted_sequences(result, tok)
    assert all(len(s) >= 2 for s in seqs) and not any(s[0] == 3 for s in seqs)
    assert chi_square_pvalue(seqs, tree_walk_distribution(policy, parents, tokens, 1.0)) > 1e-3


def test_chi_square_rejects_the_divide_by_q_bias():
    """Negative control: treating deterministic top-1 drafts as if drawn from the draft's softmax
    (accept with min(1, p/q), residual norm((p - q)+)) is biased, and the test detects it."""
    policy, draft = PrefixPolicy(VOCAB, seed=11), PrefixPolicy(VOCAB, seed=12, scale=2.5)
    tokens = top_tokens_tree(draft, CHAIN3)
    logits, par, tok, num, q = tree_arrays(policy, CHAIN3, tokens, SAMPLES, draft=draft)
    exact = tree_walk_distribution(policy, CHAIN3, tokens, 1.0)
    biased = tree_verify(logits, par, tok, num, jax.random.key(5), temperature=1.0, draft_probs=q)
    assert chi_square_pvalue(emitted_sequences(biased, tok), exact) < 1e-6
    correct = tree_verify(logits, par, tok, num, jax.random.key(5), temperature=1.0)
    assert chi_square_pvalue(emitted_sequences(correct, tok), exact) > 1e-3


# the jnp reference, and the stochastic-draft kernel compiled on a GPU (`pytest -m gpu tests/kernels`:
# Triton's interpreter runs one program per row, far too slowly for SAMPLES rows)
SAMPLED_IMPLS = ["reference", "triton"]
KERNEL_LAW_CASES = ("chain3", "irregular_t0.7", "wide2_deep2_top_p")  # the kernel's (it equals the reference)
STOCHASTIC = [
    ("chain3", CHAIN3, 1.0, 1.0),  # standard speculative sampling
    ("wide2_deep2", WIDE2_DEEP2, 1.0, 1.0),
    ("single", SINGLE, 1.0, 1.0),
    ("irregular_t0.7", IRREGULAR, 0.7, 1.0),
    ("wide2_deep2_top_p", WIDE2_DEEP2, 1.0, 0.8),
]


@pytest.mark.parametrize(
    "name,parents,temperature,top_p,impl",
    [
        pytest.param(*c, impl, marks=[pytest.mark.gpu] if impl == "triton" else [])
        for c in STOCHASTIC
        for impl in SAMPLED_IMPLS
        if impl == "reference" or c[0] in KERNEL_LAW_CASES
    ],
    ids=[
        f"{c[0]}-{impl}"
        for c in STOCHASTIC
        for impl in SAMPLED_IMPLS
        if impl == "reference" or c[0] in KERNEL_LAW_CASES
    ],
)
def test_sampled_drafts_are_lossless(name, parents, temperature, top_p, impl):
    """Children drawn from q without replacement (numpy), verified, then completed by the policy to
    a fixed length: the whole sequence must follow the policy's autoregressive law."""
    rng = np.random.default_rng(len(name))
    policy, draft = PrefixPolicy(VOCAB, seed=21, top_p=top_p), PrefixPolicy(VOCAB, seed=22)
    tokens = sampled_trees(draft, parents, SAMPLES, rng)
    logits, par, tok, num, q = per_row_arrays(policy, draft, parents, tokens)
    result = tree_verify(
        logits, par, tok, num, jax.random.key(100 + len(name)), temperature=temperature, draft_probs=q, impl=impl
    )
    depth = max(len(p) for p in prefixes(parents, tokens[0]))
    seqs = complete(policy, emitted_sequences(result, tok), depth + 1, temperature, rng)
    assert chi_square_pvalue(seqs, sequence_distribution(policy, depth + 1, temperature)) > 1e-3
    check_structure_and_logprobs(result, par, tok, policy, temperature)


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=pytest.mark.gpu)])
def test_sampled_drafts_accept_more_when_q_matches_p(impl):
    """With q = p every sampled chain draft is accepted (min(1, p/q) = 1)."""
    policy = PrefixPolicy(VOCAB, seed=21)
    tokens = sampled_trees(policy, CHAIN3, SAMPLES, np.random.default_rng(0))
    logits, par, tok, num, q = per_row_arrays(policy, policy, CHAIN3, tokens)
    result = tree_verify(logits, par, tok, num, jax.random.key(0), temperature=1.0, draft_probs=q, impl=impl)
    np.testing.assert_array_equal(np.asarray(result.num_accepted), 3)


def test_two_level_race_over_tiles_is_exact():
    """Residual and bonus samples drawn tile-then-token (vocabulary 12 in tiles of 4) follow p,
    including a node whose children and -inf entries leave whole tiles without candidates."""
    vocab = 12

    class Masked(PrefixPolicy):
        def logits(self, prefix):
            x = super().logits(prefix).copy()
            if prefix == ():
                x[4:8] = -np.inf  # the root's middle tile has no mass
            return x

    policy = Masked(vocab, seed=31)
    tokens = top_tokens_tree(PrefixPolicy(vocab, seed=32), WIDE2_DEEP2)
    tokens[1:3] = [0, 1]  # with tokens 2, 3 (if likely) drafted below: the root's first tile is half children
    logits, par, tok, num, _ = tree_arrays(policy, WIDE2_DEEP2, tokens, SAMPLES)
    result = verify_reference(logits, par, tok, num, jax.random.key(9), temperature=1.0, tile=4)
    exact = tree_walk_distribution(policy, WIDE2_DEEP2, tokens, 1.0)
    assert chi_square_pvalue(emitted_sequences(result, tok), exact) > 1e-3
    single = tree_arrays(policy, SINGLE, tokens[:1], SAMPLES)
    result = verify_reference(*single[:4], jax.random.key(10), temperature=1.0, tile=4)
    exact = tree_walk_distribution(policy, SINGLE, tokens[:1], 1.0)
    assert chi_square_pvalue(emitted_sequences(result, single[2]), exact) > 1e-3
