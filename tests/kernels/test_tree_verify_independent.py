"""The jnp reference and the Triton kernels (in Triton's interpreter) against `tests.kernels.numpy_verify`,
a float64 numpy implementation of tree verification that shares no code with the kernels: exactly
where the result is deterministic (normalisers, residual masses, greedy outcomes, log-probs) and
in law at temperature > 0 (the reference here; the kernels compiled on a GPU,
tests/gpu/test_verify_law.py), over vocabularies of several race tiles split over several programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.kernels.tree_verify_reference import node_stats_reference, verification_noise, verify_reference
from jaxspec.kernels.tree_verify_triton import node_stats_triton, verify_triton
from tests.kernels.numpy_verify import emitted_law, greedy_verify, lse_and_residual
from tests.kernels.trees import chi_square_pvalue, emitted_sequences, random_parents_and_tokens

BATCH, NODES, VOCAB = 6, 8, 300
TILE = 64  # 5 tiles, the last ragged
PROGRAMS = 100  # with 6 x 8 nodes: 3 vocabulary splits of 2, 2 and 1 tiles


def random_forest(seed: int):
    """Random trees and tokens, num_nodes 8, 8, 5, 3, 1, 2; logits with ~30% -inf entries, and
    most children's tokens made their parent's argmax so that greedy paths run deep."""
    rng = np.random.default_rng(seed)
    parents, tokens = random_parents_and_tokens(rng, BATCH, NODES, VOCAB)
    logits = 2.0 * rng.standard_normal((BATCH, NODES, VOCAB)).astype(np.float32)
    logits[rng.random(logits.shape) < 0.3] = -np.inf
    logits[:, :, 7] = 1.0  # every node's support is non-empty
    for b in range(BATCH):
        for n in range(1, NODES):
            if rng.random() < 0.6:
                logits[b, parents[b, n], tokens[b, n]] = 9.0 + rng.random()
    return logits, parents, tokens, np.array([8, 8, 5, 3, 1, 2], np.int32)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_normaliser_and_residual_mass(impl, temperature):
    logits, parents, tokens, num_nodes = random_forest(1)
    args = tuple(map(jnp.asarray, (logits, parents, tokens, num_nodes)))
    noise = verification_noise(jax.random.key(4), BATCH, NODES)
    if impl == "reference":
        got = node_stats_reference(*args, noise, temperature, tile=TILE)
    else:
        got = node_stats_triton(*args, noise, temperature, interpret=True, tile=TILE, programs=PROGRAMS)
    lse, residual = lse_and_residual(logits, parents, tokens, num_nodes, temperature)
    np.testing.assert_allclose(got.lse, lse, rtol=1e-5, atol=1e-5)
    if temperature > 0:
        np.testing.assert_allclose(got.residual_mass, residual, rtol=1e-4, atol=1e-6)
    else:  # greedy: the sample is the first argmax of the logits
        np.testing.assert_array_equal(got.sample, np.argmax(logits, axis=-1))


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_greedy_outcome_and_logprobs(impl):
    deepest = 0
    for seed in (1, 2, 3, 4):
        logits, parents, tokens, num_nodes = random_forest(seed)
        args = tuple(map(jnp.asarray, (logits, parents, tokens, num_nodes)))
        if impl == "reference":
            result = verify_reference(*args, jax.random.key(0), temperature=0.0, tile=TILE)
        else:
            result = verify_triton(
                *args, jax.random.key(0), temperature=0.0, interpret=True, tile=TILE, programs=PROGRAMS
            )
        path, accepted, nxt, logprobs = greedy_verify(logits, parents, tokens, num_nodes)
        np.testing.assert_array_equal(result.path, path)
        np.testing.assert_array_equal(result.num_accepted, accepted)
        np.testing.assert_array_equal(result.next_token, nxt)
        np.testing.assert_allclose(result.logprobs, logprobs, rtol=1e-5, atol=1e-5)
        deepest = max(deepest, accepted.max())
    assert deepest >= 2, "some greedy paths should run deep"


RACE_ROWS = 4000


def tiled_rows(logits, parents, tokens) -> tuple[jax.Array, ...]:
    """RACE_ROWS copies of one tree as `tree_verify`'s (logits, parents, draft_tokens, num_nodes)."""
    tile = lambda x: jnp.asarray(np.broadcast_to(x, (RACE_ROWS,) + x.shape))  # noqa: E731
    return tile(logits), tile(parents), tile(tokens), jnp.full((RACE_ROWS,), len(tokens), jnp.int32)


def tiled_tree():
    """One tree (root -> {1, 2}, 1 -> {3}) over 256 tokens in 4 tiles of 64 whose mass and maximum
    disagree: at every node tile 0 has three tokens of logit 0 (mass 3), tile 1 one of log 2
    (mass 2, the largest token), tile 2 one of 0.3, tile 3 two of -0.5; everything else -8.
    The root's children are tokens 3 (tile 0) and 70 (tile 1), node 1's child token 130."""
    logits = np.full((4, 256), -8.0, np.float32)
    logits[:, [3, 10, 20]] = 0.0
    logits[:, 70] = np.log(2.0)
    logits[:, 130] = 0.3
    logits[:, [200, 250]] = -0.5
    logits[1, 20] = 1.0  # node 1 differs from the others
    parents = np.array([-1, 0, 0, 1], np.int32)
    tokens = np.array([0, 3, 70, 130], np.int32)
    return logits, parents, tokens


def test_emitted_law_over_tiles_and_splits():
    """Residual and bonus samples come from the two-level tile race; weighting tiles by anything
    but their candidate mass (e.g. the tile maximum) changes this law by far more than the test
    resolves. (The Triton kernels take it compiled, on a GPU: tests/gpu/test_verify_law.py.)"""
    logits, parents, tokens = tiled_tree()
    args = tiled_rows(logits, parents, tokens)
    result = verify_reference(*args, jax.random.key(1), temperature=1.0, tile=TILE)
    law = emitted_law(logits, parents, tokens, 4, 1.0)
    assert chi_square_pvalue(emitted_sequences(result, args[2]), law) > 1e-3
