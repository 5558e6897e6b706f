"""tests/gpu/check_command_buffers.py on a GPU: a chain of Triton kernels is faster inside XLA's
command buffers than launched on its own (the "off" setting), with the same values."""

import pytest

from tests.gpu import check_command_buffers

pytestmark = pytest.mark.gpu


def test_triton_kernels_run_inside_command_buffers():
    assert check_command_buffers.check_command_buffers()
