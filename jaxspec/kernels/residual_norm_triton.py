"""A decoder layer's residual add and the RMS norm after it in one kernel (Triton, through jax-triton).

Between two GEMMs of a decode or verification step the model adds a sublayer's output to the
residual stream and normalises the sum (`jaxspec.models.blocks.rms_norm`); XLA runs that as two
small kernels (the sum of squares, then the scaling, each re-reading the row), two per norm and
two norms per layer, which a small or low-batch step's time is partly made of. This kernel is one
launch: one program per token row of H channels, in the model's rounding order:

    total [N, H]  = x + delta                                   (rounded to x's dtype)
    normed [N, H] = weight * (total * rsqrt(mean(total^2) + eps))  (the scaling in float32, cast to
                                                                    the dtype before the weight)

Without delta (a model's first layer) total is x and only normed is returned.
`jaxspec.models.residual_norm.residual_norm_reference` is the same in jnp.

`triton` is imported with this module; `jax_triton` only when the kernel is called for a GPU, and
torch only to run it in Triton's interpreter (`interpret=True`, any backend, slow).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton.language as tl

from jaxspec.kernels import triton_call
from jaxspec.kernels.tree_race import next_power_of_2

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
MAX_CHANNELS = 16384  # a row is held in registers


def _residual_norm(
    x_ptr,
    delta_ptr,
    weight_ptr,
    total_ptr,
    normed_ptr,
    CHANNELS: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    EPS: tl.constexpr,
):
    """One row's program; shapes as in `residual_norm`. Without delta, total_ptr is not written."""
    n = tl.program_id(0).to(tl.int64)
    channels = tl.arange(0, BLOCK)
    inside = channels < CHANNELS
    dtype = normed_ptr.dtype.element_ty
    at = n * CHANNELS + channels
    total = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32)
    if HAS_DELTA:
        total = (total + tl.load(delta_ptr + at, mask=inside, other=0.0).to(tl.float32)).to(dtype)
        tl.store(total_ptr + at, total, mask=inside)
        total = total.to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.reduce(total * total, 0, triton_call.SUM) / CHANNELS + EPS)
    weight = tl.load(weight_ptr + channels, mask=inside, other=0.0).to(tl.float32)
    normed = weight * (total * scale).to(dtype).to(tl.float32)
    tl.store(normed_ptr + at, normed.to(dtype), mask=inside)


def kernel_applies(x: jax.Array, weight: jax.Array) -> bool:
    """Whether `residual_norm` takes x [..., H] with weight [H]: a float dtype the kernel reads,
    the weight's the same, H at most MAX_CHANNELS."""
    return (
        jnp.dtype(x.dtype) in map(jnp.dtype, DTYPES)
        and weight.dtype == x.dtype
        and weight.shape == x.shape[-1:]
        and x.shape[-1] <= MAX_CHANNELS
    )


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def residual_norm(
    x: jax.Array, delta: jax.Array | None, weight: jax.Array, *, eps: float, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """(total, normed), both [..., H] in x's dtype (module docstring), for x [..., H], delta like x
    or None (total is then x itself), weight [H] in x's dtype."""
    if not kernel_applies(x, weight) or (delta is not None and (delta.shape, delta.dtype) != (x.shape, x.dtype)):
        raise ValueError(
            f"residual_norm: x {x.dtype} {x.shape}, delta "
            f"{None if delta is None else (delta.dtype, delta.shape)} and weight {weight.dtype} {weight.shape} "
            f"must share one dtype of {[jnp.dtype(d).name for d in DTYPES]}, weight [H], H <= {MAX_CHANNELS}"
        )
    channels = x.shape[-1]
    rows = x.size // channels
    has_delta = delta is not None
    out_shape = (jax.ShapeDtypeStruct((rows if has_delta else 1, channels), x.dtype),)
    out_shape += (jax.ShapeDtypeStruct((rows, channels), x.dtype),)
    flat = x.reshape(rows, channels)
    args = (flat, delta.reshape(rows, channels) if has_delta else flat, weight)
    total, normed = triton_call.call(
        _residual_norm,
        args,
        out_shape,
        grid=(rows,),
        constants=launch_constants(channels, has_delta=has_delta, eps=eps),
        name="residual_norm_triton",
        interpret=interpret,
        num_warps=num_warps(channels),
        num_stages=1,
    )
    return (total.reshape(x.shape) if has_delta else x), normed.reshape(x.shape)


def launch_constants(channels: int, *, has_delta: bool, eps: float) -> dict:
    """The kernel's constexpr arguments for rows of `channels`."""
    return dict(CHANNELS=channels, BLOCK=next_power_of_2(channels), HAS_DELTA=has_delta, EPS=float(eps))


def num_warps(channels: int) -> int:
    """Warps per row: 16 channels or more per thread up to 8 warps (a row of 4096 at 8 warps is 16 per thread)."""
    return max(1, min(8, channels // 512))
