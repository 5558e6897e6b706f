"""tests/gpu/check_attention_prologue.py on a GPU: the attention-prologue kernel (through jax-triton)
against the model's own pieces, with a moved page-table entry as the negative control."""

import pytest

from tests.gpu import check_attention_prologue

pytestmark = pytest.mark.gpu


def test_attention_prologue_kernel_agrees_with_the_reference():
    assert check_attention_prologue.check_attention_prologue()
