"""On a GPU, the compiled deterministic-draft Triton kernels (`verify_triton`) emit the policy's law:
the CPU suite's law tests of the reference, through the kernels. Triton's interpreter runs one
program at a time, so on the CPU these rows would take many minutes; there the kernels are
compared with the reference key by key instead (tests/kernels/test_tree_verify_triton.py)."""

import jax
import pytest

from jaxspec.kernels.tree_verify_triton import verify_triton
from tests.kernels.numpy_verify import emitted_law
from tests.kernels.test_tree_verify_independent import TILE, tiled_rows, tiled_tree
from tests.kernels.test_tree_verify_power import ALPHA, DETERMINISTIC_ROWS, deterministic  # noqa: F401
from tests.kernels.trees import WIDE2_DEEP2, chi_square_pvalue, emitted_sequences, tree_walk_distribution

KERNEL_ROWS = 5000  # rows per kernel call, one key each


@pytest.mark.gpu
def test_deterministic_drafts_power_through_the_kernels(deterministic):  # noqa: F811
    """DETERMINISTIC_ROWS rows against the exact law: the power of
    `test_deterministic_drafts_power` (a 2% acceptance bias is missed with probability below
    1e-15, 1% with 5e-4)."""
    policy, tokens, args = deterministic
    exact = tree_walk_distribution(policy, WIDE2_DEEP2, tokens, 1.0)
    rows = tuple(x[:KERNEL_ROWS] for x in args)  # every row holds the same tree
    seqs = []
    for i in range(DETERMINISTIC_ROWS // KERNEL_ROWS):
        result = verify_triton(*rows, jax.random.fold_in(jax.random.key(1), i), temperature=1.0)
        seqs += emitted_sequences(result, rows[2])
    assert chi_square_pvalue(seqs, exact) > ALPHA


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [2, 4096])  # one split per node (4 tiles) / one tile per split
def test_emitted_law_over_tiles_and_splits_through_the_kernels(programs):
    """`test_emitted_law_over_tiles_and_splits` through the kernels."""
    logits, parents, tokens = tiled_tree()
    args = tiled_rows(logits, parents, tokens)
    result = verify_triton(*args, jax.random.key(1), temperature=1.0, tile=TILE, programs=programs)
    law = emitted_law(logits, parents, tokens, 4, 1.0)
    assert chi_square_pvalue(emitted_sequences(result, args[2]), law) > 1e-3
