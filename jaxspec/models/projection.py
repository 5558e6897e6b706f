"""A decode or verification step's weight projections, as one kernel that streams the weight where it runs.

`extend` multiplies a few token rows (B x T) by each of a layer's weights (the fused q/k/v, the
attention output, the MLP's gate and up with its SwiGLU, the down projection) and the LM head:
`project` and `swiglu` take the einsum the model writes, and run it as XLA's GEMM ("xla") or as
`jaxspec.kernels.thin_matmul_triton` ("triton"; "triton-interpret": in Triton's interpreter, for
tests), which reads the weight at the memory rate where XLA's tiles leave most SMs idle. The
kernel takes calls of at most `MAX_ROWS` token rows in bfloat16, float16 or float32, on one device
or on a mesh whose devices each hold the whole weights (one that splits only the rows, or a
rollout's gathered copy, `Sharding.gathered_weights`: each device runs it on its rows); a longer
call (a prefill), a mesh that splits the weights (whose partitioner splits XLA's GEMMs) or another
dtype runs XLA's. Nothing differentiates through the kernel: the training forward
calls with "xla".
The JAXSPEC_THIN_MATMUL environment variable chooses for impl "auto" (`extend`'s): "auto" (the
default) keeps XLA's GEMMs. The kernel passes its GPU check (`tests/gpu/check_thin_matmul.py`), but
timed both ways on an H100 it wins Qwen3-8B's decode step by 1-3% and loses Qwen3-1.7B's by 5-6%
below 64 rows (BENCHMARKS.md), too narrow and mixed a margin for a rule by shape.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxspec.kernels.dispatch import requested_impl
from jaxspec.models.sharding import Sharding, on_devices, splits_weights

IMPLS = ("auto", "xla", "triton", "triton-interpret")
IMPL_ENV = "JAXSPEC_THIN_MATMUL"
# XLA GPU's threshold (operand elements) under which a vector-by-matrix dot becomes a reduction.
STRENGTH_REDUCED_BELOW = 10_000_000


def project(
    equation: str,
    x: jax.Array,
    w: jax.Array,
    *,
    impl: str = "xla",
    transpose: bool = False,
    preferred_element_type=None,
    sharding: Sharding | None = None,
) -> jax.Array:
    """`jnp.einsum(equation, x, w)` for an equation that contracts x's last dims with w's first
    (e.g. "btnd,ndh->bth"); transpose: w is stored transposed ([N, K], e.g. the tied embedding as
    the LM head: the einsum reads w.T); sharding: the call's mesh (None: one device)."""
    contract = _contracted(equation)
    chosen = _kernel_impl(impl, x, w.T if transpose else w, contract, sharding)
    if chosen == "xla":
        einsum = functools.partial(jnp.einsum, equation, preferred_element_type=preferred_element_type)
        return _as_matrix_product(einsum, x, w.T if transpose else w, contract)
    kernel = functools.partial(
        kernel_module().thin_matmul,
        contract=contract,
        transpose=transpose,
        out_dtype=preferred_element_type,
        interpret=chosen == "triton-interpret",
    )
    return _per_device_rows(kernel, x, w, sharding)


def swiglu(h: jax.Array, gate_up: jax.Array, *, impl: str = "xla", sharding: Sharding | None = None) -> jax.Array:
    """A dense MLP's activation silu(h @ gate) * (h @ up) [..., F] from its normed input h [..., H]
    and stacked gate_up [H, 2, F]: one GEMM and the product (XLA), or one kernel."""
    chosen = _kernel_impl(impl, h, gate_up, 1, sharding)
    if chosen == "xla":
        both = _as_matrix_product(functools.partial(jnp.einsum, "...h,hcf->...cf"), h, gate_up, 1)
        return jax.nn.silu(both[..., 0, :]) * both[..., 1, :]
    kernel = functools.partial(kernel_module().thin_matmul, swiglu=True, interpret=chosen == "triton-interpret")
    return _per_device_rows(kernel, h, gate_up, sharding)


def _as_matrix_product(einsum, x: jax.Array, w: jax.Array, contract: int) -> jax.Array:
    """einsum(x, w), with a single token row (x [1, ..., K...]) by a small weight run as two rows,
    the second zeros, and the first kept. XLA's GPU compiler rewrites a vector-by-matrix dot of
    fewer than `STRENGTH_REDUCED_BELOW` operand elements (K x (1 + N): Qwen3-1.7B's q/k/v and
    attention output, not 8B's) into an elementwise product written to memory and a reduction
    over it, which reads and writes 3x the weight's bytes; two rows keep it a GEMM that reads the
    weight once. A larger weight stays a GEMM and is left alone (the pad would be a launch more)."""
    rows = math.prod(x.shape[: x.ndim - contract])
    k = math.prod(x.shape[x.ndim - contract :])
    if x.ndim == contract or rows != 1 or k * (1 + w.size // k) >= STRENGTH_REDUCED_BELOW:
        return einsum(x, w)
    return einsum(jnp.concatenate([x, jnp.zeros_like(x)]), w)[:1]


def requested(impl: str) -> str:
    """ "xla", "triton" or "triton-interpret": `impl`, or for "auto" the environment variable's
    ("auto" stays XLA's), before asking whether the kernel takes a call."""
    impl = requested_impl(impl, IMPLS, IMPL_ENV, "thin matmul")
    return "xla" if impl == "auto" else impl


def _kernel_impl(impl: str, x: jax.Array, w: jax.Array, contract: int, sharding: Sharding | None) -> str:
    """The implementation ("xla", "triton" or "triton-interpret") for x by w: the requested one
    (`requested`) where the kernel takes the call, else "xla"."""
    impl = requested(impl)
    if impl == "xla" or splits_weights(sharding):
        return "xla"
    return impl if kernel_module().kernel_applies(x, w, contract) else "xla"


def _per_device_rows(kernel, x: jax.Array, w: jax.Array, sharding: Sharding | None) -> jax.Array:
    """kernel(x, w), on a mesh per device on its rows (x's first dim as the batch axes lay it out)
    with the whole weight (`shard_map`)."""
    if not on_devices(sharding):
        return kernel(x, w)
    rows = sharding.spec(("batch",) + (None,) * (x.ndim - 1), x.shape)
    return jax.shard_map(
        kernel, mesh=sharding.mesh, in_specs=(rows, PartitionSpec()), out_specs=PartitionSpec(rows[0]), check_vma=False
    )(x, w)


def _contracted(equation: str) -> int:
    """How many trailing dims of the first operand `equation` contracts with the second's leading
    ones (ValueError for an equation of another form)."""
    inputs, out = equation.replace("...", "").split("->")
    lhs, rhs = inputs.split(",")
    shared = [c for c in rhs if c in lhs and c not in out]
    contract = len(shared)
    if not contract or lhs[-contract:] != "".join(shared) or rhs[:contract] != lhs[-contract:]:
        raise ValueError(f"project: {equation!r} must contract the first operand's last dims with the second's first")
    return contract


def kernel_module():
    """`jaxspec.kernels.thin_matmul_triton`, imported on first use (triton is an optional dependency)."""
    try:
        from jaxspec.kernels import thin_matmul_triton
    except ImportError as e:
        raise ImportError(
            f"the thin matmul kernel needs the triton package ({e}; pip install 'jaxspec[triton]')"
        ) from e
    return thin_matmul_triton
