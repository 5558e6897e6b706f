"""tests/gpu/check_attention.py on a GPU: the Triton attention kernel on the dense cache (through
jax-triton) against the exact attention, and the draft head's TTT attention on cuDNN against XLA's."""

import pytest

from tests.gpu import check_attention

pytestmark = pytest.mark.gpu


def test_cache_attention_kernel_agrees_with_the_dense_path():
    assert check_attention.check_cache_attention()


def test_ttt_attention_on_cudnn_agrees_with_xla():
    assert check_attention.check_ttt_attention()
