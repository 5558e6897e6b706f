"""A cached extension's residual adds with the RMS norms after them, as one kernel where it runs.

`extend` adds each sublayer's output to the residual stream and normalises the sum before the
next GEMM (the MLP's norm after attention, the next layer's attention norm after the MLP, the
final norm before the LM head): `residual_norm` returns both. "xla" is the model's own pieces
(`residual_norm_reference`); "triton" runs `jaxspec.kernels.residual_norm_triton`, one kernel per
norm where XLA runs two (on a mesh, each device on its own rows, through `shard_map`: the rows are
laid out over the batch axes, a row's channels on one device); "triton-interpret" runs it in
Triton's interpreter (tests).
The JAXSPEC_RESIDUAL_NORM environment variable chooses: "auto" (the default) is "triton" off a mesh
where the Triton kernels run inside XLA's command buffers, on a GPU with jax-triton
(`jaxspec.kernels.command_buffers.layer_kernel_default`; Qwen3-1.7B and 8B decode steps are faster
so, lease TT), else "xla". On a mesh "auto" keeps XLA's pieces until the sharded kernel has run in
a multi-GPU check.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec

from jaxspec.kernels import command_buffers
from jaxspec.kernels.dispatch import requested_impl
from jaxspec.models.blocks import rms_norm
from jaxspec.models.sharding import Sharding, on_devices

IMPLS = ("auto", "xla", "triton", "triton-interpret")
IMPL_ENV = "JAXSPEC_RESIDUAL_NORM"
ACTIVATION_AXES = ("batch", "seq", "act_embed")


def residual_norm(
    x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float, sharding: Sharding | None = None
) -> tuple[jax.Array, jax.Array]:
    """(x + delta, rms_norm(x + delta, weight)) for the residual stream x [B, T, H], a sublayer's
    output delta like x (None: the norm of x alone, x returned as it is) and the norm's weight [H];
    sharding: the call's mesh, on which x is laid out as ("batch", "seq", "act_embed")."""
    impl = requested_impl("auto", IMPLS, IMPL_ENV, "residual norm")
    if impl == "auto":
        impl = command_buffers.layer_kernel_default(on_devices(sharding))
    if impl == "xla" or not _kernel().kernel_applies(x, weight):
        return residual_norm_reference(x, delta, weight, eps)
    kernel = functools.partial(_kernel().residual_norm, eps=eps, interpret=impl == "triton-interpret")
    if not on_devices(sharding):
        return kernel(x, delta, weight)
    rows = sharding.spec(ACTIVATION_AXES, x.shape)
    if rows[-1] is not None:  # a row's channels split over devices: the norm needs them all
        return residual_norm_reference(x, delta, weight, eps)
    args, specs = (x, weight), (rows, PartitionSpec())
    if delta is not None:
        args, specs = (*args, delta), (*specs, rows)
    return jax.shard_map(
        lambda x, weight, *delta: kernel(x, delta[0] if delta else None, weight),
        mesh=sharding.mesh,
        in_specs=specs,
        out_specs=(rows, rows),
        check_vma=False,
    )(*args)


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
