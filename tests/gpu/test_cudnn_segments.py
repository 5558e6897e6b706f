"""tests/gpu/check_cudnn_segments.py on a GPU: flash attention (cuDNN) over packed rows with segment ids
gives the masked XLA attention's logits and gradients, with the segments as a mask and (Hopper) in
cuDNN's packed layout."""

import pytest

from tests.gpu import check_cudnn_segments


@pytest.mark.gpu
def test_cudnn_attention_with_segments_agrees_with_xla():
    assert check_cudnn_segments.main(every_layout=True) == 0
