"""tests/gpu/check_thin_matmul.py on a GPU: the thin-matmul kernel (through jax-triton) against the
exact product at the model's decode and verification shapes, with a moved weight column as the
negative control."""

import pytest

from tests.gpu import check_thin_matmul

pytestmark = pytest.mark.gpu


def test_thin_matmul_kernel_agrees_with_the_product():
    assert check_thin_matmul.check_thin_matmul()
