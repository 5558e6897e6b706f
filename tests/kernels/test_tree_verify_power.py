"""The exactness tests of tree verification have the power to see small biases.

A sampler that is 2% off biases an RL experiment, so the chi-square test of the emitted
sequences (against the exact law, `tests.kernels.trees`) must reject, with >= 90% power at
p < ALPHA, each of these wrong verifiers:

- acceptance 2% too likely: the acceptance threshold scaled by 1.02 (each node's uniform
  divided by 1.02: deterministic drafts take the k-th child with probability min(1, 1.02 S_k) -
  min(1, 1.02 S_{k-1}); sampled drafts accept with min(1, 1.02 p / q));
- temperature 3% off: the verifier run at 1.03 times the temperature of the law;
- noise reused across tree levels: every node uses the root's uniform and Gumbel seeds;
- (sampled trees) siblings sharing one uniform: each sampled child tested with its parent's.

Power comes from strong drafts (acceptance decisions at every level are frequent and their
probabilities far from 0 and 1) and many rows in one vectorised call. The verifiers are biased
through their noise (`tests.kernels.biased_verifier`); the jnp reference is what
`jaxspec.kernels.tree_verify` runs on CPU and for sampled drafts on every backend under "auto". The Triton
kernels draw the same samples from the same key (tests/kernels/test_tree_verify_triton.py,
tests/kernels/test_tree_stochastic_triton.py), but a few keys agreeing does not show that every
decision agrees: an error that moves only the decisions within 2% of their threshold passes
them. So the deterministic-draft kernels, compiled on a GPU, also take the deterministic-draft law
test, with its power (tests/gpu/test_verify_law.py: Triton's interpreter runs one program at a
time, far too slowly for these rows), and the stochastic-draft kernel (compiled, on a GPU) takes
tests/kernels/test_tree_verify_siblings.py.

How the power was established:
- deterministic drafts: exactly, by `chi_square_power` (noncentral chi-square) from the exact laws
  of the correct and the biased verifier (`tree_walk_distribution`, `accept_scale` / the
  temperature); the test asserts it. At DETERMINISTIC_ROWS the smallest acceptance bias detected
  with 90% power is 0.8% and the smallest temperature error 2.5% (`test_smallest_detected_biases`).
- sampled drafts: the biased law needs the draws of the drafts, so power was measured by
  simulation: 10 seeds of each biased verifier at SAMPLED_ROWS rows, each rejected at p < ALPHA
  in 10 of 10 (acceptance +2%, temperature +3%, reused noise), the correct verifier in 0 of 10.
  Sampled trees (two children per node, two levels: siblings whose later tests are neither
  certain nor hopeless, which chains never have) likewise, each of the four biased verifiers
  in 10 of 10 seeds (the largest p-values 2e-21 at +2% acceptance, 4e-15 at +3% temperature,
  below 1e-300 for reused noise and for a shared sibling uniform); the correct one in 0 of 10.
- reused noise (both kinds of draft): simulation as above, 10 of 10.
"""

import contextlib

import jax
import numpy as np
import pytest

from jaxspec.kernels import tree_verify
from tests.kernels.biased_verifier import accept_more, biased_noise, reuse_across_levels, siblings_share_uniform
from tests.kernels.trees import (
    CHAIN3,
    WIDE2_DEEP2,
    PrefixPolicy,
    chi_square_power,
    chi_square_pvalue,
    complete,
    emitted_sequences,
    per_row_arrays,
    sampled_trees,
    sequence_distribution,
    top_tokens_tree,
    tree_arrays,
    tree_walk_distribution,
)

ALPHA = 1e-3
VOCAB = 4
DETERMINISTIC_ROWS = 50_000
SAMPLED_ROWS = 100_000
ACCEPT_BIAS, TEMPERATURE_ERROR = 0.02, 0.03


def verify(args, key, temperature: float, draft_probs=None, noise=None):
    """`tree_verify` (the jnp reference on CPU), with its noise passed through `noise` when given."""
    with biased_noise(noise) if noise else contextlib.nullcontext():
        return tree_verify(*args, key, temperature=temperature, draft_probs=draft_probs)


@pytest.fixture(scope="module")
def deterministic():
    """The policy's own top tokens as a 2-wide, 2-deep draft tree: the first child of every node
    is its most likely token, accepted often but not always."""
    policy = PrefixPolicy(VOCAB, seed=5)
    tokens = top_tokens_tree(policy, WIDE2_DEEP2)
    args = tree_arrays(policy, WIDE2_DEEP2, tokens, DETERMINISTIC_ROWS)[:4]
    return policy, tokens, args


