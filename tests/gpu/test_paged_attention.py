"""tests/gpu/check_paged_attention.py on a GPU: the Triton attention kernel (through jax-triton) on
paged caches against the exact attention the jnp reference computes, with a wrong page table as
the negative control."""

import pytest

from tests.gpu import check_paged_attention

pytestmark = pytest.mark.gpu


def test_paged_attention_kernel_agrees_with_the_reference():
    assert check_paged_attention.check_paged_attention()
