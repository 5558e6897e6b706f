"""A cached extension's residual adds with the RMS norms after them, as one kernel where it runs.

`extend` adds each sublayer's output to the residual stream and normalises the sum before the
next GEMM (the MLP's norm after attention, the next layer's attention norm after the MLP, the
final norm before the LM head): `residual_norm` returns both. "xla" is the model's own pieces
(`residual_norm_reference`); "triton" runs `jaxspec.kernels.residual_norm_triton`, one kernel per
norm where XLA runs two, on one device (a mesh lays the activations out over devices, which the
kernel's call does not follow); "triton-interpret" runs it in Triton's interpreter (tests).
The JAXSPEC_RESIDUAL_NORM environment variable chooses: "auto" (the default) keeps XLA's pieces
until the kernel has passed its GPU check (`tests/gpu/check_residual_norm.py`) and the steps are
timed both ways on a GPU.
"""

from __future__ import annotations

import jax

from jaxspec.kernels.dispatch import requested_impl
from jaxspec.models.blocks import rms_norm
from jaxspec.models.sharding import Sharding

IMPLS = ("auto", "xla", "triton", "triton-interpret")
IMPL_ENV = "JAXSPEC_RESIDUAL_NORM"


def residual_norm(
    x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float, sharding: Sharding | None = None
) -> tuple[jax.Array, jax.Array]:
    """(x + delta, rms_norm(x + delta, weight)) for the residual stream x [..., H], a sublayer's
    output delta like x (None: the norm of x alone, x returned as it is) and the norm's weight [H];
    sharding: the call's mesh (the kernel runs on one device only)."""
    impl = requested_impl("auto", IMPLS, IMPL_ENV, "residual norm")
    on_mesh = sharding is not None and sharding.mesh.size > 1
    if impl in ("auto", "xla") or on_mesh or not _kernel().kernel_applies(x, weight):
        return residual_norm_reference(x, delta, weight, eps)
    return _kernel().residual_norm(x, delta, weight, eps=eps, interpret=impl == "triton-interpret")


def residual_norm_reference(
    x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float
) -> tuple[jax.Array, jax.Array]:
    """`residual_norm` from the model's own pieces (`blocks.rms_norm`)."""
    total = x if delta is None else x + delta
    return total, rms_norm(total, weight, eps)


def _kernel():
    """`jaxspec.kernels.residual_norm_triton`, imported on use (triton is an optional dependency)."""
    from jaxspec.kernels import residual_norm_triton

    return residual_norm_triton
