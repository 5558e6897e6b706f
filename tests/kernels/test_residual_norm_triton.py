"""The residual-norm kernel computes its jnp reference, which is the model's own add and RMS norm.

Triton's interpreter runs the kernel's own code on the CPU: rows of a power-of-two width and of
one that is not (masked channels), with a sublayer's output to add and without one (a model's
first norm). The sum must equal the reference's bit for bit (one rounding of the same float32
sum); the normed rows within one rounding of their dtype (the kernel reduces in another order than
XLA). A weight with one channel changed fails that comparison. The 16-bit cases run in float16
(Triton's interpreter converts float32 to bfloat16 by truncation); compiling the kernel for sm90
checks that it is valid Triton for Hopper, in bfloat16 too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton", reason="the Triton kernel's tests need the triton package (the test extra has it)")
pytest.importorskip("torch", reason="Triton's interpreter runs on torch CPU tensors (the test extra has torch)")

from jaxspec.kernels import residual_norm_triton as kernel  # noqa: E402
from jaxspec.models.residual_norm import residual_norm_reference  # noqa: E402
from tests.kernels.triton_compile import compile_for_hopper  # noqa: E402

ROUNDING = {jnp.float32: 2.0**-20, jnp.float16: 2.0**-10}  # relative: one rounding in the dtype, with margin
EPS = 1e-6

# name: dtype, leading shape, channels, with a delta
CASES = {
    "decode-f16": (jnp.float16, (4, 1), 64, True),
    "verify-f32": (jnp.float32, (3, 4), 96, True),
    "first-norm": (jnp.float16, (2, 3), 128, False),
    "one-row": (jnp.float32, (1, 1), 40, True),
}


def case_inputs(name: str, seed: int = 0):
    dtype, lead, channels, with_delta = CASES[name]
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32).astype(dtype)

    x = normal(*lead, channels, scale=3.0)
    return x, normal(*lead, channels) if with_delta else None, 1 + normal(channels, scale=0.3)


def assert_matches(got, want, dtype):
    tol = ROUNDING[dtype]
    np.testing.assert_array_equal(np.float32(got[0]), np.float32(want[0]))
    np.testing.assert_allclose(np.float32(got[1]), np.float32(want[1]), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", CASES)
def test_the_kernel_computes_the_reference(name):
    x, delta, weight = case_inputs(name)
    got = kernel.residual_norm(x, delta, weight, eps=EPS, interpret=True)
    want = jax.jit(residual_norm_reference, static_argnums=3)(x, delta, weight, EPS)
    assert got[1].shape == x.shape and got[1].dtype == x.dtype
    assert_matches(got, want, CASES[name][0])


def test_a_changed_weight_fails_the_comparison():
    """The control: the reference with one channel's weight moved by 1% disagrees."""
    x, delta, weight = case_inputs("verify-f32")
    got = kernel.residual_norm(x, delta, weight, eps=EPS, interpret=True)
    want = residual_norm_reference(x, delta, weight.at[5].multiply(1.01), EPS)
    with pytest.raises(AssertionError):
        assert_matches(got, want, jnp.float32)


def test_mismatched_inputs_raise():
    x, delta, weight = case_inputs("verify-f32")
    with pytest.raises(ValueError, match=r"must share one dtype"):
        kernel.residual_norm(x, delta.astype(jnp.float16), weight, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match=r"weight \[H\]"):
        kernel.residual_norm(x, delta, weight[:-1], eps=EPS, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("channels, has_delta", [(2048, True), (4096, False), (5120, True)])
def test_the_kernel_compiles_for_hopper(channels, has_delta, dtype):
    """Triton compiles the kernel for sm90 at the model widths, with the constexprs and warps it
    launches with (the interpreter runs some operations the GPU compiler rejects)."""
    constants = kernel.launch_constants(channels, has_delta=has_delta, eps=EPS)
    compile_for_hopper(
        kernel._residual_norm, [dtype] * 5, constants, num_warps=kernel.num_warps(channels), num_stages=1
    )
