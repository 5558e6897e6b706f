"""tests/gpu/check_residual_norm.py on a GPU: the residual-norm kernel (through jax-triton) against
the model's own add and RMS norm, with a moved weight as the negative control."""

import pytest

from tests.gpu import check_residual_norm

pytestmark = pytest.mark.gpu


def test_residual_norm_kernel_agrees_with_the_reference():
    assert check_residual_norm.check_residual_norm()