def test_deterministic_drafts_power(deterministic):
    policy, tokens, args = deterministic
    exact = tree_walk_distribution(policy, WIDE2_DEEP2, tokens, 1.0)
    biased = tree_walk_distribution(policy, WIDE2_DEEP2, tokens, 1.0, accept_scale=1 + ACCEPT_BIAS)
    hot = tree_walk_distribution(policy, WIDE2_DEEP2, tokens, 1 + TEMPERATURE_ERROR)
    assert chi_square_power(exact, biased, DETERMINISTIC_ROWS, ALPHA) >= 0.9
    assert chi_square_power(exact, hot, DETERMINISTIC_ROWS, ALPHA) >= 0.9

    def pvalue(**kw):
        return chi_square_pvalue(emitted_sequences(verify(args, jax.random.key(1), **kw), args[2]), exact)

    assert pvalue(temperature=1.0) > ALPHA
    assert pvalue(temperature=1.0, noise=accept_more(ACCEPT_BIAS)) < ALPHA
    assert pvalue(temperature=1 + TEMPERATURE_ERROR) < ALPHA
    assert pvalue(temperature=1.0, noise=reuse_across_levels) < ALPHA


def test_smallest_detected_biases(deterministic):
    """The documented detection limits of the deterministic-draft test: 90% power at an
    acceptance bias of 0.8% and a temperature error of 2.5%, not at 0.6% and 2%."""
    policy, tokens, _ = deterministic
    exact = tree_walk_distribution(policy, WIDE2_DEEP2, tokens, 1.0)

    def power(accept_scale=1.0, temperature=1.0):
        law = tree_walk_distribution(policy, WIDE2_DEEP2, tokens, temperature, accept_scale=accept_scale)
        return chi_square_power(exact, law, DETERMINISTIC_ROWS, ALPHA)

    assert power(accept_scale=1.008) >= 0.9 > power(accept_scale=1.006)
    assert power(temperature=1.025) >= 0.9 > power(temperature=1.02)


def test_sampled_drafts_power():
    """Chains of 3 drafts sampled from a sharpened copy of the policy (logit scale 3 instead of
    1.5: q exceeds p on the likely tokens, so rejections are frequent), completed by the policy to
    4 tokens: correct passes, each wrong verifier is rejected (power: module docstring)."""
    policy, draft = PrefixPolicy(VOCAB, seed=5), PrefixPolicy(VOCAB, seed=5, scale=3.0)
    rng = np.random.default_rng(0)
    tokens = sampled_trees(draft, CHAIN3, SAMPLED_ROWS, rng)
    *args, q = per_row_arrays(policy, draft, CHAIN3, tokens)
    exact = sequence_distribution(policy, 4, 1.0)

    def pvalue(**kw):
        result = verify(args, jax.random.key(2), draft_probs=q, **kw)
        return chi_square_pvalue(complete(policy, emitted_sequences(result, args[2]), 4, 1.0, rng), exact)

    assert pvalue(temperature=1.0) > ALPHA
    assert pvalue(temperature=1.0, noise=accept_more(ACCEPT_BIAS)) < ALPHA
    assert pvalue(temperature=1 + TEMPERATURE_ERROR) < ALPHA
    assert pvalue(temperature=1.0, noise=reuse_across_levels) < ALPHA


def test_sampled_tree_drafts_power():
    """Trees of 2 x 2 drafts sampled without replacement from the sharpened copy of the policy
    (`test_sampled_drafts_power`), completed by the policy to 3 tokens: correct passes, each wrong
    verifier is rejected, siblings sharing one uniform included (power: module docstring)."""
    policy, draft = PrefixPolicy(VOCAB, seed=5), PrefixPolicy(VOCAB, seed=5, scale=3.0)
    rng = np.random.default_rng(1)
    tokens = sampled_trees(draft, WIDE2_DEEP2, SAMPLED_ROWS, rng)
    *args, q = per_row_arrays(policy, draft, WIDE2_DEEP2, tokens)
    exact = sequence_distribution(policy, 3, 1.0)

    def pvalue(**kw):
        result = verify(args, jax.random.key(3), draft_probs=q, **kw)
        return chi_square_pvalue(complete(policy, emitted_sequences(result, args[2]), 3, 1.0, rng), exact)

    assert pvalue(temperature=1.0) > ALPHA
    assert pvalue(temperature=1.0, noise=accept_more(ACCEPT_BIAS)) < ALPHA
    assert pvalue(temperature=1 + TEMPERATURE_ERROR) < ALPHA
    assert pvalue(temperature=1.0, noise=reuse_across_levels) < ALPHA
    assert pvalue(temperature=1.0, noise=siblings_share_uniform(WIDE2_DEEP2)) < ALPHA
